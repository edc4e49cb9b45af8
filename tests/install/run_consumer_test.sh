#!/usr/bin/env bash
# Installs a mapping_networks build tree into a scratch prefix, checks what the install exports, then
# builds and runs the consumer project against it. Usage:
#   run_consumer_test.sh CMAKE BUILD_DIR WORK_DIR CONSUMER_SRC CXX_COMPILER CONFIG CUDA_ROOT TOOLS SOURCE_DIR
# CUDA_ROOT is the CUDA toolkit directory the library was built with, or "-" for a build without
# CUDA; TOOLS is the comma-separated list of command-line programs the install must hold; SOURCE_DIR
# is the project's source tree.
#
# What is checked, beyond "the consumer builds and computes the right numbers":
# - the exported targets carry no absolute path (every dependency is an imported target the package
#   config re-finds on the consumer's machine) and no -march=native;
# - find_package(mapping_networks) works with Eigen3 made unfindable (no installed header includes
#   it), and, for a build without CUDA, with the CUDA toolkit made unfindable too;
# - the installed headers pull in no Eigen, CUDA or OpenMP header and hold nothing tied to a CPU
#   feature (alignas, SIMD types), so compiling them with another -march than the library's is safe;
# - the consumer's own compile flags have no -march=native; its link line names no CUDA library when
#   the library was built without CUDA, and, with CUDA, takes the CUDA libraries from where the
#   consumer's CUDA toolkit is (a link to the toolkit under another name), never from the build's path;
# - the command-line tools are installed and `mn-train --help` runs from the install prefix;
# - for a build with CUDA, the configuration without CUDA is checked too, as far as configuring it
#   shows (a few seconds, nothing compiled): its exported targets name no CUDA library.
set -euo pipefail

