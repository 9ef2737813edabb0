// ninfer KV store, CUDA path: the per-word 4-bit encoders and the scale arithmetic, written once
// for the device kernel (store_kv.cu) and for a host build that the CPU tests compare with the
// torch reference (ninfer/kvcache/e8.py, formats/) bit for bit. Every op is a single IEEE
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
// (docs/KERNELS.md "KV store").
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

// rk4v4-e8 code units (e8.GRID): the exact product a x y' rounded once to the 2^-8 grid. Next to
// C = 1.5 x 2^15 a float32 has ulp 2^-8, so fma(a, y', C) - C is that rounding (|a y'| <= 8).
KV_HD float grid_unit(float a, float y) { return fadd(ffma(a, y, 49152.f), -49152.f); }

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


// ---------------------------------------------------------------------------------------------
// rk4v4-e8, two words per instruction (kv_store_rows): encode_e8_word's search on fp16 pairs,
// z[j] = (word A's coordinate j, word B's). On the 2^-8 grid with |z| <= 8 every value the search
// forms is exact in fp16 (r, a, the keys, S <= 4, the decision's sums) except t = z + 1544, which
// rounds to the integer on purpose (rint, half to even), and 7 - z / -7 - z where they exceed 8
// (then they lose to a <= 1 whatever their rounding). So it computes what encode_e8_word computes
// on the same z. On the host the pairs are emulated (each op in float32, exact, then rounded to
// fp16), so the CPU tests run this code against the reference.
#ifdef __CUDA_ARCH__
typedef __half2 h2;
__device__ __forceinline__ uint32_t h2_bits(h2 h) { return *reinterpret_cast<uint32_t*>(&h); }
__device__ __forceinline__ h2 bits_h2(uint32_t u) { return *reinterpret_cast<h2*>(&u); }
__device__ __forceinline__ h2 h2_pair(float a, float b) { return __floats2half2_rn(a, b); }
__device__ __forceinline__ h2 h2_add(h2 a, h2 b) { return __hadd2(a, b); }
__device__ __forceinline__ h2 h2_sub(h2 a, h2 b) { return __hsub2(a, b); }
__device__ __forceinline__ h2 h2_min(h2 a, h2 b) { return __hmin2(a, b); }
__device__ __forceinline__ h2 h2_max(h2 a, h2 b) { return __hmax2(a, b); }
__device__ __forceinline__ h2 h2_abs(h2 a) { return __habs2(a); }
__device__ __forceinline__ h2 h2_fma(h2 a, h2 b, h2 c) { return __hfma2(a, b, c); }
__device__ __forceinline__ uint32_t h2_lt_mask(h2 a, h2 b) { return __hlt2_mask(a, b); }
__device__ __forceinline__ uint32_t h2_eq_mask(h2 a, h2 b) { return __heq2_mask(a, b); }
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) { return __byte_perm(a, b, s); }
#else
struct h2 {
  float x, y;
};
static inline float h_round(float v) {  // to fp16 precision, half to even (normal values and 0: all the search forms)
  if (v == 0.f) return v;
  int e;
  frexpf(v, &e);
  const float q = ldexpf(1.f, e - 11);
  return rintf(v / q) * q;
}
static inline uint32_t h_bits(float v) {  // the fp16 bits of a normal fp16 value or 0
  const uint32_t sign = signbit(v) ? 0x8000u : 0u;
  if (v == 0.f) return sign;
  int e;
  const float m = frexpf(fabsf(v), &e);
  return sign | ((uint32_t)(e + 14) << 10) | (uint32_t)((m * 2.f - 1.f) * 1024.f);
}
static inline float h_value(uint32_t b) {
  const int e = (b >> 10) & 31, m = b & 1023;
  const float v = e ? ldexpf(1.f + m / 1024.f, e - 15) : ldexpf((float)m, -24);
  return (b & 0x8000u) ? -v : v;
}
static inline uint32_t h2_bits(h2 h) { return h_bits(h.x) | (h_bits(h.y) << 16); }
static inline h2 bits_h2(uint32_t u) { return {h_value(u & 0xffffu), h_value(u >> 16)}; }
static inline h2 h2_pair(float a, float b) { return {h_round(a), h_round(b)}; }
static inline h2 h2_add(h2 a, h2 b) { return {h_round(a.x + b.x), h_round(a.y + b.y)}; }
static inline h2 h2_sub(h2 a, h2 b) { return {h_round(a.x - b.x), h_round(a.y - b.y)}; }
static inline h2 h2_min(h2 a, h2 b) { return {fminf(a.x, b.x), fminf(a.y, b.y)}; }
static inline h2 h2_max(h2 a, h2 b) { return {fmaxf(a.x, b.x), fmaxf(a.y, b.y)}; }
static inline h2 h2_abs(h2 a) { return {fabsf(a.x), fabsf(a.y)}; }
static inline h2 h2_fma(h2 a, h2 b, h2 c) { return {h_round(fmaf(a.x, b.x, c.x)), h_round(fmaf(a.y, b.y, c.y))}; }
static inline uint32_t h2_lt_mask(h2 a, h2 b) { return (a.x < b.x ? 0xffffu : 0u) | (a.y < b.y ? 0xffff0000u : 0u); }
static inline uint32_t h2_eq_mask(h2 a, h2 b) { return (a.x == b.x ? 0xffffu : 0u) | (a.y == b.y ? 0xffff0000u : 0u); }
static inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t s) {  // __byte_perm for the selectors used here
  const uint64_t x = ((uint64_t)b << 32) | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= (uint32_t)((x >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
#endif

// Words A and B of encode_e8_word at once (same keys, tie rules and moves; z on the grid, |z| <= 8).
KV_HD void encode_e8_pair(const h2 (&z)[8], uint32_t& wa, uint32_t& wb) {
  const h2 c1544 = bits_h2(0x66086608u), c1551 = bits_h2(0x660F660Fu), c7 = bits_h2(0x47004700u),
           cm7 = bits_h2(0xC700C700u), zero = bits_h2(0u);
  h2 S, K0, V, k0s[8], vs[8], f[8];
  uint32_t ml = 0, mh = 0;  // the bits of m for nibbles 0-3 / 4-7, words A | B << 16
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    f[j] = h2_sub(h2_min(h2_add(z[j], c1544), c1551), c1544);  // min(rint(z), 7): 1544 + z rounds at ulp 1
    const h2 r = h2_sub(z[j], f[j]);
    const h2 a = h2_abs(r);
    k0s[j] = h2_min(a, h2_sub(c7, z[j]));
    vs[j] = h2_max(a, h2_sub(cm7, z[j]));
    S = j ? h2_add(S, a) : a;
    K0 = j ? h2_max(K0, k0s[j]) : k0s[j];
    V = j ? h2_min(V, vs[j]) : vs[j];
    const uint32_t neg = h2_lt_mask(r, zero) & (0x00010001u << (4 * (j & 3)));
    if (j < 4) ml |= neg;
    else mh |= neg;
  }
  // the nibble bytes as fp16 sums: 1024 + (f_j + 8) + 16 (f_j+1 + 8) is exact and its low byte is
  // nibbles j, j+1 (FMA pipe, not shifts and masks); then bytes 0 / 2 of the four sums are the words
  h2 by[4];
#pragma unroll
  for (int j = 0; j < 8; j += 2)  // 16 f_j+1 + (f_j + 1160)
    by[j / 2] = h2_fma(f[j + 1], bits_h2(0x4C004C00u), h2_add(f[j], bits_h2(0x64886488u)));
  const uint32_t b01 = prmt(h2_bits(by[0]), h2_bits(by[1]), 0x6240u);  // nibbles 0-3 of A, of B
  const uint32_t b23 = prmt(h2_bits(by[2]), h2_bits(by[3]), 0x6240u);  // nibbles 4-7
  const uint32_t wA = prmt(b01, b23, 0x5410u), wB = prmt(b01, b23, 0x7632u);
  // parities at bit 0 (word A) / 16 (B): x 0x11111111 sums a word's 8 nibble low bits into bits
  // 28..31; x 0x1111 sums the 4 bits of m in each half into bit 12 / 28
  const uint32_t pa = ((wA & 0x11111111u) * 0x11111111u) >> 28, pb = ((wB & 0x11111111u) * 0x11111111u) >> 28;
  const uint32_t p0 = (pa & 1u) | ((pb & 1u) << 16);
  const uint32_t p1 = p0 ^ (((((ml ^ mh) & 0x11111111u) * 0x1111u) >> 12) & 0x00010001u);
  const h2 P0 = bits_h2(h2_bits(h2_fma(bits_h2(0xC000C000u), K0, bits_h2(0x3C003C00u))) & (p0 * 0xFFFFu));
  const h2 P1 = bits_h2(h2_bits(h2_add(V, V)) & (p1 * 0xFFFFu));  // 1 - 2 (0.5 - V) = 2 V
  const uint32_t half = h2_lt_mask(h2_add(h2_sub(bits_h2(0x40004000u), S), P1), P0);  // ties keep the integer coset
  const h2 best = bits_h2((h2_bits(V) & half) | (h2_bits(K0) & ~half));
  uint32_t el = 0, eh = 0;  // nibble j's low bit set where the winning coset's key j is its best
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const h2 key = bits_h2((h2_bits(vs[j]) & half) | (h2_bits(k0s[j]) & ~half));
    const uint32_t eq = h2_eq_mask(key, best) & (0x00010001u << (4 * (j & 3)));
    if (j < 4) el |= eq;
    else eh |= eq;
  }
  const uint32_t odd = (p1 & half) | (p0 & ~half);
  uint32_t out[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const uint32_t sel = e ? 0x7632u : 0x5410u;
    const uint32_t w0 = e ? wB : wA, m = prmt(ml, mh, sel), eq = prmt(el, eh, sel);
    const bool hf = (half >> (16 * e)) & 1;
    uint32_t w = hf ? w0 - m : w0;
    const uint32_t one = eq & (0u - eq);  // the lowest j: ties go to the lowest block position
    bool up = ((m & one) != 0) == hf;
    const uint32_t nib = w & (one * 15u);
    if (up ? nib == one * 15u : nib == 0) up = !up;
    if ((odd >> (16 * e)) & 1) w = up ? w + one : w - one;
    out[e] = (w & ~(1u << 28)) | ((uint32_t)hf << 28);
  }
  wa = out[0];
  wb = out[1];
}

// kv_store_rows after the rotation: code units and the 8 words of one 64-group (word w holds
// coordinates 8j + w). rk4v4-e8 rounds to the grid and searches two words per instruction.
template <int FMT>
KV_HD void encode_group(float (&a)[64], float y, uint32_t (&words)[8]) {
  if (FMT == 3) {
    const float yp = 0.125f * y, yn = -0.125f * y;
    h2 z[4][8];
#pragma unroll
    for (int w = 0; w < 8; w += 2) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int i = 8 * j + w;
        z[w / 2][j] = h2_pair(grid_unit(a[i], sign_at(i) > 0.f ? yp : yn),
                              grid_unit(a[i + 1], sign_at(i + 1) > 0.f ? yp : yn));
      }
    }
#pragma unroll
    for (int w = 0; w < 8; w += 2) encode_e8_pair(z[w / 2], words[w], words[w + 1]);
  } else {
    code_units_group(a, y);
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      float z[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) z[j] = a[8 * j + w];
      words[w] = encode_scalar4_word(z);
    }
  }
}

}  // namespace kv
