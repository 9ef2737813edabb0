// ninfer KV store, CUDA path: the per-word 4-bit encoders and the scale arithmetic, written once
// for the device kernel (store_kv.cu) and for a host build that the CPU tests compare with the
// torch reference (ninfer/kvcache/e8.py, formats.py) bit for bit. Every op is a single IEEE
// round-to-nearest float32 operation in the reference's order: no contraction (explicit _rn
// intrinsics on the device, -ffp-contract=off on the host), rint = round half to even.
#pragma once
#include <stdint.h>
#include <math.h>

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

// q = RN(a / b) for b > 0 given y = RN(1 / b): q0 = RN(a y), then two Markstein steps
// (r = a - b q is exact by FMA; q + r y rounds correctly once q is within 1 ulp of a/b, which the
// first step guarantees). 5 ops instead of an IEEE division per coordinate; the host test checks
// it against true division for every positive fp16 b.
KV_HD float div_by(float a, float b, float y) {
  float q = fmul(a, y);
  float r = ffma(-b, q, a);
  q = ffma(r, y, q);
  r = ffma(-b, q, a);
  return ffma(r, y, q);
}

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

// rotate_group's output -> code units z = r / s in place (r = a x s_i / 8, exact; 0 where s == 0),
// y = RN(1 / s).
KV_HD void code_units_group(float (&a)[64], float s, float y) {
#pragma unroll
  for (int i = 0; i < 64; ++i) a[i] = s > 0.f ? div_by(fmul(a[i], 0.125f * sign_at(i)), s, y) : 0.f;
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

// Nearest n in [-8, 7]^8 with an even sum to y: e8.py's _nearest_even_in_box with the same
// results, computed with fewer ops. Its key r*t (t = the step to the next-nearest in-box value)
// equals min(|r|, 7 - y, y + 8): |r| inside, the negative distance past the edge at y >= 7 or
// y < -8 (both differences are exact wherever they can win the min). Only the winner's t is
// needed; r = y - f is exact, so e = y - (f + t) = r - t, and the squared distance is the
// reference's sequential sum with one term replaced. -> packed offset-binary nibbles, *d.
KV_HD uint32_t nearest_even_in_box(const float (&y)[8], float* d) {
  float sq[8];
  float best = 0.f, br = 0.f, bf = 0.f;
  int bj = 0;
  uint32_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float f = fminf(fmaxf(round_even(y[j]), -8.f), 7.f);
    const float r = fadd(y[j], -f);
    const float key = fminf(fabsf(r), fminf(fadd(7.f, -y[j]), fadd(y[j], 8.f)));
    sq[j] = fmul(r, r);
    if (j == 0 || key > best) {  // strict: the first maximum wins (argmax's lowest index)
      best = key;
      bj = j;
      br = r;
      bf = f;
    }
    word |= nibble_of(f) << (4 * j);
  }
#ifdef __CUDA_ARCH__
  const bool odd = __popc(word & 0x11111111u) & 1;
#else
  const bool odd = __builtin_popcount(word & 0x11111111u) & 1;
#endif
  float t = br >= 0.f ? 1.f : -1.f;
  const float a = fadd(bf, t);
  if (a > 7.f || a < -8.f) t = -t;  // at the box edge: the inward neighbour
  const float e = fadd(br, -t);
  const float moved = fmul(e, e);
  float dist = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float term = (odd && j == bj) ? moved : sq[j];
    dist = j == 0 ? term : fadd(dist, term);  // sequential j = 0..7, as the reference sums
  }
  if (odd) word = (uint32_t)((int32_t)word + (t > 0.f ? 1 : -1) * (1 << (4 * bj)));
  *d = dist;
  return word;
}

// rk4v4-e8: nearest of both cosets (ties keep the integer one); the coset bit replaces nibble 7's
// low bit (its value is the parity of nibbles 0..6).
KV_HD uint32_t encode_e8_word(const float (&z)[8]) {
  float h[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) h[j] = fadd(z[j], -0.5f);
  float d0, d1;
  uint32_t w0 = nearest_even_in_box(z, &d0);
  uint32_t w1 = nearest_even_in_box(h, &d1);
  bool half = d1 < d0;
  uint32_t w = half ? w1 : w0;
  return (w & ~(1u << 28)) | ((uint32_t)half << 28);
}

}  // namespace kv
