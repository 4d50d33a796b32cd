#!/usr/bin/env bash
# Installs the built attn into a scratch prefix, then configures, builds and
# runs tests/consumer against it with find_package(attn): one program per
# component (attn::core, attn::io, and the umbrella attn::attn).
set -euo pipefail
build_dir=$1
src_dir=$2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
# The same compiler launcher (ccache) as the build under test, if it has one.
launcher=$(sed -n 's/^CMAKE_CXX_COMPILER_LAUNCHER:[A-Z]*=//p' "$build_dir/CMakeCache.txt")
cmake -S "$src_dir/tests/consumer" -B "$scratch/build" -DCMAKE_PREFIX_PATH="$scratch/prefix" \
  ${launcher:+-DCMAKE_CXX_COMPILER_LAUNCHER="$launcher"} >/dev/null
cmake --build "$scratch/build" -j 2 >/dev/null
for c in core io nn; do "$scratch/build/consumer_$c"; done
