#!/usr/bin/env bash
# expect.sh [--exit N] REGEX -- COMMAND...: runs COMMAND, prints what it printed (stdout and
# stderr), and passes only when it exited with status N (default 0) AND its output matches the
# extended regular expression REGEX (which may span lines). ctest's PASS_REGULAR_EXPRESSION alone
# ignores the exit status, so a crash or a sanitizer report after the expected output would pass.
# An expected failure must be a clean exit with status N, never a signal.
set -uo pipefail
want=0
if [ "${1:-}" = --exit ]; then want=$2; shift 2; fi
regex=$1
shift
[ "${1:-}" = -- ] && shift
[ $# -gt 0 ] || { echo "expect.sh: no command" >&2; exit 2; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
"$@" >"$out" 2>&1
rc=$?
cat "$out"
if [ "$rc" -ne "$want" ]; then
  echo "expect.sh: exit status $rc, expected $want: $*" >&2
  exit 1
fi
if ! grep -Ezq -- "$regex" "$out"; then
  echo "expect.sh: output does not match /$regex/: $*" >&2
  exit 1
fi
