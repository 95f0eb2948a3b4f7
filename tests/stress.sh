#!/usr/bin/env bash
# stress.sh BUILD_DIR REPEATS [CTEST ARGS...]: runs the selected ctest tests REPEATS times each
# (stopping at a test's first failure) while one core is kept busy by a spinning process, so
# that a test depending on thread timing fails here instead of now and then in CI.
# Example: tests/stress.sh build 20 -L 'scheduler|runtime'
set -euo pipefail
build=$1 repeats=$2
shift 2
spin() { while :; do :; done; }
spin &
spinner=$!
trap 'kill "$spinner" 2>/dev/null || true' EXIT
ctest --test-dir "$build" --repeat "until-fail:$repeats" --output-on-failure "$@"
