# Helpers of the bench/dev/device_run*.sh scripts (sourced; they set `out` and `budget` first).
# left: seconds of the budget left. step NAME SECONDS CMD...: run CMD with at most SECONDS (and never
# past the budget), then print its exit status and time. notebook NAME SECONDS: execute
# notebooks/NAME.ipynb in place (outputs kept) and copy it to OUT. pack: OUT/all.tgz of everything in
# OUT (the device returns at most 8 files).
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
