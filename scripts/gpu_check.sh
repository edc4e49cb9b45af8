#!/usr/bin/env bash
# ./mn gpu-check: issue 5's one prepared GPU check, made for a bare device machine (CUDA toolkit,
# CMake, ninja and PyTorch as python3; no Debian packages, no network; never calls apt-get). Run
# ./mn gpu-bundle here first: the device then gets Eigen, doctest, CLI11, nlohmann-json, Google
# Benchmark, zlib and Fashion-MNIST from the carried folder .deps.
#
#   1. nvidia-smi; configure $MN_GPU_BUILD_DIR (default build-gpu) with CUDA on, Gloo when found
#      (else off, and NCCL only where found), CMAKE_PREFIX_PATH=.deps when present, Ninja if there
#   2. build only mn_gpu_tests, mn_bench_cuda_runtime, mn_bench_cuda_train_step, mn-train and mn-run
#   3. ctest -L gpu (skipped, not passed, without a device)
#   4. the CUDA benchmarks (short: --benchmark_min_time), PyTorch's same steps on the same GPU
#      (bench/torch_cuda_step.py), and mn-train --device cuda for one epoch of CNN2 layerwise 4 x 672
#      when the data set is there, then the same under mn-run with --backend nccl, one rank per GPU
#      (at most 2): setup_ddp("nccl") through the TCP store, DDP's all-reduce on NCCL's stream
#   5. Nsight Compute's per-kernel times of a few eager training steps (when ncu is there)
#   6. with the time left before the deadline, compute-sanitizer: memcheck over the GPU tests but
#      NCCL's, then racecheck, synccheck and initcheck over the op tests
#   7. a summary: tests passed/failed/skipped, GEMM TFLOP/s, allocator hit vs cudaMalloc+cudaFree,
#      index-heavy kernels' GB/s, mapped step ms ours vs PyTorch vs our CPU backend, mn-train accuracy
#      and time, the slowest kernels, each sanitizer's errors, and mixed precision: the bf16 epoch's
#      accuracy against the f32 one, resnet18 direct/layerwise steps/s in f32 and under --amp bf16
# Outputs go to $OUT when set (the device tool's folder; at most 8 files come back), else
# out/gpu-check: gpu-check.log (everything), summary.txt, summary.json, gpu_tests.log,
# mn_bench_cuda_runtime.json, mn_bench_cuda_train_step.json, torch_cuda_step.json, mn-train.log.
# Exit status: 0 when the build succeeded and no test or program failed (skipped tests are fine).
#
# Environment: MN_GPU_BUILD_DIR, MN_GPU_CMAKE_ARGS (extra configure arguments, word-split),
# MN_JOBS (default: all cores), MN_GPU_BENCH_MIN_TIME (default 0.1 s per runtime benchmark),
# MN_GPU_STEP_MIN_TIME (default 0.3 s per training-step benchmark),
# MN_FASHION_MNIST_DIR (default .deps/datasets/fashion-mnist, then /usr/share/datasets/fashion-mnist),
# MN_GPU_DEADLINE (default 420: seconds after which no phase runs on; the summary still comes).
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
OUT_DIR=${OUT:-$ROOT/out/gpu-check}
BUILD=${MN_GPU_BUILD_DIR:-$ROOT/build-gpu}
JOBS=${MN_JOBS:-$(nproc 2>/dev/null || echo 2)}
MIN_TIME=${MN_GPU_BENCH_MIN_TIME:-0.1}
STEP_MIN_TIME=${MN_GPU_STEP_MIN_TIME:-0.3}
mkdir -p "$OUT_DIR" "$BUILD"
# One node, no network beyond it: NCCL's bootstrap on the loopback interface (it skips lo by default
# and fails where lo is all there is).
export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-lo}
rm -f "$OUT_DIR"/{gpu-check.log,summary.txt,summary.json,gpu_tests.log,mn_bench_cuda_runtime.json} \
  "$OUT_DIR"/{mn_bench_cuda_train_step.json,torch_cuda_step.json,mn-train.log}
