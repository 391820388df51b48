#!/usr/bin/env bash
# compute-sanitizer over the CUDA op's small calls (bench/sanitize/small_calls.py), one tool at a time.
# Run from the repository root on a GPU machine: bash bench/sanitize/run.sh OUT_DIR
# Each tool's report goes to OUT_DIR/sanitize_<tool>.txt; the last line of each says its error count.
set -u
out=${1:-.}
for tool in memcheck racecheck initcheck synccheck; do
  extra=""
  [ "$tool" = memcheck ] && extra="--leak-check full"
  timeout 170 compute-sanitizer --tool "$tool" $extra --target-processes all python3 bench/sanitize/small_calls.py \
    > "$out/sanitize_$tool.txt" 2>&1
  echo "$tool: exit $? : $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$out/sanitize_$tool.txt" | tail -1)"
done
