#!/usr/bin/env bash
# One device run for a kernel change about to be adopted, from a clean tree, within a wall-clock budget:
#   phase 1, side by side (nothing timed): every GPU test; racecheck and memcheck over the small calls;
#   phase 2, alone on the GPU (timed): with AB_VARIANTS, bench/dev/block_ab.py on them; with AB_BASELINE (a
#     clean tree of the commit before), its block_ab.py `shipped` too, for a same-run ratio; then the block
#     report, the block profile, then the seed report (each skipped when the budget is spent).
# Everything lands in OUT_DIR; OUT_DIR/all.tgz packs it after each step (the device returns at most 8 files).
# With PRECHECK (test files), those GPU tests run first, alone, and a failure ends the run there.
#   [AB_VARIANTS="shipped rp_t4"] [AB_BASELINE=DIR] [PYTEST_LIMIT=S] [PRECHECK="tests/test_x.py ..."] \
#     bash bench/dev/device_run_adopt.sh OUT_DIR [BUDGET_S]
set -u
out=$1
budget=${2:-500}
mkdir -p "$out/sanitize"
source "$(dirname "$0")/device_lib.sh"
commit=$(tree_commit)
precheck
step pytest-gpu "${PYTEST_LIMIT:-330}" bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests > $out/pytest_gpu_$commit.txt 2>&1" &
SANITIZE_TIMEOUT=60 step sanitize 150 bash bench/sanitize/run.sh "$out/sanitize" racecheck memcheck &
wait
echo "phase 1 done at $SECONDS s"; tail -2 "$out/pytest_gpu_$commit.txt"; pack
if [ -n "${AB_VARIANTS:-}" ]; then
  step block-ab 120 bash -c "python3 bench/dev/block_ab.py $AB_VARIANTS > $out/block_ab_$commit.json \
    2> $out/block_ab.log"
fi
if [ -n "${AB_BASELINE:-}" ]; then
  base=$(cat "$AB_BASELINE/COMMIT" 2>/dev/null || echo baseline)
  step block-ab-baseline 60 bash -c "cd $AB_BASELINE && PYTHONPATH=/tmp/site:\$PWD \
    python3 bench/dev/block_ab.py shipped \
    > $out/block_ab_$base.json 2> $out/block_ab_baseline.log"
fi
pack
step block-report 120 bash -c "python3 -m adaln_lab block-report --out $out/block_report.json > $out/block_report.log 2>&1"
pack
step block-profile 60 bash -c "python3 bench/dev/block_profile.py adaln_lab > $out/block_profile_$commit.txt 2>&1"
pack
step report 200 bash -c "python3 -m adaln_lab report --out $out/report.json > $out/report.log 2>&1"
pack
echo "done at $SECONDS s"
