#!/usr/bin/env bash
# The two reports of a commit whose kernels passed the GPU tests, from a clean tree, alone on the GPU: the
# block report (issue 11), the seed report (norm_out), then the memory figures. Everything lands in
# OUT_DIR/all.tgz (the device returns at most 8 files).
#   bash bench/dev/device_run_reports.sh OUT_DIR [BUDGET_S]
set -u
out=$1
budget=${2:-400}
mkdir -p "$out"
source "$(dirname "$0")/device_lib.sh"
step block-report 120 bash -c "python3 -m adaln_lab block-report --out $out/block_report.json > $out/block_report.log 2>&1"
pack
step report 260 bash -c "python3 -m adaln_lab report --out $out/report.json > $out/report.log 2>&1"
pack
step memory 60 bash -c "python3 bench/dev/memory_figures.py > $out/memory_figures.json 2> $out/memory_figures.log"
pack
echo "done at $SECONDS s"
