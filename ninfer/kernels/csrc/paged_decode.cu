// ninfer paged decode, CUDA path (split kernel). See paged_decode.py for the contract.
#include "decode_ops.cuh"

namespace nd {

// The warps' partial outputs in shared memory, o_s [NW][8][part_stride]: padded rows. 4-bit (rows 2ti,
// 2ti + 1, dims 16 mt + gi): by 4 floats, so the 4 rows a warp's lanes store to sit in different banks.
// int8 (dims 64 g + 8 gi + 2 qq): by 1, which makes its stores 2-way conflicted; by 4 they were 8-way
// (int8's epilogue 4.0 -> 2.2 us at D256, 128K: H200, 2026-11-30).
template <int D, bool ROT>
constexpr int part_stride = ROT ? D + 4 : D + 1;

// A split's partial from the warps' partials in shared memory (o_s as above, m_s / l_s [NW][8]):
// out of line, so that it does not change how the compiler schedules the main loop. base = (first row
// of the group) * num_splits + split. Row r's warp weights are 2^(m_w - max) / den. Rotated formats are
// rotated back here, per split (the merge is linear): a warp per (row, 64-group) merges the warps'
// partials of dims lane, lane + 32 and applies R = S.H64.S / 8 with shuffles, with no pass through
// shared memory and no barrier in between (the D256 epilogue took 2.4 us before).
template <int D, int NW, bool ROT>
__device__ __noinline__ void write_split(const float* o_s, const float* m_s, const float* l_s,
                                         float* __restrict__ mid_o, float* __restrict__ mid_lse, int64_t base,
                                         int group, int num_splits) {
  constexpr int G = D / 64, OS = part_stride<D, ROT>;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  if (ROT) {
    for (int p = warp; p < group * G; p += NW) {
      const int r = p / G, g = p % G;
      float mx = -INFINITY, den = 0.f, f[NW];
#pragma unroll
      for (int w = 0; w < NW; ++w) mx = fmaxf(mx, m_s[w * 8 + r]);
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        f[w] = mx == -INFINITY ? 0.f : exp2f(m_s[w * 8 + r] - mx);
        den += f[w] * l_s[w * 8 + r];
      }
      const float inv = den > 0.f ? 0.125f / den : 0.f;  // and R's 1/8
      float v0 = 0.f, v1 = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        v0 += f[w] * o_s[(w * 8 + r) * OS + 64 * g + lane];
        v1 += f[w] * o_s[(w * 8 + r) * OS + 64 * g + 32 + lane];
      }
      v0 *= inv * rot_sign(lane);
      v1 *= inv * rot_sign(lane + 32);
      const float x = v0 + v1;
      v1 = v0 - v1;
      v0 = x;
#pragma unroll
      for (int lb = 1; lb < 32; lb <<= 1) {  // the Walsh-Hadamard butterflies of bits 0..4 (bit 5 above)
        const float o0 = __shfl_xor_sync(0xffffffffu, v0, lb), o1 = __shfl_xor_sync(0xffffffffu, v1, lb);
        v0 = (lane & lb) ? o0 - v0 : v0 + o0;
        v1 = (lane & lb) ? o1 - v1 : v1 + o1;
      }
      float* po = mid_o + (base + (int64_t)r * num_splits) * D + 64 * g;
      po[lane] = v0 * rot_sign(lane);
      po[lane + 32] = v1 * rot_sign(lane + 32);
      if (g == 0 && lane == 0) mid_lse[base + (int64_t)r * num_splits] = den > 0.f ? mx + log2f(den) : -INFINITY;
    }
    return;
  }
  __shared__ float f_s[NW][8];  // per row: the warps' weights, computed once
  __shared__ float lse_s[8];
  if (tid < 8) {
    const int r = tid;
    float mx = -INFINITY, den = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, m_s[w * 8 + r]);
