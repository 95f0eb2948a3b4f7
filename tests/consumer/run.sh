#!/usr/bin/env bash
# Installs the strata build tree BUILD into a fresh prefix, then builds tests/consumer against it
# twice: with find_package(strata CONFIG) and with pkg-config. Fails on any step.
# usage: run.sh BUILD_DIR CONSUMER_SRC WORK_DIR
set -euo pipefail
build=$1 src=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
cmake --install "$build" --prefix "$work/prefix" >"$work/install.log"
test -f "$work/prefix/include/strata/runtime/backend.h"
test -x "$work/prefix/bin/strata-bench"
cmake -S "$src" -B "$work/build" -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_BUILD_TYPE=Release \
  -DHELLO_OFFLOAD_SOURCE="$src/../../examples/hello_offload.c" >"$work/configure.log"
cmake --build "$work/build" >"$work/build.log"
"$work/build/consumer"
"$work/build/hello_offload" | head -1
libdir=$(find "$work/prefix" -name strata.pc -printf '%h\n' | head -1)
flags=$(PKG_CONFIG_PATH="$libdir" pkg-config --cflags --libs --static strata)
c++ -std=c++20 "$src/main.cpp" -o "$work/consumer-pc" $flags
"$work/consumer-pc"
echo "consumer: find_package (C++ and C) and pkg-config builds all ran"
