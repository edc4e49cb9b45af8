#!/usr/bin/env bash
# ./mn gpu-bundle: copies what a CUDA build of mapping_networks needs beyond the CUDA toolkit, CMake
# and a C++ compiler into the ignored folder .deps/, laid out as a CMake prefix, so that a bare GPU
# machine (no Eigen, doctest, CLI11, nlohmann-json, Google Benchmark, maybe no zlib headers, no
# network) can configure with -DCMAKE_PREFIX_PATH=.deps (./mn gpu-check does). Run it on this Debian
# machine; it reads the installed Debian packages (./mn deps installs them).
#
#   .deps/include/       eigen3/Eigen, doctest/, CLI/, nlohmann/, benchmark/, zlib.h, zconf.h
#   .deps/lib/           libbenchmark.so.1debian (Debian ships no libbenchmark.a), libbenchmark_main.a,
#                        libz.a
#   .deps/lib/cmake/     our own small, relocatable config files (Eigen3, doctest, CLI11, nlohmann_json,
#                        benchmark): Debian's hard-code /usr paths
#   .deps/datasets/fashion-mnist/   the four .gz files (./mn gpu-check points MN_FASHION_MNIST_DIR here)
#
# No symbolic links: the device tool carries a link as a link.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DEST=${MN_DEPS_DIR:-$ROOT/.deps}
LIBDIR=/usr/lib/x86_64-linux-gnu
DATASET=${MN_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}

log() { printf '[mn gpu-bundle] %s\n' "$*" >&2; }
die() { printf '[mn gpu-bundle] error: %s\n' "$*" >&2; exit 1; }

need() { [[ -e $1 ]] || die "$1 is missing (run ./mn deps, which installs ${2:-the Debian packages})"; }
need /usr/include/eigen3/Eigen/Core libeigen3-dev
need /usr/include/doctest/doctest.h doctest-dev
need /usr/include/CLI/CLI.hpp libcli11-dev
need /usr/include/nlohmann/json.hpp nlohmann-json3-dev
need /usr/include/benchmark/benchmark.h libbenchmark-dev
need "$LIBDIR/libbenchmark_main.a" libbenchmark-dev
need /usr/include/zlib.h zlib1g-dev
need "$LIBDIR/libz.a" zlib1g-dev

# Google Benchmark: Debian 12 ships only the shared library; find the file its SONAME names.
bench_so=$(readlink -f "$LIBDIR/libbenchmark.so")
[[ -f $bench_so ]] || die "$LIBDIR/libbenchmark.so does not resolve to a file"
bench_soname=$(objdump -p "$bench_so" 2>/dev/null | awk '/SONAME/ {print $2}')
[[ -n $bench_soname ]] || bench_soname=$(basename "$bench_so")

version_of() { dpkg-query -W -f='${Version}' "$1" 2>/dev/null | sed -E 's/^[0-9]+://; s/[^0-9.].*$//'; }
eigen_version=$(version_of libeigen3-dev); eigen_version=${eigen_version:-3.4.0}
doctest_version=$(version_of doctest-dev); doctest_version=${doctest_version:-2.4.9}
cli11_version=$(version_of libcli11-dev); cli11_version=${cli11_version:-2.1.2}
json_version=$(version_of nlohmann-json3-dev); json_version=${json_version:-3.11.2}
bench_version=$(version_of libbenchmark-dev); bench_version=${bench_version:-1.7.1}

rm -rf "$DEST"
mkdir -p "$DEST/include/eigen3" "$DEST/lib/cmake" "$DEST/datasets"
# cp -L: files, never links.
cp -rL /usr/include/eigen3/Eigen "$DEST/include/eigen3/"
cp -rL /usr/include/eigen3/signature_of_eigen3_matrix_library "$DEST/include/eigen3/" 2>/dev/null || true
cp -rL /usr/include/doctest /usr/include/CLI /usr/include/nlohmann /usr/include/benchmark "$DEST/include/"
cp -L /usr/include/zlib.h /usr/include/zconf.h "$DEST/include/"
cp -L "$bench_so" "$DEST/lib/$bench_soname"
cp -L "$LIBDIR/libbenchmark_main.a" "$LIBDIR/libz.a" "$DEST/lib/"

# config_file <package> <version>: writes the version file; the caller writes <package>Config.cmake.
version_file() {
  local pkg=$1 version=$2 dir=$DEST/lib/cmake/$1
  mkdir -p "$dir"
  cat >"$dir/${pkg}ConfigVersion.cmake" <<EOF
# Written by scripts/gpu_bundle.sh: same major version, at least the one asked for.
set(PACKAGE_VERSION "$version")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
if(NOT PACKAGE_FIND_VERSION OR (PACKAGE_FIND_VERSION_MAJOR EQUAL "${version%%.*}" AND
   NOT PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION))
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
EOF
}