#pragma unroll
    for (int w = 0; w < NW; ++w) den += mx == -INFINITY ? 0.f : exp2f(m_s[w * 8 + r] - mx) * l_s[w * 8 + r];
    const float inv = den > 0.f ? 1.f / den : 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) f_s[w][r] = mx == -INFINITY ? 0.f : exp2f(m_s[w * 8 + r] - mx) * inv;
    lse_s[r] = den > 0.f ? mx + log2f(den) : -INFINITY;
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < (8 * D + NW * 32 - 1) / (NW * 32); ++k) {  // a fixed trip count: loads overlap
    const int i = tid + k * NW * 32, r = i / D, d = i % D;
    if (r < group) {
      float v = 0.f;
#pragma unroll
      for (int w = 0; w < NW; ++w) v += f_s[w][r] * o_s[(w * 8 + r) * OS + d];
      mid_o[(base + (int64_t)r * num_splits) * D + d] = v;
      if (d == 0) mid_lse[base + (int64_t)r * num_splits] = lse_s[r];
    }
  }
}

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
  // Stage rows (K and V alike): byte of 16-byte piece c of token t. int8: pieces XOR-swizzled. 4-bit:
  // every 32-byte sector a copy writes stays whole and aligned in shared memory (swizzled 16-byte pieces
  // or 80-byte padded rows made the copies themselves 8-15% slower at D128: H200). D128 rows are
  // linear: their reads' bank conflicts (K: 4 passes where 2 would do, V: 4 where 1 would) cost less
  // than the addressing of a conflict-free layout (1.6-3.5% slower at 128K-512K, H200). D256 (SW): a
  // row's four 32-byte pieces XOR (t >> 1) & 3, so the K reads (piece p of tokens t..t+7) and the V
  // reads (tokens {0, 2, 4, 6} + c) meet no bank conflict.
  constexpr bool SW = FMT != 1 && D == 256;
  auto k_at = [](int t, int c) -> int {
    if (FMT == 1) return t * RB + ((c ^ (t & (NCH - 1))) << 4);
    const int f = SW ? (t >> 1) & 3 : 0;
    return t * RB + (((c >> 1) ^ f) << 5) + ((c & 1) << 4);
  };
  constexpr int STAGE = CHUNK * 2 * (RB + SB);
  constexpr int NSUB = CHUNK / 16;
  constexpr bool ROT = FMT != 1;
  constexpr int KSTEPS = D / 16;  // k-steps of the score MMA; also m-tiles of the output MMA

  // 128-byte aligned: the stages' base sits after the static arrays below, and a base 16 bytes off
  // (16 more bytes of static smem) made every format 9-17% slower (H200).
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ float q_s[8][ROT ? 1 : D];  // int8: Q in fp32
  __shared__ float m_s[NW][8];
  __shared__ float l_s[NW][8];
  __shared__ float c_s[8][G];            // 4-bit: the float score accumulator's initial value per (row, group)
  __shared__ float qsc_s[8][G];          // 4-bit: Q's int8 scale per (row, group)
  __shared__ __align__(16) int8_t q8_s[8][ROT ? D : 16];  // 4-bit: Q in int8, in the score MMAs' fragment order
  __shared__ __half wf_s[8][G][16];      // rk4v4-e8: feature weights (c: words 0..7, par: 8..15)

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

  // A stage's copies. Chunk it of this warp starts at token t_lo + (warp + it NW) CHUNK: page
  // bt_w[it PSTEP], at the same offset woff in every page (NW CHUNK is a multiple of 64). So a copy's
  // global address is one 32 x 32 -> 64-bit multiply-add per plane (page x page stride + this lane's
  // base; a page's stride is small) plus immediates, and its shared address a per-lane base plus
  // immediates; nothing else is recomputed per chunk. Page ids are loaded one chunk ahead, so no
  // stage's copies wait on a dependent block-table load.
  static_assert((CHUNK * NCH) % 32 == 0, "whole warps of 16-byte pieces");
  static_assert((NW * CHUNK) % 64 == 0 && 64 % CHUNK == 0, "a warp's chunks sit at one offset of their pages");
  constexpr int PCS = CHUNK * NCH / 32;  // pieces per lane per plane
  constexpr int PSTEP = NW * CHUNK / 64;
  constexpr int NSP = CHUNK * SB / 16;   // 16-byte pieces of a stage's K (and V) scales
  static_assert(2 * NSP <= 32, "one scale piece per lane");
  const int woff = (warp * CHUNK) & 63;
  const int* bt_w = bt_b + p_lo + ((warp * CHUNK) >> 6);
  const uint8_t* gk_l = kd_h + woff * RB + lane * 16;
  const uintptr_t v_minus_k = (uintptr_t)vd_h - (uintptr_t)kd_h;
  const uint32_t d_ps32 = (uint32_t)d_ps, s_ps32 = (uint32_t)s_ps;
  // scale pieces: lanes [0, NSP) copy K's, [NSP, 2 NSP) V's (zero-filled past the split's end, so
  // P.V needs no mask: V scales of slots past the end may be garbage, even NaN); other lanes none
  const bool s_on = lane < 2 * NSP, s_v = lane >= NSP;
  const int s_pc = lane % NSP;
  const uint8_t* gs_l = (s_v ? vs_h : ks_h) + woff * SB + s_pc * 16;
  const int s_dst = CHUNK * (2 * RB) + (s_v ? CHUNK * SB : 0) + s_pc * 16;
  // bytes of this lane's V scale piece before the end of the split, for the chunk issued next
  int s_rem = s_v ? (t_hi - (t_lo + warp * CHUNK)) * SB - s_pc * 16 : (1 << 30);
  const uint32_t wbase_s = static_cast<uint32_t>(__cvta_generic_to_shared(wbase));
  uint32_t next_page = my_n > 0 ? (uint32_t)bt_w[0] : 0u;
  int issue_stage = 0;  // it % NST (NST = 2: it & 1)
  auto issue = [&](int it) {  // called for it = 0, 1, 2, ... in order
    const uint32_t page = next_page;
    next_page = it + 1 < my_n ? (uint32_t)bt_w[(it + 1) * PSTEP] : 0u;
    if (it < my_n) {
      const uint32_t st = wbase_s + (NST == 2 ? (it & 1) : issue_stage) * STAGE;
      const uint8_t* gk = gk_l + (size_t)page * d_ps32;
      const uint8_t* gv = reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(gk) + v_minus_k);
      // the scales first: then no register the K / V copies still read is rewritten right after
      // them (a write waits until the copy has read it: ncu showed stalls on exactly that)
      cp_async16_zfill_if(s_on, st + s_dst, gs_l + (size_t)page * s_ps32, min(max(s_rem, 0), 16));
#pragma unroll
      for (int i = 0; i < PCS; ++i) {
        const int tok = lane / NCH + i * (32 / NCH);
        const int dst = k_at(tok, lane % NCH);
        cp_async16(st + dst, gk + i * 512);
        cp_async16(st + CHUNK * RB + dst, gv + i * 512);
      }
    }
    s_rem -= NW * CHUNK * SB;
    if (NST != 2) issue_stage = issue_stage + 1 == NST ? 0 : issue_stage + 1;
    cp_commit();
  };

  // Q's loads go out before the first stages' copies (behind them in the memory queue they cost ~10%
  // of a batch-1 decode: ncu, 2026-11-30); the copies are in flight while Q is prepared.
  // rotated: Q rows per warp (8 rows; with more than 8 warps, warps 8.. take none)
  constexpr int QR = (8 + NW - 1) / NW;
  static_assert(NW > 8 || 8 % NW == 0, "Q rows per warp");
  constexpr int QPT = ROT ? QR * (D / 32) : (8 * D + NW * 32 - 1) / (NW * 32);  // Q elements per thread
  QT qraw[QPT];
