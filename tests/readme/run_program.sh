#!/usr/bin/env bash
# Runs one of the README's programs (extracted by tests/CMakeLists.txt) as the ctest test
# readme_program_<n>:
#   run_program.sh [--fashion-mnist] EXE SOURCE DIR
# EXE runs in DIR, emptied first, because a README program writes its files into the working
# directory. An EXE older than SOURCE (the block as extracted at the last configure) is an error: the
# README's current code did not build, and the old binary must not pass for it. With --fashion-mnist
# (the program loads the data set), exits 77, which ctest reports as skipped, when Fashion-MNIST is
# not where data::default_fashion_mnist_root() looks for it.
set -euo pipefail

need_data=0
if [[ ${1:-} == --fashion-mnist ]]; then
  need_data=1
  shift
fi
if (($# != 3)); then
  echo "usage: run_program.sh [--fashion-mnist] EXE SOURCE DIR" >&2
  exit 2
fi
exe=$1 source=$2 dir=$3

if [[ ! -x $exe || $exe -ot $source ]]; then
  echo "$exe is missing or older than $source: the README's program did not build (build the tests again)" >&2
  exit 1
fi

if ((need_data)); then
  root=${MN_FASHION_MNIST_DIR:-/usr/share/datasets/fashion-mnist}
  if [[ ! -e $root/train-images-idx3-ubyte.gz && ! -e $root/train-images-idx3-ubyte ]]; then
    echo "skipped: Fashion-MNIST not found in $root (install dataset-fashion-mnist or set MN_FASHION_MNIST_DIR)"
    exit 77
  fi
fi

# One OpenMP thread unless the caller chose (./mn test gives each test process its share of the cores):
# the programs are small, and two spinning threads on a busy 2-core machine take several times longer.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

rm -rf "$dir"
mkdir -p "$dir"
cd "$dir"
exec "$exe"
