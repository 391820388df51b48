#!/usr/bin/env bash
# compute-sanitizer over the CUDA op's small calls (bench/sanitize/small_calls.py), one tool at a time.
# Run from the repository root on a GPU machine: bash bench/sanitize/run.sh OUT_DIR [TOOL ...]
# (default: all four tools). Each tool's report goes to OUT_DIR/sanitize_<tool>.txt; the line printed
# per tool gives its exit status and error summary.
set -u
out=${1:-.}
shift || true
tools=${*:-memcheck racecheck initcheck synccheck}
for tool in $tools; do
  # no --leak-check: torch's caching allocator keeps its cudaMalloc'd pool until exit by design, and the
  # leak check counts each block as an error (11 on the H200, all c10 CUDACachingAllocator backtraces)
  timeout 170 compute-sanitizer --tool "$tool" --target-processes all python3 bench/sanitize/small_calls.py \
    > "$out/sanitize_$tool.txt" 2>&1
  echo "$tool: exit $? : $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.txt" | tail -1)"
done
