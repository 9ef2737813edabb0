// The C-library names the kernels use, under nvcc (the C headers) and under NVRTC, which compiles
// without host headers (ninfer/kernels/nvrtc.py): the fixed-width integers as glibc defines them
// on LP64, and INFINITY.
#pragma once
#ifdef __CUDACC_RTC__
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
typedef unsigned long uintptr_t;
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#else
#include <math.h>
#include <stdint.h>
#endif
