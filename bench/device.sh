#!/usr/bin/env bash
# The evidence of bench/results/<machine>/ (bench/README.md), made on the GPU machine from a clean tree, step by step:
#
#   bash bench/device.sh OUT_DIR STEP[+STEP...] [STEP ...]
#
# Steps, each in its own processes under its own time limit, in the order given (a failing or cut step
# does not stop the next):
#   tests         every GPU test (pytest -m gpu, 8 xdist workers)          pytest_gpu.txt
#   compare       outputs and gradients bitwise against the old tree      compare_<old commit>.json, compare.log
#                 at .old_tree/ (adaln_lab.bench.compare_trees)
#   report        python3 -m adaln_lab report, and its table              report.json, report.log, report.md
#   block-report  python3 -m adaln_lab block-report                      block_report.json, block_report.log
#   lab           python3 -m adaln_lab.lab (what the notebooks read)      lab_errors.json, lab_invariance.json,
#                                                                         lab_latency.json, lab.log
#   sanitize      compute-sanitizer over adaln_lab.bench.sanitize_calls  sanitize/sanitize_<tool>.txt,
#                 (plain run first, then one tool at a time)              sanitize_plain.txt, sanitize_summary.txt
#   profile       adaln_lab.bench.block_profile: the block's kernels     block_profile.txt
#   host          adaln_lab.bench.host_breakdown --bounds: host time, bounds, cProfile  host_breakdown.txt
#   host-ab       host_breakdown.py --no-profile, three rounds alternating   host_ab.txt
#                 the tree at .ab_tree/ (its COMMIT file) and this one
#   trace         adaln_lab.bench.host_trace: what grows with the rows   host_trace.txt
#   train         adaln_lab.bench.train_step: a full-width 2-block       train_step.json, train_step.log
#                 train step, bf16 and fp32 master weights + autocast
#   multi         adaln_lab.bench.multi_gpu over every visible GPU:      multi_gpu.json, multi_gpu.log
#                 FSDP2 and context parallelism (ulysses, ring; from 2
#                 GPUs) against one device, a planted counter-example
#   upstream      diffusers' own MiniMax-H3 model tests from a diffusers   diffusers_h3_tests_unpatched.txt,
#                 checkout's tests/ at .dtests/tests (its COMMIT file),    diffusers_h3_tests_patched.txt
#                 unpatched, then every model patched (the plugin
#                 adaln_lab.bench.diffusers_patch_plugin)
#   sweep         adaln_lab.bench.sweep default: each kernel alone       sweep.json, sweep.log
#   memory        adaln_lab.bench.memory_figures: peak and growth        memory_figures.json, memory_figures.log
# STEP+STEP runs steps side by side; only those that time nothing may share the GPU (tests, compare, sanitize,
# memory). After each step: one row per file it made in OUT_DIR/MANIFEST.csv (file,commit,command,torch,date;
# the command as run from the checkout's root, OUT_DIR written as the current directory), and everything in
# OUT_DIR packed into OUT_DIR/all.tgz (the machine hands back few files). Prints "STEP: exit N after S s"
# per step, into OUT_DIR/device_STEP_....log too, and exits 1 if any step failed or was skipped.
#
# Environment: DEVICE_BUDGET (seconds for the whole run, default 570; 0: none): no step starts with less
# than 20 s left and each is cut at what is left. PACK_DIR: also copy all.tgz, MANIFEST.csv and the log
# there after each step. LIMIT_<STEP> (LIMIT_BLOCK_REPORT, ...): a step's limit in seconds. SANITIZE_TOOLS
# (default "memcheck racecheck initcheck synccheck"), SANITIZE_TIMEOUT (seconds per tool, default 120),
# COMPUTE_SANITIZER (the binary). UPSTREAM_RUNS: which of "unpatched patched" the upstream step runs (default
# both); UPSTREAM_TIMEOUT: seconds per run (default 190; a slow host needs more). COMPARE_ARGS: more arguments
# of compare_trees.py ("--device cpu --quick" tries the compare step on a CPU). ADALN_LAB_COMMIT: the commit
# measured (default: the one below).
# The commit: the tree's COMMIT file, else `git rev-parse --short HEAD` ("-dirty" when tracked files differ).
# Wheels in .whl/ (diffusers is not on the machine) go to /tmp/site first, unless PYTHONPATH has it already.
set -u

