// ninfer KV store, CUDA path for the 4-bit formats (rk4v4, rk4v4-e8): rotate, scale, quantize,
// pack and scatter new K/V rows into the paged planes, bit-exact with the reference encoder.
//
// Eight lanes own one 64-group of one (token, head, K or V): lane w loads coordinates 8j + w
// (j = 0..7), which are exactly the 8 nibbles of its output word, so nothing is re-laid out.
// R = S.H64.S: the three butterfly stages over j run inside the lane, the three over w through
// width-8 xor shuffles; absmax by three more shuffles. The scale, division and lattice search
// are kv_encode.cuh's (shared with the host build the CPU tests run).
//
// kv_store_rows, for long chunks: one thread owns a whole 64-group (16-byte loads, the butterfly
// and every sign in registers at compile-time indices, the per-group work paid once per 64
// coordinates instead of once per 8, rk4v4-e8's search on fp16 pairs: kv::encode_group);
// kv_store (lane per word) keeps a decode step's latency low.
//
// Compile-time: KV_FMT (2 = rk4v4, 3 = rk4v4-e8), KV_XT (input element type), KV_ST (slot type).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "kv_encode.cuh"

#ifndef KV_FMT
#define KV_FMT 3
#endif
#ifndef KV_XT
#define KV_XT __nv_bfloat16
#endif
#ifndef KV_ST
#define KV_ST int64_t
#endif
#ifndef KV_ROWS_MINB
#define KV_ROWS_MINB 6  // blocks per SM kv_store_rows' registers must allow: 80 registers (H200: 100.8 us vs 107.9 uncapped)
#endif

__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
// two packed inputs (element 2e in the low half) -> floats, exact
__device__ __forceinline__ void to_f32x2(uint32_t u, float& lo, float& hi, __nv_bfloat16*) {
  lo = __uint_as_float(u << 16);
  hi = __uint_as_float(u & 0xffff0000u);
}
__device__ __forceinline__ void to_f32x2(uint32_t u, float& lo, float& hi, __half*) {
  lo = __half2float(__ushort_as_half((unsigned short)(u & 0xffffu)));
  hi = __half2float(__ushort_as_half((unsigned short)(u >> 16)));
}

// absmax (of the rotated group, already x 1/8) -> the fp16 scale as stored (rounded up: the 4-bit
// rule, never 0 for a nonzero group), its float value s and y = RN(1/s), 0 when s = 0. C is a
// power of 2, so absmax x 1/C is the reference's division exactly; saturates at 65504 where the
// reference raises.
__device__ __forceinline__ __half group_scale(float amax, float inv_c, float& s, float& y) {
  const __half s16 = __float2half_ru(fminf(amax * inv_c, 65504.f));
  s = __half2float(s16);
  y = s > 0.f ? __frcp_rn(s) : 0.f;
  return s16;
}

__device__ __forceinline__ uint32_t encode_word(const float (&z)[8]) {
#if KV_FMT == 3
  return kv::encode_e8_word(z);
#else
  return kv::encode_scalar4_word(z);
#endif
}