if [[ $# -ne 9 ]]; then
  echo "usage: $0 CMAKE BUILD_DIR WORK_DIR CONSUMER_SRC CXX_COMPILER CONFIG CUDA_ROOT TOOLS SOURCE_DIR" >&2
  exit 2
fi
cmake_bin=$1 build_dir=$2 work_dir=$3 consumer_src=$4 cxx=$5 config=$6 cuda_root=$7 tools=$8
source_dir=$9
[[ -n $config ]] || config=Release
prefix=$work_dir/prefix
consumer_build=$work_dir/build
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }

# Start clean each time: a stale prefix could hide a header or file the install forgot.
rm -rf "$work_dir"
mkdir -p "$work_dir"

echo "== cmake --install $build_dir --prefix $prefix"
"$cmake_bin" --install "$build_dir" --prefix "$prefix" --config "$config" >"$work_dir/install.log" \
  || { cat "$work_dir/install.log"; echo "FAIL: install"; exit 1; }

# ---- the exported targets, as text ----
package_dir=$prefix/lib/cmake/mapping_networks
[[ -d $package_dir ]] || package_dir=$(dirname "$(find "$prefix" -name mapping_networksConfig.cmake | head -n 1)")
shopt -s nullglob
targets_files=("$package_dir"/mapping_networksTargets*.cmake)
shopt -u nullglob
((${#targets_files[@]})) || { echo "FAIL: no mapping_networksTargets*.cmake under $prefix" >&2; exit 1; }

# check_exported LABEL CUDA_ROOT FILES...: the text of mapping_networksTargets*.cmake files.
check_exported() {
  local label=$1 cuda=$2
  shift 2
  echo "== exported targets, $label (${*##*/})"
  local lines
  lines=$(grep -h 'INTERFACE_' "$@" || true)
  echo "$lines"
  # A link item that is a path: at the start of the quoted list or after a ';' (also inside $<...:>).
  if grep -E 'INTERFACE_LINK_LIBRARIES' <<<"$lines" | grep -qE '("|;|:)/'; then
    fail "$label: the exported link interface names absolute paths (it must name imported targets only)"
  fi
  if grep -qF -- '-march=native' <<<"$lines"; then
    fail "$label: the exported targets pass -march=native on to consumers (it is the library's own flag)"
  fi
  if grep -qF 'Eigen3::' "$@"; then
    fail "$label: the exported targets need Eigen3, which no installed header includes"
  fi
  if [[ $cuda != - ]]; then
    local dir
    for dir in "$cuda" "$(realpath -m "$cuda")"; do
      if grep -qF "$dir" "$@"; then
        fail "$label: the exported targets name the build machine's CUDA directory $dir"
      fi
    done
  elif grep -E 'INTERFACE_LINK_LIBRARIES' <<<"$lines" | grep -qiE 'CUDA::|cudart|cublas|nccl'; then
    fail "$label: the library is built without CUDA, yet its exported targets link CUDA libraries"
  fi
}
check_exported "this build" "$cuda_root" "${targets_files[@]}"

if [[ $cuda_root != - ]]; then
  # The same sources configured without CUDA (and without MN_NATIVE): CMake writes the export files
  # it would install at generate time, so nothing needs compiling.
  cuda_off=$work_dir/configured-without-cuda
  "$cmake_bin" -S "$source_dir" -B "$cuda_off" -DCMAKE_BUILD_TYPE="$config" -DCMAKE_CXX_COMPILER="$cxx" \
    -DMN_WITH_CUDA=OFF -DMN_NATIVE=OFF -DMN_BUILD_TESTS=OFF -DMN_BUILD_EXAMPLES=OFF -DMN_BUILD_BENCH=OFF \
    >"$work_dir/configure-without-cuda.log" 2>&1 \
    || { cat "$work_dir/configure-without-cuda.log"; fail "the project does not configure with MN_WITH_CUDA=OFF"; }
  mapfile -t off_files < <(find "$cuda_off/CMakeFiles/Export" -name 'mapping_networksTargets*.cmake' 2>/dev/null)
  if ((${#off_files[@]})); then
    check_exported "configured with MN_WITH_CUDA=OFF" - "${off_files[@]}"
  else
    fail "configuring with MN_WITH_CUDA=OFF wrote no mapping_networksTargets*.cmake under $cuda_off/CMakeFiles/Export"
  fi
fi

# ---- the installed headers ----
include_dir=$prefix/include/mapping_networks
umbrella=$include_dir/mapping/mapping_networks.h
[[ -f $umbrella ]] || { echo "FAIL: $umbrella is not installed" >&2; exit 1; }
# Every installed header in one translation unit, preprocessed without the library's definitions:
# the files it reads are what a consumer's compiler reads.
all_headers=$work_dir/all_headers.cpp
(cd "$include_dir" && find . -name '*.h' | sort | sed 's|^\./\(.*\)$|#include "\1"|') >"$all_headers"
for unit in "$umbrella" "$all_headers"; do
  if ! included=$("$cxx" -std=c++20 -E -I"$include_dir" -x c++ "$unit" 2>"$work_dir/preprocess.log" \
                   | sed -n 's/^# [0-9]* "\([^"]*\)".*/\1/p' | sort -u); then
    cat "$work_dir/preprocess.log" >&2
    fail "the installed headers do not preprocess on their own ($unit)"
    continue
  fi
  # Only the files from outside the install and this test's folder (which may have "cuda" in its path,
  # as core/cuda.h, which declares the stream functions, has in its name).
  foreign=$(grep -vF "$work_dir/" <<<"$included" | grep -iE '/eigen3?/|/Eigen/|cuda|cublas|nccl|/omp\.h$' || true)
  if [[ -n $foreign ]]; then
    fail "$(basename "$unit") pulls in headers a consumer should not need:"$'\n'"$foreign"
  fi
done
if cpu_tied=$(grep -rnE '\balignas\b|__m(128|256|512)|__AVX|__SSE|immintrin|arm_neon' "$include_dir"); then
  fail "installed headers hold code whose layout or meaning depends on the CPU flags:"$'\n'"$cpu_tied"
fi

# ---- the installed tools ----
IFS=, read -r -a tool_names <<<"$tools"
for tool in "${tool_names[@]}"; do
  [[ -x $prefix/bin/$tool ]] || fail "the install lacks the tool bin/$tool"
done
if [[ -x $prefix/bin/mn-train ]]; then
  # From another directory, so nothing of the build tree is found by accident.
  if help=$(cd "$work_dir" && "$prefix/bin/mn-train" --help 2>&1); then
    grep -q -- '--target' <<<"$help" || fail "installed mn-train --help does not list its options: $help"
  else
    fail "installed mn-train --help failed: $help"
  fi
fi

# ---- the consumer ----
consumer_args=(-DCMAKE_BUILD_TYPE="$config" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_PREFIX_PATH="$prefix"
               -DCMAKE_DISABLE_FIND_PACKAGE_Eigen3=ON)
if [[ $cuda_root == - ]]; then
  consumer_args+=(-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
else
  # The consumer sees the toolkit under another path: every CUDA library on its link line must come
  # from there, i.e. from its own find_package(CUDAToolkit), not from a path the build recorded.
  ln -s "$(realpath "$cuda_root")" "$work_dir/cuda-view"
  consumer_args+=(-DCUDAToolkit_ROOT="$work_dir/cuda-view")
fi
echo "== configure the consumer"
"$cmake_bin" --no-warn-unused-cli -S "$consumer_src" -B "$consumer_build" "${consumer_args[@]}" \
  || { echo "FAIL: the consumer does not configure (${consumer_args[*]})" >&2; exit 1; }

echo "== build the consumer"
"$cmake_bin" --build "$consumer_build" --config "$config" --verbose >"$work_dir/consumer_build.log" 2>&1 \
  || { cat "$work_dir/consumer_build.log"; echo "FAIL: the consumer does not build" >&2; exit 1; }
compile_line=$(grep -E -- ' -c .*main\.cpp' "$work_dir/consumer_build.log" | head -n 1)
link_line=$(grep -E -- ' -o [^ ]*mn_consumer( |$)' "$work_dir/consumer_build.log" | tail -n 1)
echo "compile: $compile_line"
echo "link:    $link_line"
[[ -n $compile_line && -n $link_line ]] || fail "could not find the consumer's compile and link lines"
if grep -qF -- '-march=native' <<<"$compile_line"; then
  fail "the consumer is compiled with -march=native"
fi
if [[ $cuda_root == - ]]; then
  if grep -qE '(lib|-l)(cudart|cublas|cublasLt|nccl|cuda)([._ ]|$)' <<<"$link_line"; then
    fail "the library was built without CUDA, yet the consumer links a CUDA library"
  fi
else
  for dir in "$cuda_root" "$(realpath -m "$cuda_root")"; do
    if grep -qF "$dir" <<<"$link_line"; then
      fail "the consumer's link line names the build machine's CUDA directory $dir"
    fi
  done
  grep -qF "$work_dir/cuda-view/" <<<"$link_line" \
    || fail "the consumer's link line takes no CUDA library from its own CUDA toolkit ($work_dir/cuda-view)"
fi

exe=$consumer_build/mn_consumer
[[ -x $exe ]] || exe=$consumer_build/$config/mn_consumer
echo "== run $exe"
output=$("$exe")
echo "$output"

# y = sum(a * b) with a = [1, 2, 3], b = [4, 5, 6]: y = 32 and dy/da = b.
expected="mn_consumer: y=32 grad_a=4,5,6"
if ! grep -qxF "$expected" <<<"$output"; then
  fail "expected the line '$expected'"
fi
if ((failures)); then
  echo "FAIL: install consumer ($failures problems)" >&2
  exit 1
fi
echo "PASS: install consumer"