exec > >(tee "$OUT_DIR/gpu-check.log") 2>&1
TEE_PID=$!

T0=$SECONDS
# Every phase ends by this many seconds after the start, so the summary is written even when
# something hangs (the device call's timeout_s should be ~20 s more).
DEADLINE=${MN_GPU_DEADLINE:-420}
declare -A TIMES RCS
log() { printf '[gpu-check %4ds] %s\n' $((SECONDS - T0)) "$*"; }
# phase NAME TIMEOUT_S [--tee FILE] CMD...: runs CMD under timeout (its output also copied to FILE),
# records its exit status and seconds. The timeout shrinks to what the deadline leaves; with less than
# 10 s left the phase is not started (exit status 125).
phase() {
  local name=$1 limit=$2 t=$SECONDS rc=0 copy=/dev/null left
  shift 2
  if [[ $1 == --tee ]]; then
    copy=$2
    shift 2
  fi
  left=$((DEADLINE - (SECONDS - T0) - 10))
  if ((left < 10)); then
    log "== $name: not started, the ${DEADLINE} s deadline is (nearly) reached"
    TIMES[$name]=0
    RCS[$name]=125
    return 125
  fi
  ((limit <= left)) || limit=$left
  log "== $name (limit ${limit} s): $*"
  local rc_file
  rc_file=$(mktemp)
  { timeout --kill-after=10 "$limit" "$@" 2>&1; echo $? >"$rc_file"; } | tee "$copy"
  rc=$(cat "$rc_file")
  rm -f "$rc_file"
  TIMES[$name]=$((SECONDS - t))
  RCS[$name]=$rc
  ((rc == 124 || rc == 137)) && log "$name ran past its ${limit} s limit"
  log "$name: exit $rc after ${TIMES[$name]} s"
  return "$rc"
}

log "root $ROOT, build $BUILD, out $OUT_DIR, $JOBS jobs, $(nproc) cores"
# What a failed configure needs explained, in the one log that comes back.
log "toolchain: $(cmake --version 2>/dev/null | head -1); $(c++ --version 2>/dev/null | head -1);" \
  "nvcc $(command -v nvcc || echo /usr/local/cuda/bin/nvcc); cuBLAS $(ls /usr/local/cuda/lib64/libcublas.so* 2>/dev/null | head -1)"
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 30 nvidia-smi || true
  timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader \
    >"$BUILD/nvidia-smi.txt" 2>/dev/null || true
else
  log "nvidia-smi not found: the GPU tests will report themselves skipped"
  rm -f "$BUILD/nvidia-smi.txt"
fi

# ---- configure ----
cmake_args=(-S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMN_WITH_CUDA=ON -DMN_WITH_GLOO=AUTO
  -DMN_BUILD_TESTS=ON -DMN_BUILD_BENCH=ON -DMN_BUILD_EXAMPLES=ON)
if [[ -d $ROOT/.deps ]]; then
  cmake_args+=("-DCMAKE_PREFIX_PATH=$ROOT/.deps")
else
  log "no .deps folder (./mn gpu-bundle makes it): the dependencies must be installed on this machine"
fi
if command -v ninja >/dev/null 2>&1 && [[ ! -f $BUILD/Makefile ]]; then
  cmake_args+=(-G Ninja)
fi
# shellcheck disable=SC2206
[[ -n ${MN_GPU_CMAKE_ARGS:-} ]] && cmake_args+=(${MN_GPU_CMAKE_ARGS})
TARGETS=(mn_gpu_tests mn_bench_cuda_runtime mn_bench_cuda_train_step mn-train mn-run)
build_ok=0
built() { [[ -f $BUILD/$1 && -x $BUILD/$1 ]]; }
# No stale programs (a failed configure or build must not run an earlier build's), and keep going past
# a failing target: whatever links still runs below.
rm -f "$BUILD"/{tests/mn_gpu_tests,bench/mn_bench_cuda_runtime,bench/mn_bench_cuda_train_step,examples/mn-train,examples/mn-run}
if phase configure 300 cmake "${cmake_args[@]}"; then
  keep_going=(-- -k)
  [[ -f $BUILD/build.ninja ]] && keep_going=(-- -k 0)
  phase build 600 cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" "${keep_going[@]}" && build_ok=1
