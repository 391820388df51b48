# Helpers of the bench/dev/device_run*.sh scripts (sourced; they set `out` and `budget` first).
# left: seconds of the budget left. step NAME SECONDS CMD...: run CMD with at most SECONDS (and never
# past the budget), then print its exit status and time. notebook NAME SECONDS: execute
# notebooks/NAME.ipynb in place (outputs kept) and copy it to OUT. pack: OUT/all.tgz of everything in
# OUT (the device returns at most 8 files). tree_commit: the short commit of the tree (its COMMIT file from a
# `git archive`, else git). precheck: with PRECHECK (test files), those GPU tests first, alone, into
# OUT/pytest_precheck_COMMIT.txt; a failure ends the run (exit 1).
left() { echo $((budget - SECONDS)); }
step() {
  local name=$1 limit=$2; shift 2
  local allowed=$(( $(left) < limit ? $(left) : limit ))
  if [ "$allowed" -lt 15 ]; then echo "$name: skipped (no time left)"; return; fi
  local t0=$SECONDS
  timeout "$allowed" "$@"
  echo "$name: exit $? after $((SECONDS - t0)) s (limit $allowed)"
}
notebook() {
  step "notebook $1" "$2" bash -c "python3 -m adaln_lab.lab.notebooks --write notebooks/$1.ipynb > $out/notebooks/$1.log 2>&1"
  cp "notebooks/$1.ipynb" "$out/notebooks/"
}
pack() { tar czf "$out/all.tgz" -C "$out" --exclude all.tgz . 2>/dev/null; }
tree_commit() { cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown; }
precheck() {
  [ -n "${PRECHECK:-}" ] || return 0
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu $PRECHECK > "$out/pytest_precheck_$commit.txt" 2>&1
  local rc=$?
  echo "precheck: exit $rc after $SECONDS s"; tail -3 "$out/pytest_precheck_$commit.txt"; pack
  [ "$rc" -eq 0 ] || exit 1
}