self=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
root=$(cd "$(dirname "$self")/.." && pwd)
ALL_STEPS="tests compare report block-report lab sanitize profile host host-ab trace train multi upstream sweep memory"
SHARING_STEPS="tests compare sanitize memory upstream"

default_limit() {
  case $1 in
    tests) echo 480 ;; compare) echo 300 ;; report) echo 420 ;; block-report) echo 240 ;; lab) echo 560 ;;
    sanitize) echo 560 ;; profile) echo 150 ;; host) echo 150 ;; host-ab) echo 300 ;; trace) echo 150 ;; train) echo 300 ;; multi) echo 300 ;; upstream) echo 400 ;; sweep) echo 200 ;; memory) echo 120 ;;
  esac
}

# ---- inside one step (bash device.sh --step STEP OUT_DIR) ------------------------------------------------

# run_cmd "FILE [FILE ...]" "COMMAND": notes the files the command makes (OUT_DIR/.pending_STEP, for the
# manifest), then runs it from the checkout's root with every @ in it replaced by OUT_DIR; when it fails,
# the last lines of the last of those files follow.
run_cmd() {
  local files=$1 line=$2 f rc
  for f in $files; do  # a file left by an earlier run must never be recorded under this commit
    rm -f "$out/$f"
    printf '%s|%s\n' "$f" "${line//@\//}" >> "$out/.pending_$step"
  done
  bash -c "${line//@/$out}"
  rc=$?
  [ "$rc" -eq 0 ] || tail -n 5 "$out/${files##* }" 2> /dev/null
  return $rc
}

# within SECONDS: SECONDS, or less where the step's deadline comes first (at least 1). For nested timeouts:
# each runs in a process group of its own, out of reach of the step's.
within() {
  local left=$((${STEP_DEADLINE:-0} - $(date +%s) - 5))
  if [ "${STEP_DEADLINE:-0}" -gt 0 ] && [ "$left" -lt "$1" ]; then
    echo $((left > 1 ? left : 1))
  else
    echo "$1"
  fi
}

step_tests() {
  if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "tests: no CUDA device here: the GPU tests would only skip"
    return 2
  fi
  run_cmd pytest_gpu.txt "python3 -m pytest -q -m gpu $XDIST -p no:cacheprovider --durations=20 tests > @/pytest_gpu.txt 2>&1"
  local rc=$?
  tail -n 3 "$out/pytest_gpu.txt"
  return $rc
}

step_compare() {
  if [ ! -f .old_tree/adaln_lab/__init__.py ]; then
    echo "compare: no .old_tree/adaln_lab here (the old tree must travel with the checkout)"
    return 2
  fi
  local old
  old=$(cat .old_tree/COMMIT 2>/dev/null || echo 6b65938)
  run_cmd "compare_$old.json compare.log" "python3 -m adaln_lab.bench.compare_trees --old .old_tree --old-commit $old \
${COMPARE_ARGS:+$COMPARE_ARGS }--out @/compare_$old.json > @/compare.log 2>&1"
  local rc=$?
  tail -n 4 "$out/compare.log"
  return $rc
}

step_report() {
  run_cmd "report.json report.log" "python3 -m adaln_lab report --out @/report.json > @/report.log 2>&1"
  local rc=$?
  tail -n 2 "$out/report.log"
  run_cmd report.md "python3 -m adaln_lab table @/report.json > @/report.md" || rc=$((rc ? rc : 1))
  return $rc
}

step_block_report() {
  run_cmd "block_report.json block_report.log" \
    "python3 -m adaln_lab block-report --out @/block_report.json > @/block_report.log 2>&1"
  local rc=$?
  tail -n 2 "$out/block_report.log"
  return $rc
}

step_lab() {
  run_cmd "lab_errors.json lab_invariance.json lab_latency.json lab.log" "python3 -m adaln_lab.lab --out @/. > @/lab.log 2>&1"
  local rc=$?
  grep "wrote" "$out/lab.log"
  return $rc
}

step_host() {
  run_cmd host_breakdown.txt "python3 -m adaln_lab.bench.host_breakdown --bounds > @/host_breakdown.txt 2>&1"
  local rc=$?
  grep "host fwd+bwd" "$out/host_breakdown.txt"
  return $rc
}

