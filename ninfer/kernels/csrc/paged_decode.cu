// ninfer paged decode, CUDA path (split kernel). See paged_decode.py for the contract.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>

namespace nd {

__device__ __forceinline__ uint32_t lop_and_or(uint32_t a, uint32_t m, uint32_t b) {
  uint32_t r;
  asm volatile("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(m), "r"(b));  // (a & m) | b
  return r;
}
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm volatile("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}
__device__ __forceinline__ uint32_t hsub2u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm volatile("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t hfma2u(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm volatile("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}
__device__ __forceinline__ uint32_t hmul2u(uint32_t a, uint32_t b) {
  uint32_t r;
  asm volatile("mul.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
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
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// E8 word (8 offset-binary nibbles, nibble j in bits [4j, 4j+4), coset bit c in bit 28):
// true low bit of nibble 7 = parity of nibbles 0..6. xor of all 8 stored low bits = par ^ c, so
// flipping bit 28 by that xor puts par there. The multiply sums the eight low bits in the top nibble.
__device__ __forceinline__ uint32_t e8_fix(uint32_t w) {
  uint32_t m = (w & 0x11111111u) * 0x11111111u;
  return w ^ (m & 0x10000000u);
}

// K operand (same token, dims in pairs): word -> 4 half2 (nib s, nib s+4), s = 0..3, as p = n + c/2.
template <bool E8>
__device__ __forceinline__ void k_word(uint32_t w, uint32_t* out) {
  uint32_t lo_sub, hi_base;
  if (E8) {
    uint32_t c = (w >> 28) & 1u;
    w = e8_fix(w);
    lo_sub = 0x48004800u - c * 0x00800080u;  // half2(8 - c/2)
    hi_base = 0x64006400u | (c * 0x00080008u);  // 1024 + 16u + 8c
  } else {
    lo_sub = 0x48004800u;
    hi_base = 0x64006400u;
  }
  const uint32_t k1024 = 0x64006400u;
  const uint32_t k16 = 0x2C002C00u;   // 1/16
  const uint32_t km72 = 0xD480D480u;  // -72
  uint32_t y = w >> 8;
  out[0] = hsub2u(hsub2u(lop_and_or(w, 0x000f000fu, k1024), k1024), lo_sub);
  out[1] = hfma2u(lop_and_or(w, 0x00f000f0u, hi_base), k16, km72);
  out[2] = hsub2u(hsub2u(lop_and_or(y, 0x000f000fu, k1024), k1024), lo_sub);
  out[3] = hfma2u(lop_and_or(y, 0x00f000f0u, hi_base), k16, km72);
}

// V operand (two tokens a, b; same dims): byte q of both words -> (lo nibble pair, hi nibble pair).
__device__ __forceinline__ void v_pair(uint32_t wa, uint32_t wb, int q, uint32_t lo_sub, uint32_t hi_base,
                                       uint32_t& lo, uint32_t& hi) {
  const uint32_t k1024 = 0x64006400u;
  const uint32_t k16 = 0x2C002C00u;
  const uint32_t km72 = 0xD480D480u;
  uint32_t x = prmt(wa, wb, (uint32_t)(q | (q << 4) | ((q + 4) << 8) | ((q + 4) << 12)));
  lo = hsub2u(hsub2u(lop_and_or(x, 0x000f000fu, k1024), k1024), lo_sub);
  hi = hfma2u(lop_and_or(x, 0x00f000f0u, hi_base), k16, km72);
}

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

// FMT: 1 = int8, 2 = rk4v4, 3 = rk4v4-e8.  One block = NW warps = one (split, kv head, seq).
template <int FMT, int D, int NW, int CHUNK, int NST, typename QT>
__device__ __forceinline__ void decode_split_body(const QT* __restrict__ q, const uint8_t* __restrict__ kd, const __half* __restrict__ ks,
                    const uint8_t* __restrict__ vd, const __half* __restrict__ vs,
                    const int* __restrict__ bt, const int* __restrict__ sl, float* __restrict__ mid_o,
                    float* __restrict__ mid_lse, int64_t sq_b, int64_t sq_h, int64_t d_ps, int64_t d_hs,
                    int64_t s_ps, int64_t s_hs, int64_t bt_s, int hq, int group, int num_splits, float qk_scale) {
  constexpr int G = D / 64;
  constexpr int RB = (FMT == 1) ? D : D / 2;  // data bytes per token
  constexpr int NCH = RB / 16;                // 16-byte chunks per token row
  constexpr int SB = G * 2;                   // scale bytes per token
  constexpr int STAGE = CHUNK * (2 * RB + 2 * SB);
  constexpr int NSUB = CHUNK / 16;
  constexpr bool ROT = FMT != 1;
  constexpr int KSTEPS = D / 16;  // k-steps of the score MMA; also m-tiles of the output MMA

  extern __shared__ __align__(16) uint8_t smem[];
  __shared__ float q_s[8][D];
  __shared__ float m_s[NW][8];
  __shared__ float l_s[NW][8];

  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int tid_all = threadIdx.x, warp = tid_all / 32, lane = tid_all % 32;
  const int gi = lane >> 2, ti = lane & 3;
  const int L = sl[b];
  const int n_pages = (L + 63) / 64;
  const int per = (n_pages + num_splits - 1) / num_splits;
  const int p_lo = split * per;
  const int p_hi = min(p_lo + per, n_pages);
  const int t_lo = p_lo * 64;
  const int t_hi = min(p_hi * 64, L);
  const int nchunks = t_hi > t_lo ? (t_hi - t_lo + CHUNK - 1) / CHUNK : 0;

  const int h0 = kvh * group;
  // ---- per-warp pipeline over chunks k = warp, warp + NW, ...
  uint8_t* wbase = smem + warp * NST * STAGE;
  const int my_n = nchunks > warp ? (nchunks - warp + NW - 1) / NW : 0;
  const uint8_t* kd_h = kd + kvh * d_hs;
  const uint8_t* vd_h = vd + kvh * d_hs;
  const uint8_t* ks_h = reinterpret_cast<const uint8_t*>(ks) + kvh * s_hs;
  const uint8_t* vs_h = reinterpret_cast<const uint8_t*>(vs) + kvh * s_hs;
  const int* bt_b = bt + b * bt_s;

  auto issue = [&](int it) {
    if (it < my_n) {
      int t0 = t_lo + (warp + it * NW) * CHUNK;
      int64_t page = bt_b[t0 >> 6];
      int off = t0 & 63;
      uint8_t* st = wbase + (it % NST) * STAGE;
      const uint8_t* gk = kd_h + page * d_ps + off * RB;
      const uint8_t* gv = vd_h + page * d_ps + off * RB;
#pragma unroll
      for (int p = lane; p < CHUNK * NCH; p += 32) {
        int tok = p / NCH, ch = p % NCH;
        int dst = tok * RB + ((ch ^ (tok & (NCH - 1))) << 4);
        cp_async16(st + dst, gk + p * 16);
        cp_async16(st + CHUNK * RB + dst, gv + p * 16);
      }
      const uint8_t* gks = ks_h + page * s_ps + off * SB;
      const uint8_t* gvs = vs_h + page * s_ps + off * SB;
#pragma unroll
      for (int p = lane; p < CHUNK * SB / 16; p += 32) {
        cp_async16(st + 2 * CHUNK * RB + p * 16, gks + p * 16);
        cp_async16(st + 2 * CHUNK * RB + CHUNK * SB + p * 16, gvs + p * 16);
      }
    }
    cp_commit();
  };


  // The first stages' loads are in flight while Q is prepared.
#pragma unroll
  for (int i = 0; i < NST - 1; ++i) issue(i);

  // ---- Q: load the group's rows (fp32), rotate by H64 (in-place fast Walsh-Hadamard, /8).
  for (int i = tid_all; i < 8 * D; i += NW * 32) {
    int r = i / D, d = i % D;
    q_s[r][d] = r < group ? to_f<QT>(q[b * sq_b + (h0 + r) * sq_h + d]) * (ROT ? rot_sign(d & 63) : 1.f) : 0.f;
  }
  __syncthreads();
  if (ROT) {
#pragma unroll
    for (int hbit = 1; hbit < 64; hbit <<= 1) {
      for (int i = tid_all; i < 8 * D / 2; i += NW * 32) {
        int r = i / (D / 2), pidx = i % (D / 2);
        int lowp = pidx & (hbit - 1);
        int d0 = ((pidx - lowp) << 1) + lowp;
        float a = q_s[r][d0], c = q_s[r][d0 + hbit];
        q_s[r][d0] = a + c;
        q_s[r][d0 + hbit] = a - c;
      }
      __syncthreads();
    }
  }
  const float qmul = ROT ? 0.125f : 1.f;  // (and the sign pattern again, below): R = S.H64.S
  // B fragments of Q^T for the score MMA: per k-step 2 regs (row n = gi).
  uint32_t qb[KSTEPS][2];
#pragma unroll
  for (int ks_ = 0; ks_ < KSTEPS; ++ks_) {
    int g = ks_ / 4, s = ks_ % 4;
    int d00, d01, d10, d11;
    if (FMT == 1) {  // int8: k=2ti+h -> byte 16ti+4s+h; k=2ti+8+h -> byte 16ti+4s+2+h
      d00 = 64 * g + 16 * ti + 4 * s;
      d01 = d00 + 1;
      d10 = d00 + 2;
      d11 = d00 + 3;
    } else {  // 4-bit: k=2ti+h -> dim 8(s+4h)+2ti; k=2ti+8+h -> dim 8(s+4h)+2ti+1
      d00 = 64 * g + 8 * s + 2 * ti;
      d01 = d00 + 32;
      d10 = d00 + 1;
      d11 = d00 + 33;
    }
    const float m00 = ROT ? qmul * rot_sign(d00 & 63) : qmul, m01 = ROT ? qmul * rot_sign(d01 & 63) : qmul;
    const float m10 = ROT ? qmul * rot_sign(d10 & 63) : qmul, m11 = ROT ? qmul * rot_sign(d11 & 63) : qmul;
    qb[ks_][0] = pack_half2(q_s[gi][d00] * m00, q_s[gi][d01] * m01);
    qb[ks_][1] = pack_half2(q_s[gi][d10] * m10, q_s[gi][d11] * m11);
  }

  float o[KSTEPS][4];
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_r[2] = {-INFINITY, -INFINITY};
  float l_r[2] = {0.f, 0.f};

  for (int it = 0; it < my_n; ++it) {
    cp_wait<NST - 2>();
    __syncwarp();
    issue(it + NST - 1);  // refills the stage consumed in the previous iteration
    const uint8_t* st = wbase + (it % NST) * STAGE;
    const uint8_t* sk = st;
    const uint8_t* sv = st + CHUNK * RB;
    const __half* sks = reinterpret_cast<const __half*>(st + 2 * CHUNK * RB);
    const __half* svs = reinterpret_cast<const __half*>(st + 2 * CHUNK * RB + CHUNK * SB);
    const int t0 = t_lo + (warp + it * NW) * CHUNK;

    // ---- scores S^T [tokens x q rows] for the chunk
    float sc[NSUB][4];
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      const int ta = sub * 16 + gi, tb = ta + 8;
      float tot[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (FMT == 1) {
          const int ch = 4 * g + ti;
          uint4 wa = *reinterpret_cast<const uint4*>(sk + ta * RB + ((ch ^ (ta & (NCH - 1))) << 4));
          uint4 wb = *reinterpret_cast<const uint4*>(sk + tb * RB + ((ch ^ (tb & (NCH - 1))) << 4));
          uint32_t wA[4] = {wa.x, wa.y, wa.z, wa.w}, wB[4] = {wb.x, wb.y, wb.z, wb.w};
#pragma unroll
          for (int s = 0; s < 4; ++s) {
            uint32_t xa = wA[s] ^ 0x80808080u, xb = wB[s] ^ 0x80808080u;
            const uint32_t k1152 = 0x64806480u;
            uint32_t a0 = hsub2u(prmt(xa, 0x64646464u, 0x4140u), k1152);
            uint32_t a2 = hsub2u(prmt(xa, 0x64646464u, 0x4342u), k1152);
            uint32_t a1 = hsub2u(prmt(xb, 0x64646464u, 0x4140u), k1152);
            uint32_t a3 = hsub2u(prmt(xb, 0x64646464u, 0x4342u), k1152);
            mma16816(acc, a0, a1, a2, a3, qb[g * 4 + s][0], qb[g * 4 + s][1]);
          }
        } else {
          const int byte = g * 32 + ti * 8;
          const int ch = byte >> 4, inner = byte & 15;
          uint2 wa = *reinterpret_cast<const uint2*>(sk + ta * RB + ((ch ^ (ta & (NCH - 1))) << 4) + inner);
          uint2 wb = *reinterpret_cast<const uint2*>(sk + tb * RB + ((ch ^ (tb & (NCH - 1))) << 4) + inner);
          uint32_t ra0[4], ra1[4], rb0[4], rb1[4];
          k_word<FMT == 3>(wa.x, ra0);
          k_word<FMT == 3>(wa.y, ra1);
          k_word<FMT == 3>(wb.x, rb0);
          k_word<FMT == 3>(wb.y, rb1);
#pragma unroll
          for (int s = 0; s < 4; ++s)
            mma16816(acc, ra0[s], rb0[s], ra1[s], rb1[s], qb[g * 4 + s][0], qb[g * 4 + s][1]);
        }
        float sa = __half2float(sks[ta * G + g]), sb = __half2float(sks[tb * G + g]);
        tot[0] += sa * acc[0];
        tot[1] += sa * acc[1];
        tot[2] += sb * acc[2];
        tot[3] += sb * acc[3];
      }
      const bool va = t0 + ta < t_hi, vb = t0 + tb < t_hi;
      sc[sub][0] = va ? tot[0] * qk_scale : -INFINITY;
      sc[sub][1] = va ? tot[1] * qk_scale : -INFINITY;
      sc[sub][2] = vb ? tot[2] * qk_scale : -INFINITY;
      sc[sub][3] = vb ? tot[3] * qk_scale : -INFINITY;
    }
    // ---- online softmax (rows 2ti, 2ti+1 live in this thread; tokens across gi lanes)
    float cm[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      cm[0] = fmaxf(cm[0], fmaxf(sc[sub][0], sc[sub][2]));
      cm[1] = fmaxf(cm[1], fmaxf(sc[sub][1], sc[sub][3]));
    }
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      cm[0] = fmaxf(cm[0], __shfl_xor_sync(0xffffffffu, cm[0], off));
      cm[1] = fmaxf(cm[1], __shfl_xor_sync(0xffffffffu, cm[1], off));
    }
    // Lazy rescale: the running max moves only when a chunk's max exceeds it by more than 8 (log2
    // units), so most chunks skip the O *= alpha pass; P <= 2^8 stays exact enough in fp16 and the
    // final merge uses the same max (H200, 90K/128K: rk4v4-e8 D128 -3%, int8 and D256 unchanged).
    // m_r = -inf before the first chunk, so the first chunk always rescales (alpha = 0).
    if (__any_sync(0xffffffffu, cm[0] > m_r[0] + 8.f || cm[1] > m_r[1] + 8.f)) {
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mn = fmaxf(m_r[r], cm[r]);
        alpha[r] = exp2f(m_r[r] - mn);
        m_r[r] = mn;
        l_r[r] *= alpha[r];
      }
#pragma unroll
      for (int i = 0; i < KSTEPS; ++i) {
        o[i][0] *= alpha[0];
        o[i][1] *= alpha[1];
        o[i][2] *= alpha[0];
        o[i][3] *= alpha[1];
      }
    }
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      float p0 = exp2f(sc[sub][0] - m_r[0]), p1 = exp2f(sc[sub][1] - m_r[1]);
      float p2 = exp2f(sc[sub][2] - m_r[0]), p3 = exp2f(sc[sub][3] - m_r[1]);
      l_r[0] += p0 + p2;
      l_r[1] += p1 + p3;
      // P^T (tokens x rows) in C layout -> B fragments (tokens as k) by 8x8 transposes.
      uint32_t pb0 = movtrans(pack_half2(p0, p1));  // tokens 0..7 of the sub-chunk
      uint32_t pb1 = movtrans(pack_half2(p2, p3));  // tokens 8..15
      const int tk0 = sub * 16 + 2 * ti;           // this thread's B tokens: tk0, tk0+1, tk0+8, tk0+9
      const bool v0 = t0 + tk0 < t_hi, v1 = t0 + tk0 + 1 < t_hi, v8 = t0 + tk0 + 8 < t_hi,
                 v9 = t0 + tk0 + 9 < t_hi;
#pragma unroll
      for (int g = 0; g < G; ++g) {
        // V scale folded into P per group; garbage scales of unwritten slots are zeroed.
        __half z = __float2half(0.f);
        __half s0 = v0 ? svs[tk0 * G + g] : z, s1 = v1 ? svs[(tk0 + 1) * G + g] : z;
        __half s8 = v8 ? svs[(tk0 + 8) * G + g] : z, s9 = v9 ? svs[(tk0 + 9) * G + g] : z;
        __half2 sA = __halves2half2(s0, s1), sB = __halves2half2(s8, s9);
        uint32_t b0 = hmul2u(pb0, *reinterpret_cast<uint32_t*>(&sA));
        uint32_t b1 = hmul2u(pb1, *reinterpret_cast<uint32_t*>(&sB));
        if (FMT == 1) {
          // thread row gi holds bytes 8gi..8gi+7 of group g; m-tile q: rows gi -> byte 8gi+2q, gi+8 -> +1
          const int byte = g * 64 + gi * 8;
          const int ch = byte >> 4, inner = byte & 15;
          uint2 w[4];
          const int toks[4] = {tk0, tk0 + 1, tk0 + 8, tk0 + 9};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            int t = toks[k];
            w[k] = *reinterpret_cast<const uint2*>(sv + t * RB + ((ch ^ (t & (NCH - 1))) << 4) + inner);
            w[k].x ^= 0x80808080u;
            w[k].y ^= 0x80808080u;
          }
          const uint32_t k1152 = 0x64806480u, k64 = 0x64006400u;
#pragma unroll
          for (int qq = 0; qq < 4; ++qq) {
            // byte 2qq (rows gi) and 2qq+1 (rows gi+8) of the 8 bytes: word qq/2, bytes (qq%2)*2, +1
            const int bsel = (qq & 1) * 2;
            uint32_t xa01 = prmt(qq < 2 ? w[0].x : w[0].y, qq < 2 ? w[1].x : w[1].y,
                                 (uint32_t)(bsel | ((bsel + 1) << 4) | ((bsel + 4) << 8) | ((bsel + 5) << 12)));
            uint32_t xa89 = prmt(qq < 2 ? w[2].x : w[2].y, qq < 2 ? w[3].x : w[3].y,
                                 (uint32_t)(bsel | ((bsel + 1) << 4) | ((bsel + 4) << 8) | ((bsel + 5) << 12)));
            // xa01 bytes: [t0.b, t0.b+1, t1.b, t1.b+1]
            uint32_t a0 = hsub2u(lop_and_or(xa01, 0x00ff00ffu, k64), k1152);         // byte b, tokens 0/1
            uint32_t a1 = hsub2u(lop_and_or(xa01 >> 8, 0x00ff00ffu, k64), k1152);    // byte b+1
            uint32_t a2 = hsub2u(lop_and_or(xa89, 0x00ff00ffu, k64), k1152);
            uint32_t a3 = hsub2u(lop_and_or(xa89 >> 8, 0x00ff00ffu, k64), k1152);
            mma16816(o[g * 4 + qq], a0, a1, a2, a3, b0, b1);
          }
        } else {
          const int byte = g * 32 + gi * 4;
          const int ch = byte >> 4, inner = byte & 15;
          uint32_t w[4];
          const int toks[4] = {tk0, tk0 + 1, tk0 + 8, tk0 + 9};
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            int t = toks[k];
            w[k] = *reinterpret_cast<const uint32_t*>(sv + t * RB + ((ch ^ (t & (NCH - 1))) << 4) + inner);
          }
          uint32_t lo01 = 0x48004800u, hi01 = 0x64006400u, lo89 = 0x48004800u, hi89 = 0x64006400u;
          if (FMT == 3) {
            uint32_t c0 = (w[0] >> 28) & 1u, c1 = (w[1] >> 28) & 1u, c8 = (w[2] >> 28) & 1u, c9 = (w[3] >> 28) & 1u;
#pragma unroll
            for (int k = 0; k < 4; ++k) w[k] = e8_fix(w[k]);
            lo01 -= c0 * 0x80u + c1 * 0x00800000u;
            hi01 |= (c0 << 3) | (c1 << 19);
            lo89 -= c8 * 0x80u + c9 * 0x00800000u;
            hi89 |= (c8 << 3) | (c9 << 19);
          }
#pragma unroll
          for (int qq = 0; qq < 4; ++qq) {
            uint32_t a0, a1, a2, a3;
            v_pair(w[0], w[1], qq, lo01, hi01, a0, a1);
            v_pair(w[2], w[3], qq, lo89, hi89, a2, a3);
            mma16816(o[g * 4 + qq], a0, a1, a2, a3, b0, b1);
          }
        }
      }
    }
    __syncwarp();
  }
  cp_wait<0>();

  // ---- merge the warps of the block, write this split's partial (H64 domain for rotated formats)
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l_r[0] += __shfl_xor_sync(0xffffffffu, l_r[0], off);
    l_r[1] += __shfl_xor_sync(0xffffffffu, l_r[1], off);
  }
  __syncthreads();  // every warp is done with its stages: reuse smem for the partial outputs
  float* o_s = reinterpret_cast<float*>(smem);  // [NW][8][D]
  if (gi == 0) {
    m_s[warp][2 * ti] = m_r[0];
    m_s[warp][2 * ti + 1] = m_r[1];
    l_s[warp][2 * ti] = l_r[0];
    l_s[warp][2 * ti + 1] = l_r[1];
  }
