#!/usr/bin/env bash
# One device session's lab evidence within a wall-clock budget (the device's 600 s per call), from a clean
# tree of the commit measured (issues 9, 10, 11):
#   phase 1, side by side (nothing timed): the GPU tests of the numba twin, the tables and memory; the
#     memory figures then racecheck; the lab's invariance data; the error notebook;
#   phase 2, alone on the GPU (timed): the latency notebook, then bench/dev/block_ab.py;
#   phase 3: the invariance notebook (reads phase 1's lab_invariance.json).
# Notebooks run with MODE "auto" (measure on the GPU), are written back with their outputs and, through
# $ADALN_LAB_SAVE_DIR, write the lab_*.json they measured. Everything lands in OUT_DIR as it completes.
#   bash bench/dev/device_run_lab.sh OUT_DIR [BUDGET_S]      (needs nbclient, nbformat, ipykernel)
set -u
out=$1
budget=${2:-575}
mkdir -p "$out/lab" "$out/notebooks" "$out/sanitize"
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)
export ADALN_LAB_SAVE_DIR=$out/lab
source "$(dirname "$0")/device_lib.sh"

step pytest-gpu-subset 300 bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_numba_backward.py \
  tests/test_numba_op.py tests/test_numba_backend.py tests/test_block_cuda.py tests/test_modulation_table.py \
  tests/test_memory.py > $out/pytest_gpu_subset_$commit.txt 2>&1" &
( step memory 60 bash -c "python3 bench/dev/memory_figures.py > $out/memory_figures.json 2> $out/memory_figures.log"
  SANITIZE_TIMEOUT=150 step racecheck 160 bash bench/sanitize/run.sh "$out/sanitize" racecheck ) &
step lab-invariance 200 bash -c "python3 -m adaln_lab.lab --out $out/lab --only invariance 2> $out/lab/lab_invariance.log" &
notebook error_analysis 300
wait
echo "phase 1 done at $SECONDS s"
cp "$out/lab/lab_invariance.json" bench/results/h200/ 2>/dev/null
notebook latency_analysis 240
step block-ab 120 bash -c "python3 bench/dev/block_ab.py > $out/block_ab.json 2> $out/block_ab.log"
notebook invariance_walkthrough 120
echo "done at $SECONDS s"