# host-ab: candidates in one run. host_breakdown.py (this checkout's) imports adaln_lab from .ab_tree/, then from
# here, three times over; each block of lines starts with the tree and its commit.
step_host_ab() {
  if [ ! -f .ab_tree/adaln_lab/__init__.py ]; then
    echo "host-ab: no .ab_tree/adaln_lab here (the tree to compare with must travel with the checkout)"
    return 2
  fi
  local here
  here=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD)
  run_cmd host_ab.txt "for round in 1 2 3; do for tree in .ab_tree .; do if [ \$tree = . ]; then c=$here; else \
c=\$(cat .ab_tree/COMMIT 2>/dev/null || echo unknown); fi; echo \"== \$tree \$c\"; PYTHONPATH=\$tree:\$PYTHONPATH \
python3 adaln_lab/bench/host_breakdown.py --no-profile || exit 1; done; done > @/host_ab.txt 2>&1"
  local rc=$?
  grep -E "^==|host fwd\+bwd" "$out/host_ab.txt"
  return $rc
}

step_train() {
  run_cmd "train_step.json train_step.log" "python3 -m adaln_lab.bench.train_step > @/train_step.json 2> @/train_step.log"
  local rc=$?
  cat "$out/train_step.log"
  return $rc
}

step_multi() {
  local world
  world=$(python3 -c "import torch; print(torch.cuda.device_count())")
  run_cmd "multi_gpu.json multi_gpu.log" \
    "python3 -m adaln_lab.bench.multi_gpu --device cuda --world $world --out @/multi_gpu.json 2> @/multi_gpu.log"
  local rc=$?
  grep -v "^\[rank" "$out/multi_gpu.log" | tail -n 8
  return $rc
}

step_trace() {
  run_cmd host_trace.txt "python3 -m adaln_lab.bench.host_trace > @/host_trace.txt 2>&1"
  local rc=$?
  head -n 8 "$out/host_trace.txt"
  return $rc
}

step_upstream() {
  if [ ! -f .dtests/tests/models/transformers/test_models_transformer_minimax_h3.py ]; then
    echo "upstream: no diffusers tests at .dtests/tests (a diffusers checkout's tests/ must travel with the checkout)"
    return 2
  fi
  local test=tests/models/transformers/test_models_transformer_minimax_h3.py rc=0 f
  for f in ${UPSTREAM_RUNS:-unpatched patched}; do
    local plugin="" path=".."
    [ "$f" = patched ] && plugin=" -p adaln_lab.bench.diffusers_patch_plugin" && path=".."
    run_cmd "diffusers_h3_tests_$f.txt" "cd .dtests && { echo \"diffusers tests/ of commit \$(cat COMMIT 2>/dev/null || echo \
unknown)\"; PYTHONPATH=$path:\$PYTHONPATH timeout $(within ${UPSTREAM_TIMEOUT:-190}) python3 -m pytest -q -rfEX -p no:cacheprovider -n 4$plugin \
$test; } > @/diffusers_h3_tests_$f.txt 2>&1" || rc=1
    tail -n 1 "$out/diffusers_h3_tests_$f.txt"
  done
  return $rc
}

step_profile() {
  run_cmd block_profile.txt "python3 -m adaln_lab.bench.block_profile adaln_lab > @/block_profile.txt 2>&1"
  local rc=$?
  grep -E "^(==|--)" "$out/block_profile.txt"
  return $rc
}

step_sweep() {
  run_cmd "sweep.json sweep.log" "python3 -m adaln_lab.bench.sweep default > @/sweep.json 2> @/sweep.log"
  local rc=$?
  tail -n 2 "$out/sweep.log"
  return $rc
}

step_memory() {
  run_cmd "memory_figures.json memory_figures.log" \
    "python3 -m adaln_lab.bench.memory_figures > @/memory_figures.json 2> @/memory_figures.log"
  local rc=$?
  grep -E '"(peak_over_budget|growth_bytes)"' "$out/memory_figures.json"
  return $rc
}

