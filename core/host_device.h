#pragma once
// MN_HOST_DEVICE marks functions that both the host compiler and nvcc's device pass compile (shared
// arithmetic such as Philox and the kernels' index dividers); it is empty outside nvcc.
#if defined(__CUDACC__)
#define MN_HOST_DEVICE __host__ __device__
#else
#define MN_HOST_DEVICE
#endif
