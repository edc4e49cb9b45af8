#pragma once
// Macros for headers that both the host compiler (C++20) and nvcc (C++17, host and device passes)
// compile.
//
// MN_HOST_DEVICE marks functions compiled for the host and the device (shared arithmetic such as
// Philox and the kernels' index dividers); it is empty outside nvcc.
#if defined(__CUDACC__)
#define MN_HOST_DEVICE __host__ __device__
#else
#define MN_HOST_DEVICE
#endif

// MN_CONSTINIT is C++20's constinit where the language has it. On an extern thread_local variable it
// tells every translation unit that the variable needs no dynamic initialisation, so reads go straight
// to the thread's slot instead of through a TLS wrapper call (which UBSan's null check also misreads
// as a load through a null pointer). It must appear on the defining declaration.
#if __cplusplus >= 202002L
#define MN_CONSTINIT constinit
#else
#define MN_CONSTINIT
#endif