# compute-sanitizer, one tool at a time, over the small calls (every kernel at small shapes, 0 and 1 rows
# included). The plain run first: it must pass, and it fills CuPy's kernel cache so no tool run compiles.
# Each tool runs with --error-exitcode 1; its summary line (exit, errors, racecheck's warnings, seconds) goes
# to sanitize/sanitize_summary.txt. No --leak-check: torch's caching allocator keeps its pool until exit by
# design, and the leak check counts each of its blocks. Fails if any tool exited non-zero, timed out, left
# no summary, counted an error or did not finish the workload.
step_sanitize() {
  local tools=${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck} limit=${SANITIZE_TIMEOUT:-120}
  local sanitizer=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}
  local workload="-m adaln_lab.bench.sanitize_calls" summary="$out/sanitize/sanitize_summary.txt"
  local tool log t0 code line errors warns note failed=0
  mkdir -p "$out/sanitize"
  printf 'sanitize/sanitize_summary.txt|bash bench/device.sh . sanitize (its summary lines)\n' >> "$out/.pending_$step"
  : > "$summary"
  if [ ! -x "$sanitizer" ]; then
    echo "compute-sanitizer not found (set COMPUTE_SANITIZER)" | tee -a "$summary"
    return 2
  fi
  t0=$SECONDS
  if ! run_cmd sanitize/sanitize_plain.txt "timeout $(within 300) python3 $workload > @/sanitize/sanitize_plain.txt 2>&1"; then
    echo "plain run failed ($((SECONDS - t0)) s): see sanitize/sanitize_plain.txt" | tee -a "$summary"
    tail -n 5 "$out/sanitize/sanitize_plain.txt"
    return 2
  fi
  echo "plain run: ok ($((SECONDS - t0)) s)" | tee -a "$summary"
  for tool in $tools; do
    case $tool in
      memcheck|racecheck|initcheck|synccheck) ;;
      *) echo "unknown tool: $tool (memcheck, racecheck, initcheck, synccheck)" | tee -a "$summary"; failed=1; continue ;;
    esac
    log="sanitize/sanitize_$tool.txt"
    t0=$SECONDS
    if [ "$(within "$limit")" -lt 15 ]; then
      echo "$tool: skipped (the step's time is spent)" | tee -a "$summary"
      failed=1
      continue
    fi
    run_cmd "$log" "timeout $(within "$limit") $sanitizer --tool $tool --error-exitcode 1 --target-processes all python3 $workload \
> @/$log 2>&1"
    code=$?
    # "ERROR SUMMARY: 0 errors" / "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
    line=$(grep -E '(ERROR|RACECHECK) SUMMARY' "$out/$log" | tail -n 1)
    errors=$(grep -oE '[0-9,]+ errors?' <<< "$line" | tail -n 1 | tr -dc '0-9')
    warns=$(grep -oE '[0-9,]+ warnings?' <<< "$line" | tail -n 1 | tr -dc '0-9')
    note=""
    [ "$code" -eq 124 ] && note=" TIMED OUT after $((SECONDS - t0)) s"
    [ -z "$line" ] && note="$note NO SUMMARY"
    grep -q "small calls done" "$out/$log" || note="$note WORKLOAD DID NOT FINISH"
    printf '%-9s exit %-3s errors %-4s%s %4d s%s  (%s)\n' "$tool" "$code" "${errors:-?}" "${warns:+ warnings $warns}" \
      "$((SECONDS - t0))" "$note" "$log" | tee -a "$summary"
    if [ "$code" -ne 0 ] || [ -z "$errors" ] || [ "$errors" != 0 ] || [ -n "$note" ]; then
      failed=1
    fi
  done
  return $failed
}

if [ "${1:-}" = "--step" ]; then
  step=$2
  out=$3
  cd "$root" || exit 2
  "step_${step//-/_}"
  exit $?
fi

# ---- the run ------------------------------------------------------------------------------------------------

usage() {
  echo "usage: bash bench/device.sh OUT_DIR STEP[+STEP...] [STEP ...]   (steps: $ALL_STEPS)" >&2
  exit 2
}
[ $# -ge 2 ] || usage
case $1 in *[[:space:]@]*) echo "OUT_DIR may hold no spaces and no @: $1" >&2; exit 2 ;; esac
out_arg=$1
shift
for group in "$@"; do
  IFS=+ read -r -a members <<< "$group"
  for s in "${members[@]}"; do
    case " $ALL_STEPS " in *" $s "*) ;; *) echo "unknown step: $s" >&2; usage ;; esac
    if [ "${#members[@]}" -gt 1 ]; then
      case " $SHARING_STEPS " in
        *" $s "*) ;;
        *) echo "$s times the GPU: run it alone, not in $group (side by side: $SHARING_STEPS)" >&2; exit 2 ;;
      esac
    fi
  done
done
mkdir -p "$out_arg" || exit 2
out=$(cd "$out_arg" && pwd)
cd "$root" || exit 2
log=device_$(tr ' +' '__' <<< "$*").log  # this invocation's console: device_STEP_STEP....log
exec > >(tee -a "$out/$log") 2>&1