#pragma unroll
  for (int i = 0; i < QPT; ++i) {
    // rotated: row warp + NW (i / (D/32)), dims (D/32) lane + i % (D/32); int8: element tid_all + 256 i
    const int r = ROT ? warp + NW * (i / (D / 32)) : (tid_all + i * NW * 32) / D;
    const int d = ROT ? (D / 32) * lane + i % (D / 32) : (tid_all + i * NW * 32) % D;
    if (r < group) qraw[i] = q[b * sq_b + (h0 + r) * sq_h + d];
  }
#pragma unroll
  for (int i = 0; i < NST - 1; ++i) issue(i);

  // ---- Q: the group's rows in fp32. Rotated formats: one warp per row rotates it by R = S.H64.S / 8
  // with shuffles (lane l holds dims QV*l .. QV*l + QV-1) and derives the score MMA's constants.
  // 4-bit K meets Q on the int8 tensor cores: per row and 64-group, q8 = rint(q * 127 / max|q|) against
  // the stored nibbles u as u8; the integer accumulator starts at 0 and the score is qsc * acc plus a
  // float accumulator (qsc = max|q| / 127) that starts at -8 qsc sum(q8) (the nibbles' offset). E8's
  // feature k-step stays fp16: weights (Qs_w / 2 - q7_w, q7_w) * 16/15 of qe = qsc * q8 (features are
  // 1/16 + 15/16 bit), whose 1/16 part joins the float accumulator's start.
  const float qmul = ROT ? 0.125f : 1.f;
  if (ROT) {
    constexpr int QV = D / 32;          // dims per lane; dim bits 3..5 (nibble j) = lane bits below
    constexpr int JL = 8 / QV;          // lane xor of dim bit 3
#pragma unroll
    for (int rr = 0; rr < QR; ++rr) {
      const int r = warp + rr * NW;
      if (NW > 8 && r >= 8) continue;  // warp-uniform
      float v[QV];
#pragma unroll
      for (int i = 0; i < QV; ++i) {
        const int d = QV * lane + i;
        v[i] = r < group ? to_f<QT>(qraw[rr * QV + i]) * rot_sign(d & 63) : 0.f;
      }
#pragma unroll
      for (int hb = 1; hb < QV; hb <<= 1)  // in-register butterflies
#pragma unroll
        for (int i = 0; i < QV; ++i)
          if (!(i & hb)) {
            const float a = v[i], c = v[i + hb];
            v[i] = a + c;
            v[i + hb] = a - c;
          }
#pragma unroll
      for (int lb = 1; lb < 64 / QV; lb <<= 1)  // across lanes
#pragma unroll
        for (int i = 0; i < QV; ++i) {
          const float o_ = __shfl_xor_sync(0xffffffffu, v[i], lb);
          v[i] = (lane & lb) ? o_ - v[i] : v[i] + o_;
        }
      constexpr int LG = 64 / QV;  // lanes per 64-group: lane bits below log2(LG)
      float amax = 0.f;
#pragma unroll
      for (int i = 0; i < QV; ++i) {
        const int d = QV * lane + i;
        v[i] *= qmul * rot_sign(d & 63);
        amax = fmax_nan(amax, fabsf(v[i]));
      }
#pragma unroll
      for (int m = 1; m < LG; m <<= 1) amax = fmax_nan(amax, __shfl_xor_sync(0xffffffffu, amax, m));
      // a NaN or inf in q makes qsc NaN or inf, so the scores (qsc * acc) carry it to the output
      const float qinv = amax > 0.f && amax < INFINITY ? 127.f / amax : 0.f, qsc = amax * (1.f / 127.f);
      float csum = 0.f;
      int isum = 0;
#pragma unroll
      for (int i = 0; i < QV; ++i) {
        const int d = QV * lane + i;
        const int q8 = __float2int_rn(v[i] * qinv);
        // byte j of fragment word (g, h, b, ti): dim 64 g + 16 j + 8 b + 2 ti + h (see below)
        q8_s[r][(((d >> 6) * 2 + (d & 1)) * 2 + ((d >> 3) & 1)) * 16 + ((d >> 1) & 3) * 4 + ((d >> 4) & 3)] = (int8_t)q8;
        isum += q8;
        const float qe = qsc * (float)q8;
        if (FMT == 3) {
          float qs = qe;  // block sum over the 8 nibbles j of word w = d % 8
#pragma unroll
          for (int m = JL; m < 8 * JL; m <<= 1) qs += __shfl_xor_sync(0xffffffffu, qs, m);
          const float q7 = __shfl_sync(0xffffffffu, qe, lane | (7 * JL));
          const __half wc = __float2half_rn((0.5f * qs - q7) * (16.f / 15.f));
          const __half wp = __float2half_rn(q7 * (16.f / 15.f));
          if (((d >> 3) & 7) == 0) {  // one lane per word
            wf_s[r][d >> 6][d & 7] = wc;
            wf_s[r][d >> 6][8 + (d & 7)] = wp;
            csum -= 0.0625f * (__half2float(wc) + __half2float(wp));
          }
        }
      }
#pragma unroll
      for (int m = 1; m < LG; m <<= 1) {
        csum += __shfl_xor_sync(0xffffffffu, csum, m);
        isum += __shfl_xor_sync(0xffffffffu, isum, m);
      }
      if ((lane & (LG - 1)) == 0) {  // the integer accumulator starts at 0: its -8 sum(q8) goes here
        c_s[r][lane / LG] = csum - 8.f * qsc * (float)isum;
        qsc_s[r][lane / LG] = qsc;
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < QPT; ++i) {
      const int r = (tid_all + i * NW * 32) / D, d = (tid_all + i * NW * 32) % D;
      if (NW * 32 * QPT == 8 * D || r < 8) q_s[r][d] = r < group ? to_f<QT>(qraw[i]) : 0.f;
    }
  }
  __syncthreads();
  // int8: B fragments of Q^T for the score MMA, per k-step 2 regs (row n = gi).
  uint32_t qb[ROT ? 1 : KSTEPS][2];
#pragma unroll
  for (int ks_ = 0; ks_ < (ROT ? 0 : KSTEPS); ++ks_) {
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
    const float inv = (ROT && (s & 1)) ? 0.0625f : 1.f;  // odd nibbles arrive as 1024 + 16 u
    qb[ks_][0] = pack_half2(q_s[gi][d00] * inv, q_s[gi][d01] * inv);
    qb[ks_][1] = pack_half2(q_s[gi][d10] * inv, q_s[gi][d11] * inv);
  }
  // 4-bit: the int8 score MMAs' B fragments per group: MMA h takes words 2ti + h of the tokens (A: the
  // word's low nibbles, bytes j = nibble 2j, then its high ones), so b0 = q8 of dims 16j + 2ti + h and
  // b1 = dims 16j + 8 + 2ti + h (j = 0..3; row n = gi). Then per group (rows 2ti, 2ti + 1) the
  // accumulators' initial values, Q's scale and the E8 feature k-step's B fragment.
  uint32_t qi[ROT ? G : 1][2][2];
  float cin[G][2], qsc[G][2];
  uint32_t qf[G][2];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int h = 0; h < (ROT ? 2 : 0); ++h)
