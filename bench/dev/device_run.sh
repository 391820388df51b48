#!/usr/bin/env bash
# One device session's evidence, in priority order, within a wall-clock budget (the device's 600 s per call):
# the block report, the block profile, the GPU tests, then sanitizer tools while time is left.
#   bash bench/dev/device_run.sh OUT_DIR [BUDGET_S]        (run from a clean tree of the commit measured)
set -u
out=$1
budget=${2:-570}
mkdir -p "$out"
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
source "$(dirname "$0")/device_lib.sh"
step block-report 100 bash -c "python3 -m adaln_lab block-report --out $out/block_report.json > $out/block_report.log 2>&1"
step block-profile 70 bash -c "python3 bench/dev/block_profile.py adaln_lab > $out/block_profile.txt 2>&1"
step pytest-gpu 260 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests > $out/pytest_gpu_$commit.txt 2>&1"
tail -15 "$out/pytest_gpu_$commit.txt" | grep -v "^SKIPPED"
if [ "$(left)" -gt 120 ]; then  # each tool gets a third of what is left after the plain run
  SANITIZE_TIMEOUT=$(( ($(left) - 60) / 3 )) step sanitize $(( $(left) - 5 )) \
    bash bench/sanitize/run.sh "$out/sanitize" memcheck initcheck synccheck
fi
