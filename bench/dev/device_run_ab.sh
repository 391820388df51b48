#!/usr/bin/env bash
# A short device run from a clean tree of the commit measured: the block's GPU tests side by side with
# the invariance notebook (nothing timed), then, alone on the GPU, bench/dev/block_ab.py on the variants
# given (default: shipped unfused gr128). Everything lands in OUT_DIR/all.tgz.
#   bash bench/dev/device_run_ab.sh OUT_DIR [BUDGET_S] [VARIANT ...]
set -u
out=$1
budget=${2:-420}
shift $(( $# < 2 ? $# : 2 ))
variants=${*:-shipped unfused gr128}
mkdir -p "$out/lab" "$out/notebooks"
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
export ADALN_LAB_SAVE_DIR=$out/lab
source "$(dirname "$0")/device_lib.sh"

step pytest-gpu-block 240 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_block_cuda.py \
  > $out/pytest_gpu_block_$commit.txt 2>&1" &
notebook invariance_walkthrough 200
wait
step block-ab 170 bash -c "python3 bench/dev/block_ab.py $variants > $out/block_ab_$commit.json 2> $out/block_ab.log"
echo "done at $SECONDS s"
pack