fi
((build_ok)) || log "configure or build FAILED; running what was built:" \
  $(for t in tests/mn_gpu_tests bench/mn_bench_cuda_runtime bench/mn_bench_cuda_train_step examples/mn-train \
      examples/mn-run; do
      built "$t" && echo "${t##*/}"; done)

have_gpu=0
if built tests/mn_gpu_tests; then
  # Our own runtime's view: main() exits 77 before running anything when there is no usable device.
  timeout 60 "$BUILD/tests/mn_gpu_tests" --test-case=__none__ --no-intro=true >/dev/null 2>&1 && have_gpu=1
elif command -v nvidia-smi >/dev/null 2>&1 && timeout 30 nvidia-smi -L >/dev/null 2>&1; then
  have_gpu=1
fi
log "CUDA device usable: $([[ $have_gpu == 1 ]] && echo yes || echo no)"

# ---- tests ----
built tests/mn_gpu_tests &&
  phase tests 180 --tee "$OUT_DIR/gpu_tests.log" ctest --test-dir "$BUILD" -L gpu -V --output-on-failure

# ---- benchmarks ----
built bench/mn_bench_cuda_runtime &&
  phase bench_runtime 120 "$BUILD/bench/mn_bench_cuda_runtime" --benchmark_min_time="$MIN_TIME" \
    --benchmark_out="$OUT_DIR/mn_bench_cuda_runtime.json" --benchmark_out_format=json
built bench/mn_bench_cuda_train_step &&
  phase bench_train_step 150 "$BUILD/bench/mn_bench_cuda_train_step" --benchmark_min_time="$STEP_MIN_TIME" \
    --benchmark_out="$OUT_DIR/mn_bench_cuda_train_step.json" --benchmark_out_format=json

# ---- PyTorch, same steps, same GPU ----
if ((SECONDS - T0 >= DEADLINE)); then
  log "deadline reached: no PyTorch figures"
elif command -v python3 >/dev/null 2>&1 && timeout 60 python3 -c 'import torch' >/dev/null 2>&1; then
  PYTHONUNBUFFERED=1 phase torch_step 150 python3 "$ROOT/bench/torch_cuda_step.py" --out "$OUT_DIR/torch_cuda_step.json"
else
  log "python3 with torch not found: no PyTorch figures"
fi

# ---- one epoch of mn-train on the device ----
data=${MN_FASHION_MNIST_DIR:-}
if [[ -z $data ]]; then
  for d in "$ROOT/.deps/datasets/fashion-mnist" /usr/share/datasets/fashion-mnist; do
    [[ -f $d/train-images-idx3-ubyte.gz ]] && data=$d && break
  done
fi
if ((have_gpu)) && built examples/mn-train && [[ -n $data ]]; then
  rm -rf "$BUILD/gpu-check-train"  # a fresh run, never a resumed one
  MN_FASHION_MNIST_DIR=$data phase train 120 --tee "$OUT_DIR/mn-train.log" "$BUILD/examples/mn-train" \
    --device cuda --target cnn2 --strategy layerwise --latent-dim 672 --epochs 1 --batch-size 256 --json \
    --out "$BUILD/gpu-check-train"
else
  why='no Fashion-MNIST (./mn gpu-bundle carries it)'
  built examples/mn-train || why='mn-train not built'
  ((have_gpu)) || why='no CUDA device'
  log "mn-train on cuda skipped: $why"
fi

