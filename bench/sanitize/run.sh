#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck, initcheck and synccheck over bench/sanitize/small_calls.py (every
# adaln_lab CUDA kernel at small shapes, 0 and 1 rows included), one tool at a time.
#
#   bash bench/sanitize/run.sh OUT_DIR [TOOL ...]          (default: all four tools; about 5-6 min on an H200)
#
# First the workload runs once without a sanitizer (OUT_DIR/sanitize_plain.txt): it must pass, and it fills
# CuPy's kernel cache so no tool run spends its time compiling. Then each tool runs with --error-exitcode 1
# into OUT_DIR/sanitize_<tool>.txt (the workload's output and the tool's report), under a time limit of
# SANITIZE_TIMEOUT seconds (default 150). One summary line per tool: exit status, error count (racecheck:
# hazard errors, and its warnings beside), seconds. Exits 1 if any tool exited non-zero, timed out, left no
# summary or counted an error; 2 on bad usage or a failing plain run. No --leak-check: torch's caching
# allocator keeps its cudaMalloc'd pool until exit by design, and the leak check counts each block (11
# errors on the H200, all c10 CUDACachingAllocator backtraces). COMPUTE_SANITIZER overrides the binary.
set -u
if [ $# -lt 1 ]; then
  echo "usage: bash bench/sanitize/run.sh OUT_DIR [memcheck|racecheck|initcheck|synccheck ...]" >&2
  exit 2
fi
out=$1
shift
tools=${*:-memcheck racecheck initcheck synccheck}
limit=${SANITIZE_TIMEOUT:-150}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
workload="$root/bench/sanitize/small_calls.py"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
mkdir -p "$out"

for tool in $tools; do
  case $tool in
    memcheck|racecheck|initcheck|synccheck) ;;
    *) echo "unknown tool: $tool (memcheck, racecheck, initcheck, synccheck)" >&2; exit 2 ;;
  esac
done
if [ ! -x "$sanitizer" ]; then
  echo "compute-sanitizer not found (set COMPUTE_SANITIZER)" >&2
  exit 2
fi

start=$SECONDS
if ! timeout 300 python3 "$workload" > "$out/sanitize_plain.txt" 2>&1; then
  echo "plain run failed ($((SECONDS - start)) s): see $out/sanitize_plain.txt"
  tail -5 "$out/sanitize_plain.txt"
  exit 2
fi
echo "plain run: ok ($((SECONDS - start)) s)"

failed=0
for tool in $tools; do
  log="$out/sanitize_$tool.txt"
  start=$SECONDS
  timeout "$limit" "$sanitizer" --tool "$tool" --error-exitcode 1 --target-processes all \
    python3 "$workload" > "$log" 2>&1
  code=$?
  summary=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$log" | tail -1)
  # "ERROR SUMMARY: 0 errors" / "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
  errors=$(grep -oE '[0-9,]+ errors?' <<< "$summary" | tail -1 | tr -dc '0-9')
  warns=$(grep -oE '[0-9,]+ warnings?' <<< "$summary" | tail -1 | tr -dc '0-9')
  note=""
  [ "$code" -eq 124 ] && note=" TIMED OUT after $limit s"
  [ -z "$summary" ] && note="$note NO SUMMARY"
  grep -q "small calls done" "$log" || note="$note WORKLOAD DID NOT FINISH"
  printf '%-9s exit %-3s errors %-4s%s %4d s%s  (%s)\n' "$tool" "$code" "${errors:-?}" \
    "${warns:+ warnings $warns}" "$((SECONDS - start))" "$note" "$log"
  if [ "$code" -ne 0 ] || [ -z "$errors" ] || [ "$errors" != 0 ] || [ -n "$note" ]; then
    failed=1
  fi
done
exit $failed
