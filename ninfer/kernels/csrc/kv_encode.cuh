// ninfer KV store, CUDA path: the per-word 4-bit encoders and the scale arithmetic, written once
// for the device kernel (store_kv.cu) and for a host build that the CPU tests compare with the
// torch reference (ninfer/kvcache/e8.py, formats.py) bit for bit. Every op is a single IEEE
// round-to-nearest float32 operation in the reference's order: no contraction (explicit _rn
// intrinsics on the device, -ffp-contract=off on the host), rint = round half to even.
#pragma once
#include "rtc_compat.cuh"
#ifndef __CUDACC_RTC__
#include <string.h>  // memcpy, host build only
#endif

#ifdef __CUDACC__
#define KV_HD __host__ __device__ __forceinline__
#else
#define KV_HD static inline
#endif

namespace kv {

KV_HD float fmul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KV_HD float fadd(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KV_HD float ffma(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return fmaf(a, b, c);
#endif
}

// rint (round half to even) and the offset-binary nibble f + 8 of an integer f in [-8, 7]. Float-add
// forms of both (1.5 * 2^23 tricks, off the conversion pipe) measured slower on the H200
// (docs/KERNELS.md, "Store, CUDA").
KV_HD float round_even(float x) { return rintf(x); }
KV_HD uint32_t nibble_of(float f) { return (uint32_t)((int)f + 8); }

// The format's sign s_i = (-1)^f(i), f(i) = parity((i & (i >> 1)) & 0b010101); a compile-time i
// folds it into the adds and multiplies.
KV_HD constexpr float sign_at(int i) {
  return ((((i & (i >> 1)) & 0x15) ^ (((i & (i >> 1)) & 0x15) >> 2) ^ (((i & (i >> 1)) & 0x15) >> 4)) & 1) ? -1.f
                                                                                                      : 1.f;
}

// One 64-group in one thread: a (the input) -> the unnormalised H64 of S.a, in place. Equal to 8
// times the reference's rotate() whenever the 64-term sums are exact (any summation order).
KV_HD void rotate_group(float (&a)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) a[i] = a[i] * sign_at(i);
#pragma unroll
  for (int st = 1; st < 64; st <<= 1) {
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      if (!(i & st)) {
        const float p = a[i], q = a[i | st];
        a[i] = fadd(p, q);
        a[i | st] = fadd(p, -q);
      }
    }
  }
}

// rotate_group's output -> code units z = r x y in place, r = a x s_i / 8 (exact) and y = RN(1 / s)
// (0 for an all-zero group, whose r are all 0); the sign and the 1/8 fold into y exactly.
KV_HD void code_units_group(float (&a)[64], float y) {
  const float yp = 0.125f * y, yn = -0.125f * y;
#pragma unroll
  for (int i = 0; i < 64; ++i) a[i] = fmul(a[i], sign_at(i) > 0.f ? yp : yn);
}

// rk4v4: nibble j = clamp(rint(z_j), -8, 7) + 8.
KV_HD uint32_t encode_scalar4_word(const float (&z)[8]) {
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float f = fminf(fmaxf(round_even(z[j]), -8.f), 7.f);
    word |= nibble_of(f) << (4 * j);
  }
  return word;
}

KV_HD uint32_t fbits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
#endif
}

KV_HD uint32_t popc(uint32_t x) {
#ifdef __CUDA_ARCH__
  return __popc(x);
#else
  return __builtin_popcount(x);
#endif
}

// rk4v4-e8: e8.py's e8_nearest, op for op (see there for why it is the nearest point), for
// z >= -8 (the 4-bit scale rounds up, so code units lie in [-8, 8]), where the reference's lower
// clamp and its z + 8 term change nothing. Per coordinate: f = min(rint(z), 7), r = z - f, a = |r|;
// the integer coset's move key k0 = min(a, 7 - z), the half coset's v = max(a, -7 - z) (its key
// is 0.5 - v); the half coset's value is f - m, m = [r < 0]. Half minus integer distance: 2 - sum(a).
KV_HD uint32_t encode_e8_word(const float (&z)[8]) {
  float lo = 34952.f, hi = 34952.f;  // offset-binary nibbles as exact float sums: 8 x (1+16+256+4096)
  float S = 0.f, K0 = 0.f, V = 0.f;
  float k0s[8], vs[8];
  uint32_t m = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float f = fminf(round_even(z[j]), 7.f);
    const float r = fadd(z[j], -f);
    const float a = fabsf(r);
    k0s[j] = fminf(a, fadd(7.f, -z[j]));
    vs[j] = fmaxf(a, fadd(-7.f, -z[j]));
    S = j == 0 ? a : fadd(S, a);  // sequential j = 0..7
    K0 = j == 0 ? k0s[j] : fmaxf(K0, k0s[j]);
    V = j == 0 ? vs[j] : fminf(V, vs[j]);
    if (j < 4) lo = ffma(f, (float)(1 << (4 * j)), lo);
    else hi = ffma(f, (float)(1 << (4 * (j - 4))), hi);
    m += (fbits(r) & 0x80000000u) >> (31 - 4 * j);
  }
  const uint32_t w0 = (uint32_t)lo | ((uint32_t)hi << 16);
  const uint32_t p0 = popc(w0 & 0x11111111u) & 1, p1 = p0 ^ (popc(m) & 1);
  const float P0 = p0 ? fadd(1.f, -2.f * K0) : 0.f;
  const float P1 = p1 ? fadd(1.f, -2.f * fadd(0.5f, -V)) : 0.f;
  const bool half = fadd(fadd(2.f, -S), P1) < P0;  // ties keep the integer coset
  uint32_t w = half ? w0 - m : w0;
  // the first coordinate with the best key, as a one-hot nibble: scan down, the lowest j wins
  const float best = half ? -V : K0;
  uint32_t one = 0;
#pragma unroll
  for (int j = 7; j >= 0; --j) one = (half ? -vs[j] : k0s[j]) == best ? 1u << (4 * j) : one;
  if (half ? p1 : p0) {
    // toward z: up unless r < 0 (integer coset) / unless r >= 0 (half coset); inward at the box edge
    bool up = ((m & one) != 0) == half;
    const uint32_t nib = w & (one * 15u);
    if (up ? nib == one * 15u : nib == 0) up = !up;
    w = up ? w + one : w - one;
  }
  return (w & ~(1u << 28)) | ((uint32_t)half << 28);
}

}  // namespace kv
