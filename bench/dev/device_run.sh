#!/usr/bin/env bash
# One device session's evidence, in priority order, within a wall-clock budget (the device's 600 s per call):
# the block report, the block profile, the GPU tests, then sanitizer tools while time is left.
#   bash bench/dev/device_run.sh OUT_DIR [BUDGET_S]        (run from a clean tree of the commit measured)
set -u
out=$1
budget=${2:-570}
mkdir -p "$out"
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
left() { echo $((budget - SECONDS)); }
step() {  # step NAME SECONDS CMD...: run CMD with at most SECONDS (and never past the budget)
  local name=$1 limit=$2; shift 2
  local allowed=$(( $(left) < limit ? $(left) : limit ))
  if [ "$allowed" -lt 20 ]; then echo "$name: skipped (no time left)"; return; fi
  local t0=$SECONDS
  timeout "$allowed" "$@"
  echo "$name: exit $? after $((SECONDS - t0)) s (limit $allowed)"
}
step block-report 100 bash -c "python3 -m adaln_lab block-report --out $out/block_report.json > $out/block_report.log 2>&1"
step block-profile 70 bash -c "python3 bench/dev/block_profile.py adaln_lab > $out/block_profile.txt 2>&1"
step pytest-gpu 260 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests > $out/pytest_gpu_$commit.txt 2>&1"
tail -15 "$out/pytest_gpu_$commit.txt" | grep -v "^SKIPPED"
if [ "$(left)" -gt 120 ]; then  # each tool gets a third of what is left after the plain run
  SANITIZE_TIMEOUT=$(( ($(left) - 60) / 3 )) step sanitize $(( $(left) - 5 )) \
    bash bench/sanitize/run.sh "$out/sanitize" memcheck initcheck synccheck
fi