# ---- mixed precision (issue 23): the same epoch under --amp bf16, and resnet18 steps f32 vs bf16 ----
# The bf16 epoch's test accuracy is compared with the f32 one above (target: within 0.3 points); the
# resnet18 runs train a fixed number of batches (--limit) directly and layerwise, in f32 and under
# autocast bf16, and the summary prints steps/s and the bf16 / f32 speed-up (target >= 2). Their logs stay
# in the build folder (8 files at most come back from $OUT; gpu-check.log has every line anyway).
if ((have_gpu)) && built examples/mn-train && [[ -n $data ]]; then
  rm -rf "$BUILD"/gpu-check-amp-*
  MN_FASHION_MNIST_DIR=$data phase train_bf16 120 --tee "$BUILD/mn-train-bf16.log" "$BUILD/examples/mn-train" \
    --device cuda --target cnn2 --strategy layerwise --latent-dim 672 --epochs 1 --batch-size 256 --json \
    --amp bf16 --out "$BUILD/gpu-check-amp-cnn2"
  for strategy in direct layerwise; do
    for amp in f32 bf16; do
      amp_flag=()
      [[ $amp == bf16 ]] && amp_flag=(--amp bf16)
      MN_FASHION_MNIST_DIR=$data phase "resnet18_${strategy}_$amp" 90 \
        --tee "$BUILD/mn-train-resnet18-$strategy-$amp.log" "$BUILD/examples/mn-train" --device cuda \
        --target resnet18 --strategy "$strategy" --epochs 1 --limit 6400 --batch-size 128 --json \
        "${amp_flag[@]+"${amp_flag[@]}"}" --out "$BUILD/gpu-check-amp-resnet18-$strategy-$amp"
    done
  done
fi

# ---- data parallel over NCCL: setup_ddp("nccl") through mn-run's TCP store ----
# One rank per GPU (NCCL refuses two ranks on one device), at most 2: rank 0 publishes the NCCL unique
# id in the store, every rank builds its communicator on cuda:LOCAL_RANK, DDP all-reduces the latents'
# gradients on the group's stream. A short epoch (--limit) keeps it to seconds.
gpus=0
((have_gpu)) && command -v nvidia-smi >/dev/null 2>&1 && gpus=$(timeout 30 nvidia-smi -L 2>/dev/null | grep -c '^GPU')
((gpus > 2)) && gpus=2
if ((gpus >= 1)) && built examples/mn-train && built examples/mn-run && [[ -n $data ]]; then
  rm -rf "$BUILD/gpu-check-ddp"
  MN_FASHION_MNIST_DIR=$data phase ddp_nccl 120 "$BUILD/examples/mn-run" \
    --nproc-per-node "$gpus" "$BUILD/examples/mn-train" --backend nccl --device cuda --target cnn2 \
    --strategy layerwise --latent-dim 672 --epochs 1 --limit 8192 --batch-size 256 --out "$BUILD/gpu-check-ddp"
else
  log "mn-train --backend nccl skipped: $( ((gpus >= 1)) || echo 'no CUDA device'; [[ -n $data ]] || echo 'no data')"
fi

# ---- where a mapped step's GPU time goes ----
# Nsight Compute times each kernel of three eager CNN2 layerwise steps (~133 launches each, after
# ~4 steps of warm-up; under ncu a step takes ~26 ms, so 0.3 s runs ~12) and prints one group per
# kernel name and launch shape; the summary ranks the names by total time. Clocks left alone.
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
rm -f "$BUILD/profile.log"
if ((have_gpu)) && built bench/mn_bench_cuda_train_step && [[ -x $ncu ]]; then
  phase profile 90 --tee "$BUILD/profile.log" "$ncu" --clock-control none --metrics gpu__time_duration.sum \
    --launch-skip 600 --launch-count 400 --print-summary per-kernel "$BUILD/bench/mn_bench_cuda_train_step" \
    --benchmark_filter='BM_CNN2_LayerwiseStep_CUDA/' --benchmark_min_time=0.3
