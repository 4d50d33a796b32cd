#!/usr/bin/env bash
# Installs the built attn into a scratch prefix, then configures, builds and
# runs tests/consumer against it with find_package(attn).
set -euo pipefail
build_dir=$1
src_dir=$2
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
cmake -S "$src_dir/tests/consumer" -B "$scratch/build" -DCMAKE_PREFIX_PATH="$scratch/prefix" >/dev/null
cmake --build "$scratch/build" >/dev/null
"$scratch/build/consumer"
