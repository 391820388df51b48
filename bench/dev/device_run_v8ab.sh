#!/usr/bin/env bash
# One device run for v8's A/B (nothing adopted from it alone): GPU tests of the changed kernels first (a
# failure ends the run), then bench/dev/block_ab.py on BASE_DIR's `shipped` (the commit before, a clean
# tree) and on this tree's AB_VARIANTS, each within its time limit (the .log keeps each case's line when a
# step is cut short). Everything lands in OUT_DIR/all.tgz.
#   BASE_DIR=../evidence_base AB_VARIANTS="shipped ..." PRECHECK="tests/..." bash bench/dev/device_run_v8ab.sh OUT_DIR [BUDGET_S]
set -u
mkdir -p "$1" && out=$(cd "$1" && pwd)
budget=${2:-540}
source "$(dirname "$0")/device_lib.sh"
commit=$(tree_commit)
precheck
if [ -n "${BASE_DIR:-}" ]; then
  base=$(cat "$BASE_DIR/COMMIT" 2>/dev/null || echo baseline)
  step block-ab-base 90 bash -c "cd $BASE_DIR && PYTHONPATH=/tmp/site:\$PWD python3 bench/dev/block_ab.py shipped \
    > $out/block_ab_${base}_run_$commit.json 2> $out/block_ab_base.log"
  pack
fi
step block-ab "$(left)" bash -c "python3 bench/dev/block_ab.py $AB_VARIANTS > $out/block_ab_$commit.json 2> $out/block_ab.log"
pack
echo "done at $SECONDS s"
