// What host C++ and CUDA device code share below the glue: FASTDIST_HOST_DEVICE marks a function usable from both,
// so that CPU and CUDA kernels compute with one definition. Torch-free.
#pragma once

#ifdef __CUDACC__
#include <cuda_runtime.h>
#endif

#ifndef FASTDIST_HOST_DEVICE
#ifdef __CUDACC__
#define FASTDIST_HOST_DEVICE __host__ __device__
#else
#define FASTDIST_HOST_DEVICE
#endif
#endif