if ls .whl/*.whl > /dev/null 2>&1; then
  case ":${PYTHONPATH:-}:" in
    *:/tmp/site:*) ;;
    *) PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
         || echo "wheels from .whl/ failed to install"
       export PYTHONPATH=/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH} ;;
  esac
fi
case ":${PYTHONPATH:-}:" in *":$root:"*) ;; *) export PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} ;; esac
export PYTHONUNBUFFERED=1

commit=$(cat COMMIT 2>/dev/null)
dirty=""
if [ -z "$commit" ]; then
  commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [ "$commit" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ] && dirty=-dirty
fi
[ "$commit" = unknown ] || export ADALN_LAB_COMMIT=${ADALN_LAB_COMMIT:-$commit}
commit=$commit$dirty
torch_version=$(python3 -c 'import torch;print(torch.__version__)' 2>/dev/null || echo unknown)
XDIST="-n 8"
python3 -c 'import xdist' 2> /dev/null || { XDIST=""; echo "pytest-xdist missing: the tests run in one process"; }
export XDIST
budget=${DEVICE_BUDGET:-570}
echo "device.sh: commit $commit, torch $torch_version, steps $*, out $out, budget ${budget} s"
[ -f "$out/MANIFEST.csv" ] || echo "file,commit,command,torch,date" > "$out/MANIFEST.csv"

manifest_row() {  # manifest_row FILE COMMAND: the file's one row (an older row of the same file goes)
  local file=$1 command=$2 tmp="$out/.MANIFEST.csv.part"
  awk -F, -v f="$file" 'NR == 1 || $1 != f' "$out/MANIFEST.csv" > "$tmp" && mv -f "$tmp" "$out/MANIFEST.csv"
  printf '%s,%s,"%s",%s,%s\n' "$file" "$commit" "${command//\"/\"\"}" "$torch_version" \
    "$(date -u +%Y-%m-%dT%H:%M:%SZ)" >> "$out/MANIFEST.csv"
}

record() {  # record STEP: a manifest row for each file the step noted that exists
  local pending="$out/.pending_$1" file command
  [ -f "$pending" ] || return 0
  while IFS='|' read -r file command; do
    [ -s "$out/$file" ] && manifest_row "$file" "$command"  # an empty file (a step that failed early) gets none
  done < "$pending"
  rm -f "$pending"
}

pack() {
  manifest_row "$log" "bash bench/device.sh . $*"
  tar czf "$out/.all.tgz.part" -C "$out" --exclude=./all.tgz --exclude='./.*' . 2> /dev/null \
    && mv -f "$out/.all.tgz.part" "$out/all.tgz"
  if [ -n "${PACK_DIR:-}" ]; then
    mkdir -p "$PACK_DIR" && cp -f "$out/all.tgz" "$out/MANIFEST.csv" "$out/$log" "$PACK_DIR/" 2> /dev/null
  fi
}

limit_of() {  # the step's limit, cut to what the budget leaves (0: no time left)
  local name=LIMIT_$(tr 'a-z-' 'A-Z_' <<< "$1") limit
  limit=${!name:-$(default_limit "$1")}
  if [ "$budget" -gt 0 ]; then
    local left=$((budget - SECONDS - 10))
    [ "$left" -lt 20 ] && { echo 0; return; }
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "$limit"
}

all_args=$*
failed=0
for group in "$@"; do
  IFS=+ read -r -a members <<< "$group"
  pids=()
  names=()
  for s in "${members[@]}"; do
    limit=$(limit_of "$s")
    if [ "$limit" -eq 0 ]; then
      echo "$s: skipped (DEVICE_BUDGET of $budget s spent)"
      failed=$((failed + 1))
      continue
    fi
    rm -f "$out/.pending_$s"
    (
      t0=$SECONDS
      STEP_DEADLINE=$(($(date +%s) + limit)) timeout -k 10 "$limit" bash "$self" --step "$s" "$out"
      rc=$?
      echo "$s: exit $rc after $((SECONDS - t0)) s (limit $limit s)"
      exit "$rc"
    ) &
    pids+=($!)
    names+=("$s")
  done
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || failed=$((failed + 1))
    record "${names[$i]}"
  done
  pack "$all_args"
done
echo "device.sh: done after $SECONDS s, $failed step(s) failed or skipped"
sleep 1  # the log's last lines through tee
pack "$all_args"
[ "$failed" -eq 0 ]
