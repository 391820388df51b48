#!/usr/bin/env bash
# One development round on the H200 (writes under $OUT): kernel sweep, GPU tests, Nsight Compute, CPU costs.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 bench/dev/sweep.py > "$OUT/sweep.json" 2> "$OUT/sweep.log"; echo "sweep rc=$?"
grep -v Warning "$OUT/sweep.log" | tail -14
timeout 200 python3 -m pytest -q -x tests/test_cupy_backend.py tests/test_numba_backend.py > "$OUT/pytest.txt" 2>&1
echo "pytest rc=$?"; grep -E "passed|failed|Error |assert" "$OUT/pytest.txt" | tail -8
timeout 120 ncu -k regex:"table_bf16|norm_modulate|table_bwd_bf16" --launch-skip 4 --launch-count 4 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
  python3 bench/dev/ncu_target.py > "$OUT/ncu.txt" 2>&1; echo "ncu rc=$?"
grep -E "^  [a-z_]+bf16|Duration|Memory Throughput|DRAM Throughput|Achieved Occupancy|Registers Per|Stall|L2 Cache Throughput|Theoretical Occ" "$OUT/ncu.txt" | head -60
python3 bench/dev/cpu_costs.py > "$OUT/cpu_costs.json" 2> "$OUT/cpu_costs.err"; echo "cpu_costs rc=$?"
head -30 "$OUT/cpu_costs.json"
