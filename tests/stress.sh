#!/usr/bin/env bash
# stress.sh BUILD_DIR SECONDS [CTEST ARGS...]: runs the selected ctest tests again and again
# until SECONDS have been spent (at least once), stopping at the first failure, while one core is
# kept busy by a spinning process, so that a test depending on thread timing, or a race that
# shows once in tens of runs, fails here instead of now and then in CI. Prints the repeats done.
# Example: tests/stress.sh build 180 -L 'concurrency|scheduler'
set -euo pipefail
build=$1 seconds=$2
shift 2
spin() { while :; do :; done; }
spin &
spinner=$!
trap 'kill "$spinner" 2>/dev/null || true' EXIT
start=$SECONDS repeats=0
while :; do
  if ! ctest --test-dir "$build" --output-on-failure "$@" >"$build/stress-last.log" 2>&1; then
    cat "$build/stress-last.log"
    echo "stress: failed in repeat $((repeats + 1)) after $((SECONDS - start)) s"
    exit 1
  fi
  repeats=$((repeats + 1))
  ((SECONDS - start < seconds)) || break
done
tail -n 3 "$build/stress-last.log"
echo "stress: $repeats repeats of the selected tests in $((SECONDS - start)) s, none failed"