#pragma unroll
  for (int mt = 0; mt < KSTEPS; ++mt) {
    int d0, d1;
    if (FMT == 1) {
      int g = mt / 4, qq = mt % 4;
      d0 = 64 * g + 8 * gi + 2 * qq;
      d1 = d0 + 1;
    } else {
      d0 = 16 * mt + gi;
      d1 = d0 + 8;
    }
    float* base = o_s + warp * 8 * D;
    base[(2 * ti) * D + d0] = o[mt][0];
    base[(2 * ti + 1) * D + d0] = o[mt][1];
    base[(2 * ti) * D + d1] = o[mt][2];
    base[(2 * ti + 1) * D + d1] = o[mt][3];
  }
  __syncthreads();
  for (int i = tid_all; i < group * D; i += NW * 32) {
    int r = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, m_s[w][r]);
    float num = 0.f, den = 0.f;
    if (mx != -INFINITY) {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        float f = exp2f(m_s[w][r] - mx);
        num += f * o_s[w * 8 * D + r * D + d];
        den += f * l_s[w][r];
      }
    }
    int64_t row = (int64_t)b * hq + h0 + r;
    mid_o[(row * num_splits + split) * D + d] = den > 0.f ? num / den : 0.f;
    if (d == 0) mid_lse[row * num_splits + split] = den > 0.f ? mx + log2f(den) : -INFINITY;
  }
}

}  // namespace nd

#ifdef ND_FMT
extern "C" __global__ void __launch_bounds__(ND_NW * 32)
nd_decode(const ND_QT* __restrict__ q, const uint8_t* __restrict__ kd, const __half* __restrict__ ks,
          const uint8_t* __restrict__ vd, const __half* __restrict__ vs, const int* __restrict__ bt,
          const int* __restrict__ sl, float* __restrict__ mid_o, float* __restrict__ mid_lse, int64_t sq_b,
          int64_t sq_h, int64_t d_ps, int64_t d_hs, int64_t s_ps, int64_t s_hs, int64_t bt_s, int hq, int group,
          int num_splits, float qk_scale) {
  nd::decode_split_body<ND_FMT, ND_D, ND_NW, ND_CHUNK, ND_NST, ND_QT>(
      q, kd, ks, vd, vs, bt, sl, mid_o, mid_lse, sq_b, sq_h, d_ps, d_hs, s_ps, s_hs, bt_s, hq, group, num_splits,
      qk_scale);
}
#endif

