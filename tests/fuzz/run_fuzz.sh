#!/usr/bin/env bash
# Builds a libFuzzer target with clang++ and AddressSanitizer + UndefinedBehaviorSanitizer, then
# runs it for a bounded number of inputs on a scratch copy of its seed corpus.
#
#   run_fuzz.sh [safetensors] [fuzzer args]  tests/fuzz/fuzz_safetensors.cpp: the safetensors reader
#                                            (seeds tests/fuzz/corpus, 20000 inputs by default)
#   run_fuzz.sh checkpoint [fuzzer args]     tests/fuzz/fuzz_checkpoint.cpp: mapping checkpoints loaded
#                                            into a model and trainer, then one training step (seeds
#                                            tests/fuzz/corpus_checkpoint, 2000 inputs by default)
#
# Exit status: 0 no finding; 77 skipped (no clang++, make or libFuzzer); otherwise a build failure
# or a finding, with libFuzzer's report and the reproducer's path printed.
#
# Only the code under test is built with clang++ and instrumented (coverage, ASan, UBSan): the
# harness, nn/safetensors.cpp and, for the checkpoint target, the checkpoint reader, the trainer and
# the optimizers with their CPU kernels (so that an optimizer kernel reading past a tensor it was
# handed is reported at the access). The rest of the engine they link against (core, kernels,
# autograd, nn, mapping; not dist) is compiled unoptimised and uninstrumented with the project's
# usual compiler (g++: the engine is not required to build with clang 14) and cached in the build
# directory; a generated Makefile with compiler dependency files rebuilds only what changed. The
# instrumented files are compiled without OpenMP (their loops run serially), so the binary has one
# OpenMP runtime, GCC's.
#
# Environment:
#   MN_FUZZ_CXX        compiler for the fuzzer (default clang++)
#   MN_FUZZ_ENGINE_CXX compiler for the engine objects (default g++ when present, else MN_FUZZ_CXX)
#   MN_FUZZ_BUILD_DIR  build and object cache (default ${TMPDIR:-/tmp}/mn-fuzz-build-<uid>)
#   MN_FUZZ_JOBS       parallel compile jobs (default 2)
#   MN_FUZZ_RUNS       inputs to run (default per target, see above)
#   MN_FUZZ_SEED       libFuzzer seed (default 1, so ctest runs are reproducible; 0 = random)
#   EIGEN3_INCLUDE_DIR Eigen headers (default /usr/include/eigen3)
# Fuzzer args go to the fuzzer binary (e.g. -max_total_time=600 -runs=-1 for a long run).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
target=safetensors
if [[ $# -gt 0 && $1 != -* ]]; then
  target=$1
  shift
fi
# The engine sources built instrumented, in both fuzzers (only the checkpoint fuzzer reaches all of
# them; an object cannot leave the shared archive for one fuzzer only, as the archive refers to it).
instrumented_sources=(nn/safetensors.cpp mapping/checkpoint.cpp mapping/trainer.cpp nn/train/state.cpp nn/train/trainer.cpp
                     nn/optim.cpp kernels/cpu/optim.cpp)
# Per target: seed corpus, default inputs, largest input.
case $target in
  safetensors) corpus=$here/corpus default_runs=20000 max_len=4096 ;;
  checkpoint) corpus=$here/corpus_checkpoint default_runs=2000 max_len=16384 ;;
  *)
    echo "run_fuzz.sh: unknown target '$target' (safetensors or checkpoint)" >&2
    exit 2 ;;
esac
cxx=${MN_FUZZ_CXX:-clang++}
if [[ -n "${MN_FUZZ_ENGINE_CXX:-}" ]]; then
  engine_cxx=$MN_FUZZ_ENGINE_CXX
elif command -v g++ >/dev/null 2>&1; then
  engine_cxx=g++
else
  engine_cxx=$cxx
fi
build=${MN_FUZZ_BUILD_DIR:-${TMPDIR:-/tmp}/mn-fuzz-build-$(id -u)}
jobs=${MN_FUZZ_JOBS:-2}
runs=${MN_FUZZ_RUNS:-$default_runs}
seed=${MN_FUZZ_SEED:-1}
eigen=${EIGEN3_INCLUDE_DIR:-/usr/include/eigen3}

skip() {
  echo "run_fuzz.sh: SKIPPED: $*"
  exit 77
}

command -v "$cxx" >/dev/null 2>&1 || skip "$cxx not found (install clang to run the fuzzers: ./mn deps)"
command -v "$engine_cxx" >/dev/null 2>&1 || skip "$engine_cxx not found"
command -v make >/dev/null 2>&1 || skip "make not found"
[[ -f "$eigen/Eigen/Core" ]] || skip "Eigen headers not found in $eigen (set EIGEN3_INCLUDE_DIR)"

# OpenMP runtime for the engine objects: GCC's libgomp when g++ compiles them (clang's -fopenmp
# would add a second runtime, libomp), else clang's own.
if "$engine_cxx" --version 2>/dev/null | grep -qi 'free software foundation'; then
  openmp_link=$("$engine_cxx" -print-file-name=libgomp.so)
  [[ -f "$openmp_link" ]] || skip "libgomp.so not found for $engine_cxx"
else
  openmp_link=-fopenmp
fi

scratch=()
cleanup() { rm -rf "${scratch[@]}"; }
trap cleanup EXIT

