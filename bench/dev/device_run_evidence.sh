#!/usr/bin/env bash
# The evidence run of a commit whose kernels passed the GPU tests (issues 7, 10, 11), within a wall-clock
# budget, from a clean tree; the notebooks run with MODE "auto" (measure on the GPU) and are written back:
#   phase 1, side by side (nothing timed): the lab's invariance data; the memory figures;
#   phase 2, alone on the GPU (timed): the seed report (copied into bench/results/h200 of this tree, so the
#     notebooks below compare against it), the block report, the latency notebook, the block profile;
#   phase 3, side by side: the error notebook, the invariance notebook.
# Everything lands in OUT_DIR; OUT_DIR/all.tgz packs it (the device returns at most 8 files).
#   bash bench/dev/device_run_evidence.sh OUT_DIR [BUDGET_S]      (needs nbclient, nbformat, ipykernel)
set -u
out=$1
budget=${2:-570}
mkdir -p "$out/lab" "$out/notebooks"
export ADALN_LAB_SAVE_DIR=$out/lab
source "$(dirname "$0")/device_lib.sh"

step lab-invariance 150 bash -c "python3 -m adaln_lab.lab --out $out/lab --only invariance 2> $out/lab/lab_invariance.log" &
step memory 60 bash -c "python3 bench/dev/memory_figures.py > $out/memory_figures.json 2> $out/memory_figures.log" &
wait
cp "$out/lab/lab_invariance.json" bench/results/h200/ 2>/dev/null
echo "phase 1 done at $SECONDS s"; pack
step report 260 bash -c "python3 -m adaln_lab report --out $out/report.json > $out/report.log 2>&1" \
  && [ -s "$out/report.json" ] && cp "$out/report.json" bench/results/h200/report.json
pack
step block-report 110 bash -c "python3 -m adaln_lab block-report --out $out/block_report.json > $out/block_report.log 2>&1"
pack
notebook latency_analysis 90
pack
notebook error_analysis 90 &
notebook invariance_walkthrough 90 &
wait
pack
step block-profile 40 bash -c "python3 bench/dev/block_profile.py adaln_lab > $out/block_profile.txt 2>&1"
pack
echo "done at $SECONDS s"
