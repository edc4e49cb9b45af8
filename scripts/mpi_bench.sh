#!/usr/bin/env bash
# MPI against Gloo on this machine, 2 ranks with a core each, runs interleaved (notes/mpi.md, issue 20):
#   scripts/mpi_bench.sh [BUILD_DIR] [REPEATS]
# 1. all-reduce (sum, f32) time per call at 1 KiB .. 64 MiB: mn_dist_bench allreduce under
#    mn-run --bind-cores (Gloo) and mpirun --bind-to core (MPI), alternating, REPEATS times each;
# 2. a DDP step of CNN2 layerwise 4x672 (batch 32 per rank, one OpenMP thread per rank): mn_dist_bench ddp
#    the same way.
# Prints every run's figures and the median over the repeats per size (all-reduce) or per backend (DDP
# step). Needs a build with Gloo and MPI (MPI=ON in the configure line) and at least 2 CPUs.
set -euo pipefail
build=${1:-build}
repeats=${2:-3}
bench=$build/tests/mn_dist_bench
run=$build/examples/mn-run
mpirun_cmd=(mpirun -np 2 --bind-to core -x OMP_NUM_THREADS=1)
[[ $(id -u) -eq 0 ]] && mpirun_cmd+=(--allow-run-as-root)
[[ -x $bench && -x $run ]] || { echo "build $bench and $run first" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for ((r = 1; r <= repeats; ++r)); do
  "$run" --nproc-per-node 2 --bind-cores "$bench" allreduce | tee -a "$out/allreduce_gloo"
  "${mpirun_cmd[@]}" "$bench" allreduce --backend mpi | tee -a "$out/allreduce_mpi"
done
for ((r = 1; r <= repeats; ++r)); do
  "$run" --nproc-per-node 2 --bind-cores "$bench" ddp --batch 32 --steps 100 | tee -a "$out/ddp_gloo"
  "${mpirun_cmd[@]}" "$bench" ddp --backend mpi --batch 32 --steps 100 | tee -a "$out/ddp_mpi"
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"

median() { sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
echo
echo "all-reduce, median over $repeats runs (time per call [us], algbw [GB/s])"
printf "%10s %12s %12s %12s %12s %10s\n" bytes gloo_us mpi_us gloo_GB/s mpi_GB/s mpi/gloo
for bytes in $(awk '$1 ~ /^[0-9]+$/ {print $1}' "$out/allreduce_gloo" | sort -un); do
  g=$(awk -v b="$bytes" '$1 == b {print $3}' "$out/allreduce_gloo" | median)
  m=$(awk -v b="$bytes" '$1 == b {print $3}' "$out/allreduce_mpi" | median)
  awk -v b="$bytes" -v g="$g" -v m="$m" 'BEGIN {printf "%10d %12.1f %12.1f %12.3f %12.3f %10.2f\n", b, g, m, b / g / 1e3, b / m / 1e3, m / g}'
done
g=$(awk '/median step/ {print $3}' "$out/ddp_gloo" | median)
m=$(awk '/median step/ {print $3}' "$out/ddp_mpi" | median)
echo
awk -v g="$g" -v m="$m" 'BEGIN {printf "DDP step (CNN2 layerwise 4x672, batch 32 per rank), median of the runs'"'"' median steps: gloo %.2f ms, mpi %.2f ms, mpi/gloo %.3f (target <= 1.10)\n", g, m, m / g}'
