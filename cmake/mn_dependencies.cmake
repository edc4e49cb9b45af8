# Finds the packages the build uses (all from Debian 12; CUDA from /usr/local/cuda).
include(GNUInstallDirs)
find_package(Eigen3 3.3 REQUIRED NO_MODULE)
find_package(OpenMP REQUIRED)
find_package(ZLIB REQUIRED)
find_package(benchmark QUIET)

# Eigen must not start its own BLAS threads beside OpenMP: we use Eigen's own GEMM, parallelised with
# OpenMP, and never link a threaded OpenBLAS, whose threads would compete with OpenMP's for the same
# cores (each pool assumes it has them all).

# ---- CUDA (AUTO: on when a CUDA compiler is found) ----
set(MN_CUDA_ENABLED OFF)
if(NOT MN_WITH_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # H100/H200 (sm_90) machine code plus PTX for newer GPUs.
      set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual")
    endif()
    enable_language(CUDA)
    # CMake 3.25 does not know nvcc's flag for CUDA_STANDARD 20; the library passes -std=c++20.
    find_package(CUDAToolkit REQUIRED)
    # NCCL ships with the CUDA toolkit here but has no CMake config: NCCL::nccl when found.
    include(${CMAKE_CURRENT_LIST_DIR}/mn_find_nccl.cmake)
    set(MN_CUDA_ENABLED ON)
  elseif(MN_WITH_CUDA STREQUAL "ON")
    message(FATAL_ERROR "MN_WITH_CUDA=ON but no CUDA compiler was found")
  endif()
endif()

# ---- Gloo (AUTO: on when Debian's libgloo-dev is installed) ----
set(MN_GLOO_ENABLED OFF)
if(NOT MN_WITH_GLOO STREQUAL "OFF")
  find_package(Gloo QUIET)
  if(Gloo_FOUND OR TARGET gloo)
    set(MN_GLOO_ENABLED ON)
  elseif(MN_WITH_GLOO STREQUAL "ON")
    message(FATAL_ERROR "MN_WITH_GLOO=ON but Gloo was not found (apt-get install libgloo-dev)")
  endif()
endif()

# ---- NCCL (the CUDA process group): needed with CUDA and Gloo (data-parallel builds), used when
# found otherwise, and left out when missing (a CUDA build without Gloo, e.g. ./mn gpu-check on a
# machine with neither) ----
set(MN_NCCL_ENABLED OFF)
if(MN_CUDA_ENABLED)
  if(TARGET NCCL::nccl AND NCCL_INCLUDE_DIR)
    set(MN_NCCL_ENABLED ON)
  elseif(MN_GLOO_ENABLED)
    message(FATAL_ERROR "CUDA and Gloo are on but NCCL was not found (libnccl.so / nccl.h in /usr/local/cuda)")
  else()
    message(STATUS "NCCL not found: the nccl process group is not built")
  endif()
endif()

# ---- MPI (AUTO: on when an MPI library is found, e.g. Debian's libopenmpi-dev) ----
# MPI's C interface from C++ (the project enables no C compiler): FindMPI's CXX component without the
# deprecated C++ bindings, so MPI::MPI_CXX names the C library only.
set(MN_MPI_ENABLED OFF)
if(NOT MN_WITH_MPI STREQUAL "OFF")
  set(MPI_CXX_SKIP_MPICXX ON)
  find_package(MPI QUIET COMPONENTS CXX)
  if(MPI_CXX_FOUND)
    set(MN_MPI_ENABLED ON)
  elseif(MN_WITH_MPI STREQUAL "ON")
    message(FATAL_ERROR "MN_WITH_MPI=ON but MPI was not found (apt-get install libopenmpi-dev openmpi-bin)")
  endif()
endif()
