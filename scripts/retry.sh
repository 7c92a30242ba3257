# Sourced by the set-up scripts. The registries' downloads can break off mid-file (a 286 MB wheel
# stopped at 200 MB six times in one CI run), so pip resumes a broken download up to 20 times and
# retries a failed connection 10 times, and `retry` runs a whole install step up to 3 times.
export PIP_RETRIES="${PIP_RETRIES:-10}" PIP_TIMEOUT="${PIP_TIMEOUT:-60}"
export PIP_RESUME_RETRIES="${PIP_RESUME_RETRIES:-20}"

retry() {  # retry CMD ARGS...: CMD's status once it succeeds, else the third try's
  local try rc
  for try in 1 2 3; do
    "$@" && return 0
    rc=$?
    [ "$try" = 3 ] || { echo "retry: '$*' failed (exit $rc), try $((try + 1)) of 3 in 15 s" >&2; sleep 15; }
  done
  return "$rc"
}
