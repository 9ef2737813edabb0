// ninfer paged decode, CUDA path: PTX wrappers and the 4-bit operand tricks (see paged_decode.cu).
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "rtc_compat.cuh"

namespace nd {

__device__ __forceinline__ uint32_t lop_and_or(uint32_t a, uint32_t m, uint32_t b) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(m), "r"(b));  // (a & m) | b
  return r;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ uint32_t hsub2u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t hmul2u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
// 2^x, subnormal results flushed to zero: exp2f's denormal fix-up (a compare and two multiplies) is
// wasted on softmax weights, which are <= 2^8 and negligible below 2^-126.
__device__ __forceinline__ float ex2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ void mma16816(float* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t movtrans(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}
// 16 bytes global -> shared (a shared-window address), asynchronously; the second form copies only
// where `on` and zero-fills the bytes at and past `bytes` (0..16) of the piece.
__device__ __forceinline__ void cp_async16(uint32_t s, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async16_zfill_if(bool on, uint32_t s, const void* gmem, int bytes) {
  asm volatile("{\n .reg .pred p;\n setp.ne.b32 p, %3, 0;\n @p cp.async.cg.shared.global [%0], [%1], 16, %2;\n}"
               ::"r"(s), "l"(gmem), "r"(bytes), "r"((int)on));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// max that keeps a NaN (fmaxf drops it)
__device__ __forceinline__ float fmax_nan(float a, float b) { return (a != a || a > b) ? a : b; }
// Sign pattern s_i of the format's rotation R = S.H64.S: (-1)^parity((i & (i >> 1)) & 0b010101).
__device__ __forceinline__ float rot_sign(int i) {
  return (__popc((i & (i >> 1)) & 0x15) & 1) ? -1.f : 1.f;
}

template <typename QT>
__device__ __forceinline__ float to_f(QT x);
template <>
__device__ __forceinline__ float to_f<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_f<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// 4-bit words on the tensor cores. A word holds 8 offset-binary nibbles u_j (bits 4j..4j+3) of one E8
// block (dims 8j + w of its 64-group).
// - K: w & 0x0F0F0F0F and (w >> 4) & 0x0F0F0F0F are nibbles 0, 2, 4, 6 and 1, 3, 5, 7 as u8: the A
//   operand of an int8 MMA against Q in int8 (per row and 64-group, see paged_decode.cu); -8 goes into
//   the accumulator's start.
// - V: (x & 0x000f000f) | 0x6400 is the half2 (1024 + u, ...) of two tokens' nibbles after a prmt, and
//   (x & 0x00f000f0) | 0x6400 is 1024 + 16 u; the bias is subtracted first (one sub.f16x2, exact), since
//   V's accumulators live for the whole split.
// - E8: per word, the coset bit c (stored as nibble 7's low bit) and the parity par of nibbles 0..6
//   (nibble 7's true low bit) enter as two features of one extra fp16 MMA k-step (K) or m-tile (V).
//   Stored nibble 7 = true - par + c and every coordinate gains c/2, so
//     sum_d q_d k_d = sum_d q_d (u_d - 8) + sum_w [par_w q_7w + c_w (Qs_w / 2 - q_7w)]   (Qs_w = block sum).
//   c and the count of nibbles 0..6's low bits (par = its parity) come from binary MMAs (bmma_popc),
//   so the tensor pipe counts bits instead of the integer pipe; (x & 0x10001000) | base makes a half2
//   feature pair of bits 12 / 28: base 0 gives {0, 2^-11}, base 0x2C002C00 {1/16, 1}.
// Integer MMA m16n8k32: u8 A (the stored nibbles) times s8 B (Q in int8), s32 accumulators.
__device__ __forceinline__ void imma16832(int* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.s32.u8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Binary MMA m16n8k256: d[i] += popc(A row AND B col) over 256 bits (sm_80+; BMMA.168256.AND.POPC).
// With column 2m of B masking chunk m (32 bits) of a row and column 2m + 1 chunk 4 + m (B: b0 = mask
// where gi == 2 ti, b1 = mask where gi == 2 ti + 1), each thread gets its own four registers' counts:
// c = (popc(a0 & M), popc(a2 & M), popc(a1 & M), popc(a3 & M)).
__device__ __forceinline__ void bmma_popc(int* c, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                          uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k256.row.col.s32.b1.b1.s32.and.popc {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace nd
