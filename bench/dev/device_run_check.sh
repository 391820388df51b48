#!/usr/bin/env bash
# A device session that checks a kernel change (issues 10, 11), within a wall-clock budget, from a clean tree:
#   phase 1, side by side (nothing timed): every GPU test; the numba twin's register figures; the four
#     compute-sanitizer tools over the small calls;
#   phase 2, alone on the GPU (timed): bench/dev/block_ab.py, then bench/dev/block_profile.py.
# Everything lands in OUT_DIR, and OUT_DIR/all.tgz packs it (the device returns at most 8 files).
#   [AB_VARIANTS="shipped unfused ..."] bash bench/dev/device_run_check.sh OUT_DIR [BUDGET_S]
# (AB_VARIANTS: block_ab.py's variants; default every one)
set -u
out=$1
budget=${2:-570}
mkdir -p "$out/sanitize"
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
source "$(dirname "$0")/device_lib.sh"
step pytest-gpu 330 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests > $out/pytest_gpu_$commit.txt 2>&1" &
( step numba-registers 60 bash -c "python3 bench/dev/numba_registers.py > $out/numba_registers.json 2> $out/numba_registers.log"
  SANITIZE_TIMEOUT=60 step sanitize 250 bash bench/sanitize/run.sh "$out/sanitize" memcheck racecheck initcheck synccheck ) &
wait
echo "phase 1 done at $SECONDS s"; pack
tail -3 "$out/pytest_gpu_$commit.txt"
step block-ab 200 bash -c "python3 bench/dev/block_ab.py ${AB_VARIANTS:-} > $out/block_ab_$commit.json 2> $out/block_ab.log"
pack
step block-profile 60 bash -c "python3 bench/dev/block_profile.py adaln_lab > $out/block_profile_$commit.txt 2>&1"
pack
echo "done at $SECONDS s"
