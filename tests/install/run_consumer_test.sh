#!/usr/bin/env bash
# Installs a mapping_networks build tree into a scratch prefix, then builds and runs the consumer
# project against it. Usage:
#   run_consumer_test.sh CMAKE BUILD_DIR WORK_DIR CONSUMER_SRC CXX_COMPILER [CONFIG]
set -euo pipefail

if [[ $# -lt 5 ]]; then
  echo "usage: $0 CMAKE BUILD_DIR WORK_DIR CONSUMER_SRC CXX_COMPILER [CONFIG]" >&2
  exit 2
fi
cmake_bin=$1 build_dir=$2 work_dir=$3 consumer_src=$4 cxx=$5 config=${6:-Release}
[[ -n $config ]] || config=Release
prefix=$work_dir/prefix
consumer_build=$work_dir/build

# Start clean each time: a stale prefix could hide a header or file the install forgot.
rm -rf "$work_dir"
mkdir -p "$work_dir"

echo "== cmake --install $build_dir --prefix $prefix"
"$cmake_bin" --install "$build_dir" --prefix "$prefix" --config "$config" >"$work_dir/install.log" \
  || { cat "$work_dir/install.log"; echo "FAIL: install"; exit 1; }

echo "== configure the consumer"
"$cmake_bin" -S "$consumer_src" -B "$consumer_build" -DCMAKE_BUILD_TYPE="$config" \
  -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix"

echo "== build the consumer"
"$cmake_bin" --build "$consumer_build" --config "$config"

exe=$consumer_build/mn_consumer
[[ -x $exe ]] || exe=$consumer_build/$config/mn_consumer
echo "== run $exe"
output=$("$exe")
echo "$output"

# y = sum(a * b) with a = [1, 2, 3], b = [4, 5, 6]: y = 32 and dy/da = b.
expected="mn_consumer: y=32 grad_a=4,5,6"
if ! grep -qxF "$expected" <<<"$output"; then
  echo "FAIL: expected the line '$expected'" >&2
  exit 1
fi
echo "PASS: install consumer"