# header_only <package> <target> <include dir relative to the prefix> <version>
header_only() {
  local pkg=$1 target=$2 inc=$3 version=$4
  version_file "$pkg" "$version"
  cat >"$DEST/lib/cmake/$pkg/${pkg}Config.cmake" <<EOF
# Written by scripts/gpu_bundle.sh (relocatable: paths from this file's location).
get_filename_component(_mn_prefix "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET $target)
  add_library($target INTERFACE IMPORTED)
  set_target_properties($target PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "\${_mn_prefix}/$inc")
endif()
set(${pkg}_FOUND TRUE)
unset(_mn_prefix)
EOF
}

header_only Eigen3 Eigen3::Eigen include/eigen3 "$eigen_version"
cat >>"$DEST/lib/cmake/Eigen3/Eigen3Config.cmake" <<EOF
set(EIGEN3_FOUND TRUE)
set(EIGEN3_VERSION_STRING "$eigen_version")
get_target_property(EIGEN3_INCLUDE_DIR Eigen3::Eigen INTERFACE_INCLUDE_DIRECTORIES)
set(EIGEN3_INCLUDE_DIRS "\${EIGEN3_INCLUDE_DIR}")
EOF
header_only doctest doctest::doctest include "$doctest_version"
header_only CLI11 CLI11::CLI11 include "$cli11_version"
header_only nlohmann_json nlohmann_json::nlohmann_json include "$json_version"

version_file benchmark "$bench_version"
cat >"$DEST/lib/cmake/benchmark/benchmarkConfig.cmake" <<EOF
# Written by scripts/gpu_bundle.sh (relocatable): Debian's shared Google Benchmark $bench_version and
# its static benchmark_main.
get_filename_component(_mn_prefix "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
find_package(Threads REQUIRED)
if(NOT TARGET benchmark::benchmark)
  add_library(benchmark::benchmark SHARED IMPORTED)
  set_target_properties(benchmark::benchmark PROPERTIES
    IMPORTED_LOCATION "\${_mn_prefix}/lib/$bench_soname"
    IMPORTED_SONAME "$bench_soname"
    INTERFACE_INCLUDE_DIRECTORIES "\${_mn_prefix}/include"
    INTERFACE_LINK_LIBRARIES Threads::Threads)
endif()
if(NOT TARGET benchmark::benchmark_main)
  add_library(benchmark::benchmark_main STATIC IMPORTED)
  set_target_properties(benchmark::benchmark_main PROPERTIES
    IMPORTED_LOCATION "\${_mn_prefix}/lib/libbenchmark_main.a"
    INTERFACE_LINK_LIBRARIES benchmark::benchmark)
endif()
set(benchmark_FOUND TRUE)
unset(_mn_prefix)
EOF

if [[ ${MN_BUNDLE_DATASET:-1} == 1 && -d $DATASET ]]; then
  mkdir -p "$DEST/datasets/fashion-mnist"
  for f in train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz; do
    [[ -f $DATASET/$f ]] || die "$DATASET/$f is missing (dataset-fashion-mnist)"
    cp -L "$DATASET/$f" "$DEST/datasets/fashion-mnist/"
  done
else
  log "Fashion-MNIST not bundled (MN_BUNDLE_DATASET=0 or $DATASET missing): gpu-check will skip mn-train"
fi

[[ -z $(find "$DEST" -type l) ]] || die "links in $DEST (they would travel as links)"
bytes=$(du -sb "$DEST" | awk '{print $1}')
tree_bytes=$(cd "$ROOT" && { git ls-files -z; git ls-files -z --others --exclude-standard; } \
  | xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
limit=$((64 * 1024 * 1024))
log "wrote $DEST: $((bytes / 1024)) KiB (Eigen $eigen_version, doctest $doctest_version, CLI11 $cli11_version," \
  "nlohmann_json $json_version, benchmark $bench_version, zlib, dataset: $([[ -d $DEST/datasets/fashion-mnist ]] && echo yes || echo no))"
log "working tree that travels: $((tree_bytes / 1024)) KiB; with .deps $(((bytes + tree_bytes) / 1024)) KiB of the 65536 KiB limit"
((bytes + tree_bytes < limit)) || die "over the 64 MiB a device call carries: rerun with MN_BUNDLE_DATASET=0"
