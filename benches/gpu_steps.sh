# Sourced by the GPU run scripts: `step NAME LIMIT_S CMD...` runs CMD under min(LIMIT_S, what is left of the
# budget) with its output in $out/NAME.log, and appends a line to $out/steps.tsv (name, exit status: 124 =
# timed out, seconds) as it ends; a step that fails or times out is recorded and the next one still runs.
# The caller sets `out` (an existing directory) and `budget` (seconds) first.
t0=$(date +%s)
printf 'step\texit\tseconds\n' > "$out/steps.tsv"
trap 'printf "script\tended\t%s\n" "$(( $(date +%s) - t0 ))" >> "$out/steps.tsv"' EXIT

# step NAME LIMIT_S CMD...: CMD under min(LIMIT_S, what is left of the budget), output into OUTDIR/NAME.log
step() {
  local name=$1 limit=$2 start rc left
  shift 2
  start=$(date +%s)
  left=$(( budget - (start - t0) ))
  if [ "$left" -lt 15 ]; then
    printf '%s\tskipped: %ss of the budget left\t0\n' "$name" "$left" >> "$out/steps.tsv"
    echo "$name: skipped (${left}s of the budget left)"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - start ))" >> "$out/steps.tsv"
  echo "$name: exit $rc after $(( $(date +%s) - start ))s (limit ${limit}s)"
  tail -4 "$out/$name.log"
}