else
  log "profile skipped: $([[ -x $ncu ]] && echo 'no CUDA device or no benchmark program' || echo 'no ncu')"
fi

# ---- compute-sanitizer over the tests, with whatever time is left ----
# memcheck over every GPU test (each kernel against its CPU twin, the mapping code, the runtime), then
# racecheck (shared-memory hazards), synccheck (barriers in divergent code) and initcheck (reads of
# device memory never written) over the op tests. The caching allocator is bypassed so that each
# tensor is its own cudaMalloc block and an out-of-bounds access is reported rather than landing in a
# neighbour. Last, because they are the slowest and only an extra; each tool's log is
# $BUILD/sanitizer-<tool>.log.
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
SANITIZERS=(memcheck racecheck synccheck initcheck)
rm -f "$BUILD"/sanitizer-*.log
if ((have_gpu)) && built tests/mn_gpu_tests && [[ -x $sanitizer ]]; then
  for tool in "${SANITIZERS[@]}"; do
    only=(--source-file='*test_cuda_ops.cpp')
    limit=90
    # Every test but NCCL's (its own library's kernels are not ours to check).
    [[ $tool == memcheck ]] && only=(--source-file-exclude='*test_nccl.cpp') && limit=150
    MN_NO_CACHING=1 phase "$tool" "$limit" --tee "$BUILD/sanitizer-$tool.log" "$sanitizer" --tool "$tool" \
      --error-exitcode 3 --print-limit 20 "$BUILD/tests/mn_gpu_tests" "${only[@]}" --no-intro=true
    # A sanitizer that refuses the device (KINDS.md: gVisor machines) refuses every tool.
    grep -qi "device not supported" "$BUILD/sanitizer-$tool.log" 2>/dev/null && break
  done
else
  log "sanitizers skipped: $([[ -x $sanitizer ]] && echo 'no CUDA device or no test program' || echo 'no compute-sanitizer')"
fi

# ---- summary ----
TIMES[total]=$((SECONDS - T0))
phase_json="{"
for k in "${!TIMES[@]}"; do phase_json+="\"$k\": {\"seconds\": ${TIMES[$k]}, \"rc\": ${RCS[$k]:-0}},"; done
phase_json="${phase_json%,}}"
summary_py=(python3 "$ROOT/scripts/gpu_check_summary.py")
command -v python3 >/dev/null 2>&1 || summary_py=()
if ((${#summary_py[@]})); then
  "${summary_py[@]}" --out "$OUT_DIR" --phases "$phase_json" --build-ok "$build_ok" --have-gpu "$have_gpu" \
    --nvidia-smi "$BUILD/nvidia-smi.txt" --jobs "$JOBS" --phase-logs "$BUILD" ||
    log "summary script failed"
else
  log "no python3: no summary; phases $phase_json"
fi

rc=0
((build_ok)) || rc=1
for k in tests bench_runtime bench_train_step torch_step train ddp_nccl train_bf16 resnet18_direct_f32 \
  resnet18_direct_bf16 resnet18_layerwise_f32 resnet18_layerwise_bf16; do
  [[ -n ${RCS[$k]:-} && ${RCS[$k]} != 0 ]] && rc=1 && log "$k failed (exit ${RCS[$k]})"
done
# A sanitizer fails the check only when it reports errors (its exit 3). A test that fails only under
# it, a sanitizer that refuses the device (as on gVisor machines) or running out of time shows in the
# summary instead.
for tool in "${SANITIZERS[@]}"; do
  if [[ ${RCS[$tool]:-0} == 3 ]] && ! grep -qi "device not supported" "$BUILD/sanitizer-$tool.log" 2>/dev/null; then
    rc=1
    log "$tool found errors (see the $tool phase above)"
  fi
done
log "gpu-check finished in $((SECONDS - T0)) s, exit $rc"
# Let the log's tee drain before exiting, so the last lines reach the console too.
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null
exit "$rc"