#pragma unroll
      for (int b = 0; b < 2; ++b)
        qi[g][h][b] = *reinterpret_cast<const uint32_t*>(&q8_s[gi][((g * 2 + h) * 2 + b) * 16 + ti * 4]);
    cin[g][0] = ROT ? c_s[2 * ti][g] : 0.f;
    cin[g][1] = ROT ? c_s[2 * ti + 1][g] : 0.f;
    qsc[g][0] = ROT ? qsc_s[2 * ti][g] : 0.f;
    qsc[g][1] = ROT ? qsc_s[2 * ti + 1][g] : 0.f;
    qf[g][0] = FMT == 3 ? *reinterpret_cast<const uint32_t*>(&wf_s[gi][g][2 * ti]) : 0u;
    qf[g][1] = FMT == 3 ? *reinterpret_cast<const uint32_t*>(&wf_s[gi][g][8 + 2 * ti]) : 0u;
  }

  float o[KSTEPS][4];
#pragma unroll
  for (int i = 0; i < KSTEPS; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  // rk4v4-e8 V features per group: row gi = sum p c (x 2^-11) of word gi, row gi + 8 = sum p par.
  float vf[G][4];
#pragma unroll
  for (int g = 0; g < G; ++g) vf[g][0] = vf[g][1] = vf[g][2] = vf[g][3] = 0.f;
  float m_r[2] = {-INFINITY, -INFINITY};
  float l_r[2] = {0.f, 0.f};

  // 4-bit reads: byte g * 32 + o (o < 32) of token t sits at k_at(t, 0) + o with bits 5.. XOR g (f(t)
  // is already in k_at(t, 0)), and f depends on t's low 3 bits only. So each thread keeps one K base
  // (row gi) and two V bases (rows 2ti, 2ti + 1; rows + 8 and later sub-chunks share them).
  const int kbase = k_at(gi, 0) + ti * 8;
  // bmma_popc's B columns (decode_ops.cuh): each lane gets the bit counts of its own four registers
  const uint32_t bm_c0 = gi == 2 * ti ? 0x10000000u : 0u, bm_c1 = gi == 2 * ti + 1 ? 0x10000000u : 0u;
  const uint32_t bm_s0 = gi == 2 * ti ? 0x01111111u : 0u, bm_s1 = gi == 2 * ti + 1 ? 0x01111111u : 0u;
  const int vbase0 = k_at(2 * ti, 0) + gi * 4, vbase1 = k_at(2 * ti + 1, 0) + gi * 4;

  int use_stage = 0;
  for (int it = 0; it < my_n; ++it) {
    cp_wait<NST - 2>();
    __syncwarp();
    issue(it + NST - 1);  // refills the stage consumed in the previous iteration
    const uint8_t* st = wbase + (NST == 2 ? (it & 1) : use_stage) * STAGE;
    if (NST != 2) use_stage = use_stage + 1 == NST ? 0 : use_stage + 1;
    const uint8_t* sk = st;
    const uint8_t* sv = st + CHUNK * RB;
    const __half* sks = reinterpret_cast<const __half*>(st + CHUNK * (2 * RB));
    const __half* svs = reinterpret_cast<const __half*>(st + CHUNK * (2 * RB + SB));
    const int t0 = t_lo + (warp + it * NW) * CHUNK;

    // ---- scores S^T [tokens x q rows] for the chunk
    float sc[NSUB][4];
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      const int ta = sub * 16 + gi, tb = ta + 8;
      float tot[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float acc[4] = {cin[g][0], cin[g][1], cin[g][0], cin[g][1]};
        int ai[4];  // 4-bit: the integer score accumulator
        if (FMT == 1) {
          const int ch = 4 * g + ti;
          uint4 wa = *reinterpret_cast<const uint4*>(sk + k_at(ta, ch));
          uint4 wb = *reinterpret_cast<const uint4*>(sk + k_at(tb, ch));
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
          const uint8_t* pk = sk + (kbase ^ (g << 5)) + sub * 16 * RB;
          uint2 wa = *reinterpret_cast<const uint2*>(pk);
          uint2 wb = *reinterpret_cast<const uint2*>(pk + 8 * RB);
          ai[0] = ai[1] = ai[2] = ai[3] = 0;
          const uint32_t m4 = 0x0F0F0F0Fu;  // a word's nibbles 0, 2, 4, 6 (then 1, 3, 5, 7) as bytes
          imma16832(ai, wa.x & m4, wb.x & m4, (wa.x >> 4) & m4, (wb.x >> 4) & m4, qi[g][0][0], qi[g][0][1]);
          imma16832(ai, wa.y & m4, wb.y & m4, (wa.y >> 4) & m4, (wb.y >> 4) & m4, qi[g][1][0], qi[g][1][1]);
          if (FMT == 3) {  // k = 2ti + h: c of word 2ti + h; k = 2ti + 8 + h: its par
            const uint32_t one16 = 0x2C002C00u, bit = 0x10001000u;
            // bit counts of the words as loaded (bmma_popc): p[0..3] = (ta, 2ti), (tb, 2ti), (ta, 2ti + 1),
            // (tb, 2ti + 1) as (token, word); pc = c (bit 28), ps = nibbles 0..6's low bits (parity = par)
            int pc[4] = {0, 0, 0, 0}, ps[4] = {0, 0, 0, 0};
            bmma_popc(pc, wa.x, wa.y, wb.x, wb.y, bm_c0, bm_c1);
            bmma_popc(ps, wa.x, wa.y, wb.x, wb.y, bm_s0, bm_s1);
            const uint32_t f0 = (uint32_t)pc[2] * 0x10000000u + ((uint32_t)pc[0] * 0x1000u + one16);
            const uint32_t f1 = (uint32_t)pc[3] * 0x10000000u + ((uint32_t)pc[1] * 0x1000u + one16);
            const uint32_t f2 = lop_and_or((uint32_t)ps[2] * 0x10000000u + (uint32_t)ps[0] * 0x1000u, bit, one16);
            const uint32_t f3 = lop_and_or((uint32_t)ps[3] * 0x10000000u + (uint32_t)ps[1] * 0x1000u, bit, one16);
            mma16816(acc, f0, f1, f2, f3, qf[g][0], qf[g][1]);
          }
        }
        if (FMT != 1) {
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[i] = fmaf(qsc[g][i & 1], (float)ai[i], acc[i]);
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
    // Lazy rescale: the running max moves only when a chunk's max exceeds it by more than 8 (log2
    // units), so most chunks skip the O *= alpha pass; P <= 2^8 stays exact enough in fp16 and the
    // final merge uses the same max (H200, 90K/128K: rk4v4-e8 D128 -3%, int8 and D256 unchanged).
    // Whether any row's chunk max exceeds it is known from this lane's own scores, so the max's
    // shuffles run only then. m_r = -inf before the first chunk: the first chunk always rescales.
    float cm[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      cm[0] = fmaxf(cm[0], fmaxf(sc[sub][0], sc[sub][2]));
      cm[1] = fmaxf(cm[1], fmaxf(sc[sub][1], sc[sub][3]));
    }
    if (__any_sync(0xffffffffu, cm[0] > m_r[0] + 8.f || cm[1] > m_r[1] + 8.f)) {
#pragma unroll
      for (int off = 4; off < 32; off <<= 1) {
        cm[0] = fmaxf(cm[0], __shfl_xor_sync(0xffffffffu, cm[0], off));
        cm[1] = fmaxf(cm[1], __shfl_xor_sync(0xffffffffu, cm[1], off));
      }
      float alpha[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mn = fmaxf(m_r[r], cm[r]);
        alpha[r] = ex2(m_r[r] - mn);
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
#pragma unroll
      for (int g = 0; g < (FMT == 3 ? G : 0); ++g) {
        vf[g][0] *= alpha[0];
        vf[g][1] *= alpha[1];
        vf[g][2] *= alpha[0];
        vf[g][3] *= alpha[1];
      }
    }
#pragma unroll
    for (int sub = 0; sub < NSUB; ++sub) {
      float p0 = ex2(sc[sub][0] - m_r[0]), p1 = ex2(sc[sub][1] - m_r[1]);
      float p2 = ex2(sc[sub][2] - m_r[0]), p3 = ex2(sc[sub][3] - m_r[1]);
      l_r[0] += p0 + p2;
      l_r[1] += p1 + p3;
      // P^T (tokens x rows) in C layout -> B fragments (tokens as k) by 8x8 transposes.
      uint32_t pb0 = movtrans(pack_half2(p0, p1));  // tokens 0..7 of the sub-chunk
      uint32_t pb1 = movtrans(pack_half2(p2, p3));  // tokens 8..15
      // this thread's B tokens: k = 2ti, 2ti + 1, 2ti + 8, 2ti + 9
      const int toks[4] = {sub * 16 + 2 * ti, sub * 16 + 2 * ti + 1, sub * 16 + 2 * ti + 8, sub * 16 + 2 * ti + 9};
#pragma unroll
      for (int g = 0; g < G; ++g) {
        // V scale folded into P per group (zero past the split's end, see issue()).
        __half s0 = svs[toks[0] * G + g], s1 = svs[toks[1] * G + g];
        __half s8 = svs[toks[2] * G + g], s9 = svs[toks[3] * G + g];
        __half2 sA = __halves2half2(s0, s1), sB = __halves2half2(s8, s9);
        uint32_t b0 = hmul2u(pb0, *reinterpret_cast<uint32_t*>(&sA));
        uint32_t b1 = hmul2u(pb1, *reinterpret_cast<uint32_t*>(&sB));
        if (FMT == 1) {
          // thread row gi holds bytes 8gi..8gi+7 of group g; m-tile q: rows gi -> byte 8gi+2q, gi+8 -> +1
          const int byte = g * 64 + gi * 8;
          const int ch = byte >> 4, inner = byte & 15;
          uint2 w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            int t = toks[k];
            w[k] = *reinterpret_cast<const uint2*>(sv + k_at(t, ch) + inner);
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
          const uint8_t* pv0 = sv + (vbase0 ^ (g << 5)) + sub * 16 * RB;
          const uint8_t* pv1 = sv + (vbase1 ^ (g << 5)) + sub * 16 * RB;
          const uint32_t w[4] = {*reinterpret_cast<const uint32_t*>(pv0), *reinterpret_cast<const uint32_t*>(pv1),
                                 *reinterpret_cast<const uint32_t*>(pv0 + 8 * RB),
                                 *reinterpret_cast<const uint32_t*>(pv1 + 8 * RB)};
          uint32_t c01 = 0, c89 = 0;  // byte 3 of two tokens (qq = 3): their coset bits at bits 12 / 28
#pragma unroll
          for (int qq = 0; qq < 4; ++qq) {
            // byte qq of two tokens: low nibbles (dims 16qq + gi) as u - 8, high (16qq + 8 + gi) as 16 (u - 8):
            // V accumulates over the whole split, so the 1024 bias goes before the MMA (exact in fp16)
            const uint32_t sel = (uint32_t)(qq | (qq << 4) | ((qq + 4) << 8) | ((qq + 4) << 12));
            const uint32_t x01 = prmt(w[0], w[1], sel), x89 = prmt(w[2], w[3], sel);
            const uint32_t lo8 = 0x64086408u, hi8 = 0x64806480u;  // 1032, 1152
            const uint32_t a0 = hsub2u(lop_and_or(x01, 0x000f000fu, 0x64006400u), lo8);
            const uint32_t a1 = hsub2u(lop_and_or(x01, 0x00f000f0u, 0x64006400u), hi8);
            const uint32_t a2 = hsub2u(lop_and_or(x89, 0x000f000fu, 0x64006400u), lo8);
            const uint32_t a3 = hsub2u(lop_and_or(x89, 0x00f000f0u, 0x64006400u), hi8);
            mma16816(o[g * 4 + qq], a0, a1, a2, a3, b0, b1);
            if (qq == 3) c01 = x01, c89 = x89;
          }
          if (FMT == 3) {  // c: bits 12 / 28 of byte 3's pair above; par: bit counts as in K
            const uint32_t bit = 0x10001000u;
            int ps[4] = {0, 0, 0, 0};  // nibbles 0..6's low bits of w[0], w[2], w[1], w[3]
            bmma_popc(ps, w[0], w[1], w[2], w[3], bm_s0, bm_s1);
            mma16816(vf[g], c01 & bit, lop_and_or((uint32_t)ps[2] * 0x10000000u + (uint32_t)ps[0] * 0x1000u, bit, 0u),
                     c89 & bit, lop_and_or((uint32_t)ps[3] * 0x10000000u + (uint32_t)ps[1] * 0x1000u, bit, 0u), b0, b1);
          }
        }
      }
    }
    __syncwarp();
  }
  cp_wait<0>();
  if (ROT) {
    // V operands were sc (u - 8) with sc = 16 on odd nibbles (rows gi + 8 of every m-tile). rk4v4-e8:
    // every coordinate of word gi gains c/2 and its nibble 7 (m-tile 3 of the group) par - c.
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float fc = vf[g][h] * 2048.f, f7 = vf[g][2 + h] * 2048.f - fc;
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
          float* acc = o[g * 4 + qq];
          acc[2 + h] *= 0.0625f;
          if (FMT == 3) {
            acc[h] += 0.5f * fc;
            acc[2 + h] += 0.5f * fc + (qq == 3 ? f7 : 0.f);
          }
        }
      }
    }
  }

  // ---- merge the warps of the block, write this split's partial (natural basis for every format)
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) {
    l_r[0] += __shfl_xor_sync(0xffffffffu, l_r[0], off);
    l_r[1] += __shfl_xor_sync(0xffffffffu, l_r[1], off);
  }
  __syncthreads();  // every warp is done with its stages: reuse smem for the partial outputs
  constexpr int OS = part_stride<D, ROT>;  // [NW][8][OS] (see part_stride)
  float* o_s = reinterpret_cast<float*>(smem);
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
    float* base = o_s + warp * 8 * OS;
    base[(2 * ti) * OS + d0] = o[mt][0];
    base[(2 * ti + 1) * OS + d0] = o[mt][1];
    base[(2 * ti) * OS + d1] = o[mt][2];
    base[(2 * ti + 1) * OS + d1] = o[mt][3];
  }
  __syncthreads();
  write_split<D, NW, ROT>(o_s, &m_s[0][0], &l_s[0][0], mid_o, mid_lse,
                          ((int64_t)b * hq + h0) * num_splits + split, group, num_splits);
}

}  // namespace nd

#ifdef ND_FMT
#ifndef ND_MINB
#define ND_MINB 1
#endif
extern "C" __global__ void __launch_bounds__(ND_NW * 32, ND_MINB)
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