# Can clang++ link a libFuzzer binary with the sanitizers and that OpenMP runtime?
probe_dir=$(mktemp -d "${TMPDIR:-/tmp}/mn-fuzz-probe.XXXXXX")
scratch+=("$probe_dir")
cat >"$probe_dir/probe.cpp" <<'PROBE'
#include <cstddef>
#include <cstdint>
extern "C" int omp_get_max_threads();
extern "C" int LLVMFuzzerTestOneInput(const uint8_t*, size_t) { return omp_get_max_threads() > 0 ? 0 : 1; }
PROBE
if ! "$cxx" -std=c++20 -fsanitize=fuzzer,address,undefined "$probe_dir/probe.cpp" $openmp_link \
    -o "$probe_dir/probe" >"$probe_dir/log" 2>&1; then
  cat "$probe_dir/log"
  skip "$cxx cannot link a -fsanitize=fuzzer,address,undefined binary with $openmp_link (libFuzzer missing?)"
fi

# ---- build ----
mkdir -p "$build"
build=$(cd "$build" && pwd)
# Every other engine source goes into one archive, shared by both fuzzers.
engine_objects=()
for dir in core kernels kernels/cpu autograd autograd/functions nn nn/data nn/functional nn/layers nn/train mapping; do
  for f in "$root/$dir"/*.cpp; do
    [[ -e "$f" ]] || continue
    f=${f#"$root"/}
    [[ " ${instrumented_sources[*]} " == *" $f "* ]] && continue
    engine_objects+=("engine/${f%.cpp}.o")
  done
done
instrumented_objects=()
for f in "${instrumented_sources[@]}"; do
  instrumented_objects+=("instrumented/${f%.cpp}.o")
done

makefile_new="$build/Makefile.new"
{
  echo "# Generated by tests/fuzz/run_fuzz.sh; rewritten when the source list or a setting changes."
  echo "ROOT := $root"
  echo "CXX := $cxx"
  echo "ENGINE_CXX := $engine_cxx"
  echo "OPENMP_LINK := $openmp_link"
  echo "ENGINE_FLAGS := -std=c++20 -O0 -g0 -w -fopenmp -I\$(ROOT) -isystem $eigen -MMD -MP"
  echo "SANITIZE := -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
  echo "INSTRUMENTED_FLAGS := -std=c++20 -O1 -g \$(SANITIZE) -w -I\$(ROOT) -isystem $eigen -MMD -MP"
  echo "HARNESS_FLAGS := -std=c++20 -O1 -g \$(SANITIZE) -Wall -Wextra -Werror -I\$(ROOT) -isystem $eigen -MMD -MP"
  echo "LINK := \$(CXX) -fsanitize=fuzzer,address,undefined"
  echo "LIBS := libengine.a \$(OPENMP_LINK) -lz"
  echo "ENGINE_OBJS := ${engine_objects[*]}"
  echo "INSTRUMENTED_OBJS := ${instrumented_objects[*]}"
  cat <<'MAKEFILE'
fuzz_%: harness/fuzz_%.o $(INSTRUMENTED_OBJS) libengine.a
	$(LINK) $< $(INSTRUMENTED_OBJS) $(LIBS) -o $@
# Keep the objects that pattern rules chain through (make would delete them as intermediates).
.SECONDARY:
# Depends on the Makefile so that a source file leaving the engine also leaves the archive.
libengine.a: $(ENGINE_OBJS) Makefile
	rm -f $@
	ar rcs $@ $(ENGINE_OBJS)
engine/%.o: $(ROOT)/%.cpp
	@mkdir -p $(dir $@)
	$(ENGINE_CXX) $(ENGINE_FLAGS) -c $< -o $@
instrumented/%.o: $(ROOT)/%.cpp
	@mkdir -p $(dir $@)
	$(CXX) $(INSTRUMENTED_FLAGS) -c $< -o $@
harness/%.o: $(ROOT)/tests/fuzz/%.cpp
	@mkdir -p harness
	$(CXX) $(HARNESS_FLAGS) -c $< -o $@
-include $(ENGINE_OBJS:.o=.d) $(INSTRUMENTED_OBJS:.o=.d) $(wildcard harness/*.d)
MAKEFILE
} >"$makefile_new"
if cmp -s "$makefile_new" "$build/Makefile"; then
  rm -f "$makefile_new"
else
  mv "$makefile_new" "$build/Makefile"
fi

echo "run_fuzz.sh: $target: building in $build: fuzzer with $cxx, engine objects with $engine_cxx (-j$jobs)"
build_start=$SECONDS
make -C "$build" --no-print-directory -j"$jobs" "fuzz_$target"
echo "run_fuzz.sh: build took $((SECONDS - build_start)) s"

# ---- run ----
work=$(mktemp -d "${TMPDIR:-/tmp}/mn-fuzz-run.XXXXXX")
scratch+=("$work")
cp -R "$corpus" "$work/corpus"  # libFuzzer adds the inputs it finds to its corpus directory
artifacts="$build/artifacts-$target"
mkdir -p "$artifacts"

# MN_NO_CACHING: tensor storage comes straight from malloc, so ASan sees every over-read or
# over-write of a tensor instead of it landing inside a cached segment.
run_start=$SECONDS
set +e
MN_NO_CACHING=1 \
  ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}" \
  UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}" \
  "$build/fuzz_$target" -runs="$runs" -max_len="$max_len" -seed="$seed" -timeout=10 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$work/corpus" "$@"
status=$?
set -e
if [[ $status -ne 0 ]]; then
  echo "run_fuzz.sh: FAILED (fuzzer exit status $status); reproducers in $artifacts:"
  ls -l "$artifacts"
  echo "run_fuzz.sh: reproduce with: MN_NO_CACHING=1 $build/fuzz_$target <file>"
  exit 1
fi
echo "run_fuzz.sh: OK, no findings (fuzzing took $((SECONDS - run_start)) s)"