extern "C" __global__ void __launch_bounds__(128) kv_store(
    const KV_XT* __restrict__ k, const KV_XT* __restrict__ v, int64_t skt, int64_t skh, int64_t svt,
    int64_t svh, uint32_t* __restrict__ kd, __half* __restrict__ ks, uint32_t* __restrict__ vd,
    __half* __restrict__ vs, const KV_ST* __restrict__ slots, int T, int hkv, int g_log2, int page_log2,
    float inv_c) {
  // grid (cdiv(T * 2 * groups * 8, 128), hkv): unit = (token * 2 + K/V) * groups + group
  const int w = threadIdx.x & 7, h = blockIdx.y, groups = 1 << g_log2;
  const int units = T * 2 * groups;
  int unit = (blockIdx.x * blockDim.x + threadIdx.x) >> 3;
  const bool live = unit < units;
  if (!live) unit = units - 1;  // same work, no store: the 8-lane shuffles stay whole
  const int g = unit & (groups - 1), which = (unit >> g_log2) & 1;
  const int64_t t = unit >> (g_log2 + 1);
  const KV_XT* x = (which ? v + t * svt + h * svh : k + t * skt + h * skh) + g * 64 + w;
  // sign s_i of coordinate i = 8j + w: f(i) = b0 b1 ^ b2 b3 ^ b4 b5 = f(w) ^ (b2(w) & j0) ^ (j1 & j2);
  // the lane part is one of two registers, the j part a compile-time sign
  const float s_even = (((w & 1) & (w >> 1)) ? -1.f : 1.f);
  const float s_odd = (w & 4) ? -s_even : s_even;

  float a[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) a[j] = to_f32(x[8 * j]) * ((j & 1) ? s_odd : s_even) * ((j & 6) == 6 ? -1.f : 1.f);
  // unnormalised H64: index bits 3..5 (j) in the lane, bits 0..2 (w) across lanes
#pragma unroll
  for (int s = 1; s < 8; s <<= 1) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (!(j & s)) {
        float p = a[j], q = a[j | s];
        a[j] = kv::fadd(p, q);
        a[j | s] = kv::fadd(p, -q);
      }
    }
  }
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) {
    const float sg = (w & m) ? -1.f : 1.f;  // upper lane of the pair: partner - own
#pragma unroll
    for (int j = 0; j < 8; ++j) a[j] = kv::ffma(a[j], sg, __shfl_xor_sync(0xffffffffu, a[j], m, 8));
  }
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(a[j]));
#pragma unroll
  for (int m = 1; m < 8; m <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m, 8));
  float s, y;
  const __half s16 = group_scale(amax * 0.125f, inv_c, s, y);  // the rotation's 1/8: exact
  const float yp = 0.125f * y, yn = -0.125f * y;  // code units: the signs and the 1/8 fold into y exactly
  float z[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const float sign = ((j & 1) ? s_odd : s_even) * ((j & 6) == 6 ? -1.f : 1.f);
    z[j] = KV_FMT == 3 ? kv::grid_unit(a[j], sign > 0.f ? yp : yn) : kv::fmul(a[j], sign > 0.f ? yp : yn);
  }
  const uint32_t word = encode_word(z);
  const int64_t slot = (int64_t)slots[t];
  if (live && slot >= 0) {
    const int64_t page = slot >> page_log2, off = slot & ((1 << page_log2) - 1);
    const int64_t row = ((page * hkv + h) << page_log2) + off;
    (which ? vd : kd)[row * (groups * 8) + g * 8 + w] = word;
    if (w == 0) (which ? vs : ks)[row * groups + g] = s16;
  }
}

extern "C" __global__ void __launch_bounds__(128, KV_ROWS_MINB) kv_store_rows(
    const KV_XT* __restrict__ k, const KV_XT* __restrict__ v, int64_t skt, int64_t skh, int64_t svt,
    int64_t svh, uint32_t* __restrict__ kd, __half* __restrict__ ks, uint32_t* __restrict__ vd,
    __half* __restrict__ vs, const KV_ST* __restrict__ slots, int T, int hkv, int g_log2, int page_log2,
    float inv_c) {
  // grid (cdiv(T * 2 * groups, 128), hkv); the wrapper checked 16-byte alignment of every group
  const int h = blockIdx.y, groups = 1 << g_log2;
  const int unit = blockIdx.x * blockDim.x + threadIdx.x;
  if (unit >= T * 2 * groups) return;
  const int g = unit & (groups - 1), which = (unit >> g_log2) & 1;
  const int64_t t = unit >> (g_log2 + 1);
  const uint4* x = reinterpret_cast<const uint4*>((which ? v + t * svt + h * svh : k + t * skt + h * skh) + g * 64);
  float a[64];
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const uint4 u = __ldg(x + c);
    const uint32_t p[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) to_f32x2(p[e], a[8 * c + 2 * e], a[8 * c + 2 * e + 1], (KV_XT*)nullptr);
  }
  kv::rotate_group(a);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 64; ++i) amax = fmaxf(amax, fabsf(a[i]));
  float s, y;
  const __half s16 = group_scale(amax * 0.125f, inv_c, s, y);
  uint32_t words[8];
  kv::encode_group<KV_FMT>(a, y, words);
  const int64_t slot = (int64_t)slots[t];
  if (slot < 0) return;
  const int64_t page = slot >> page_log2, off = slot & ((1 << page_log2) - 1);
  const int64_t row = ((page * hkv + h) << page_log2) + off;
  uint4* out = reinterpret_cast<uint4*>((which ? vd : kd) + row * (groups * 8) + g * 8);
  out[0] = make_uint4(words[0], words[1], words[2], words[3]);
  out[1] = make_uint4(words[4], words[5], words[6], words[7]);
  (which ? vs : ks)[row * groups + g] = s16;
}

