// Design C's decode step (incremental_decode_triton.py) written out for warps: `decode_weights` (its
// `_decode_weights_kernel`, a block of four warps a (sequence, v head)), `decode_values` (its `_decode_kernel`
// up to the row's output, a block a (sequence, v head, v tile of 32), a warp 16 of its columns) and
// `decode_commit` (that kernel's state update where the row completes its chunk); bf16 inputs, d_k = 128,
// chunks of 64, row tiles of 16.
// Every value is computed by the instructions the Triton chunk kernels use for it, so its bits are theirs:
//  - a product of bf16 tiles (tl.dot): mma.sync m16n8k16 (bf16 in, fp32 accumulate), K in steps of 16 in
//    order from a zero accumulator; an element depends only on its row of A and column of B, so the row
//    sits in a 16-row A whose other rows are whatever (here the tile's rows or zeros);
//  - an FMA dot (fp32, tl.dot ieee): one fmaf chain per element over K in order from zero, zero terms kept;
//  - tl.exp: ex2.approx.f32 of x * log2(e) rounded; rounding to bf16: cvt.rn.bf16.f32 (cvt.rn.bf16x2.f32 for
//    two at once: each rounded alike); no contraction
//    (the Triton kernels compile with enable_fp_fusion=False): every product and sum is an _rn intrinsic.
// No headers: NVRTC compiles it without a CUDA toolkit (bf16 as its 16 bits).

typedef unsigned short bf16;

#define CH 64
#define DK 128
#define ROWS 16

__device__ __forceinline__ float bf2f(bf16 x) { return __uint_as_float(((unsigned)x) << 16); }

// The three instructions (GPU); tests/kernels/gated_delta/simt_host.h stands in for them where the file
// is compiled for the CPU (an emulation that checks the indexing and the algorithm, not the bits).
#ifdef __CUDA_ARCH__
__device__ __forceinline__ bf16 f2bf(float x) {
  bf16 r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float texp(float x) {  // Triton's tl.exp
  float y;
  asm("ex2.approx.f32 %0, %1;" : "=f"(y) : "f"(__fmul_rn(x, __int_as_float(0x3FB8AA3B))));
  return y;
}

__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                         unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
#endif

__device__ __forceinline__ unsigned pack2(bf16 lo, bf16 hi) { return (unsigned)lo | ((unsigned)hi << 16); }

__device__ __forceinline__ unsigned load2(const bf16* p) { return *reinterpret_cast<const unsigned*>(p); }

// 8 consecutive bf16 (16 bytes) from p: one 16-byte load where VEC (the launcher checked the alignment), else
// four 4-byte ones
__device__ __forceinline__ uint4 load8(const bf16* p, int vec) {
  if (vec) return *reinterpret_cast<const uint4*>(p);
  return make_uint4(load2(p), load2(p + 2), load2(p + 4), load2(p + 6));
}

// Dims d .. d + 7 of chunk row j's key (VEC: `load8`): the slot's row before p (ck: the slot's keys, [CH - 1,
// HK, DK]), the row's own (k_own) at p, zeros past it
__device__ __forceinline__ uint4 chunk_key8(const bf16* ck, const bf16* k_own, int j, int p, int HK, int hk, int d,
                                            int vec) {
  if (j < p) return load8(ck + ((long long)j * HK + hk) * DK + d, vec);
  return j == p ? load8(k_own + d, vec) : make_uint4(0u, 0u, 0u, 0u);
}


// G [CH] = the chunk's gates summed in order, by `gate_cumsum`'s FMA dot (row i: fmaf(j <= i, g_j, acc) over
// j = 0 .. CH - 1, zero terms kept); the warp's lanes each take two rows. Syncs the warp before and after.
__device__ __forceinline__ void gate_cumsum(const float* g, float* G, int lane) {
  __syncwarp();
  for (int i = lane; i < CH; i += 32) {
    float acc = 0.f;
#pragma unroll 16
    for (int j = 0; j < CH; ++j) acc = __fmaf_rn(j <= i ? 1.f : 0.f, g[j], acc);
    G[i] = acc;
  }
  __syncwarp();
}

// Shared-memory staging for decode_values / decode_commit: cp.async copies (16 bytes where the launcher
// found every staged row 16-byte aligned, else 4), zero-filled where a row is not there, and ldmatrix.trans
// fragments of bf16 tiles stored [chunk row][column]. Stand-ins in simt_host.h on the CPU.
#ifdef __CUDA_ARCH__
__device__ __forceinline__ unsigned smem_addr(const void* p) {
  unsigned r;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
  return r;
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async4(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(valid ? 4 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Four 8 x 8 bf16 matrices, lane 8m + r giving row r's address of matrix m; a lane gets, of each, rows 2t, 2t + 1
// at column g (t = lane % 4, g = lane / 4): an mma B (or A) fragment of a tile stored row = K
__device__ __forceinline__ void ldsm_x4_trans(unsigned* r, const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

// The same without .trans: of each matrix, row g at columns 2t, 2t + 1 (a B fragment of a tile stored row = N)
__device__ __forceinline__ void ldsm_x4(unsigned* r, const void* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(row_addr)));
}

// (dt(lo), dt(hi)) in one register: cvt.rn.bf16x2.f32 rounds each as cvt.rn.bf16.f32 does
__device__ __forceinline__ unsigned f2bf2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
#endif

// Two consecutive floats (8 bytes at once where ALIGN16: the rows start on 16 bytes; else one at a time)
__device__ __forceinline__ float2 load_f2(const float* p, int align16) {
  return align16 ? *reinterpret_cast<const float2*>(p) : make_float2(p[0], p[1]);
}

__device__ __forceinline__ void store_f2(float* p, float x, float y, int align16) {
  if (align16) {
    *reinterpret_cast<float2*>(p) = make_float2(x, y);
  } else {
    p[0] = x;
    p[1] = y;
  }
}

// Two consecutive bf16 (4 bytes at once where ALIGN16, else one at a time)
__device__ __forceinline__ void store_bf2(bf16* p, unsigned pair, int align16) {
  if (align16) {
    *reinterpret_cast<unsigned*>(p) = pair;
  } else {
    p[0] = (bf16)(pair & 0xFFFFu);
    p[1] = (bf16)(pair >> 16);
  }
}

// 16 bytes from src to shared dst (zeros where !valid): one copy where ALIGN16, else four of 4 bytes
__device__ __forceinline__ void stage16(void* dst, const void* src, bool valid, int align16) {
  if (align16) {
    cp_async16(dst, src, valid);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i)
      cp_async4(static_cast<char*>(dst) + 4 * i, static_cast<const char*>(src) + 4 * i, valid);
  }
}

#define KP (DK + 8)  // a staged key row, padded: fragment reads free of bank conflicts
#define WWARPS 4     // warps a decode_weights block

// The slot's T rows of v head hv before chunk row p (zeros from p on) to s_t [CH][CH] (cp.async; the caller
// commits the group)
__device__ __forceinline__ void stage_t_rows(float* s_t, const float* ct, int hv, int HV, int p, int align16) {
  for (int e = threadIdx.x; e < CH * CH / 4; e += 32 * WWARPS) {
    const int j = e / (CH / 4), c = e % (CH / 4) * 4;
    stage16(&s_t[j * CH + c], ct + ((long long)j * HV + hv) * CH + c, j < p, align16);
  }
}

// Program: block of four warps (sequence n, v heads hv0 .. hv0 + VG - 1 of one key head; VG divides RATIO, the
// launcher's choice), the heads one after another. Q, K: prepared q_hat, k_hat [T, HK, DK]; A, B: prepared g,
// beta [T, HV] fp32 (row start[n]); CK, CG, CB, CT: the cache's k, g, beta, t (slot strides SK, SG, SB, ST in
// elements, int: the launcher checks they fit); T_ROW [N, HV, CH] fp32, W_ROW, QG_ROW [N, HV, DK] and P_ROW
// [N, HV, CH] in bf16: the scratch rows `decode_values` reads. Strides in elements; ALIGN16: the key rows (the
// cache's and K's) and the slot's T rows start on 16 bytes.
// The block stages the chunk's keys once and takes the products of keys (k_b k_c^T, q k_c^T) once for its
// heads; a head's T rows are staged while the head before it finishes. The products split over the warps by
// output columns (each element computed as one warp would), the row's chains of FMA dots (its L and T rows)
// run on warp 0.
extern "C" __global__ void __launch_bounds__(32 * WWARPS) decode_weights(
    const bf16* Q, const bf16* K, const float* A, const float* B, bf16* CK, float* CG, float* CB, float* CT,
    int SK, int SG, int SB, int ST, const long long* START, const long long* HELD,
    const long long* SLOT, float* T_ROW, bf16* W_ROW, bf16* P_ROW, bf16* QG_ROW, int n_seqs, int stride_qt,
    int stride_qh, int stride_kt, int stride_kh, int stride_at, int stride_bt, int HK, int HV, int RATIO,
    int ALIGN16, int VG) {
  __shared__ __align__(16) bf16 s_k[CH][KP];   // the chunk's keys: the slot's rows, the row's own, zeros
  __shared__ __align__(16) float s_t[CH][CH];  // the head's slot T rows before p, zeros from p on
  __shared__ float s_a[ROWS][CH + 1];          // the tile's rows of A against the chunk
  __shared__ float sg[CH], sG[CH], sbeta[CH], sr[CH], st[CH], sl[ROWS];
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const int groups = RATIO / VG;
  const long long prog = blockIdx.x;
  if (prog >= (long long)n_seqs * HK * groups) return;
  const int n = (int)(prog / ((long long)HK * groups)), hk = (int)(prog / groups % HK);
  const int hv0 = hk * RATIO + (int)(prog % groups) * VG;
  const long long slot = SLOT[n];
  if (slot < 0) return;  // a padded request
  const int p = (int)HELD[n], first = p & ~(ROWS - 1), place = p & (ROWS - 1);
  const long long start = START[n];
  const bf16* ck = CK + slot * SK;
  float* cg = CG + slot * SG;
  float* cb = CB + slot * SB;
  float* ct = CT + slot * ST;
  const bf16* k_own = K + start * stride_kt + (long long)hk * stride_kh;
  const bf16* q_own = Q + start * stride_qt + (long long)hk * stride_qh;
  float* sa = &s_a[0][0];

  // 0. stage the chunk's keys (the slot's rows before p, the row's own at p, zeros past it) and the first
  //    head's T rows
  for (int e = threadIdx.x; e < CH * DK / 8; e += 32 * WWARPS) {
    const int j = e / (DK / 8), c = e % (DK / 8) * 8;
    stage16(&s_k[j][c], j < p ? ck + ((long long)j * HK + hk) * DK + c : k_own + c, j <= p, ALIGN16);
  }
  stage_t_rows(&s_t[0][0], ct, hv0, HV, p, ALIGN16);
  cp_async_commit();

  // 2. kk = k_b k_c^T [16, CH] (the tile's keys against the chunk's) and qk = q k_c^T (the row's own, in
  //    row `place` of a 16-row tile), the warp's two column blocks (chunk rows 16 w .. 16 w + 15)
  float kk[2][4], qk[2][4];
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) kk[i][e] = qk[i][e] = 0.f;
  const int r_lo = first + gq, r_hi = first + gq + 8;  // this lane's A rows (tile rows gq and gq + 8)
  const bool q_lo = gq == place, q_hi = gq + 8 == place;
  cp_async_wait_all();
  __syncthreads();
#pragma unroll
  for (int k0 = 0; k0 < DK; k0 += 16) {
    const int c0 = k0 + 2 * tq;
    const unsigned a0 = load2(&s_k[r_lo][c0]), a2 = load2(&s_k[r_lo][c0 + 8]);
    const unsigned a1 = load2(&s_k[r_hi][c0]), a3 = load2(&s_k[r_hi][c0 + 8]);
    const unsigned q0 = q_lo ? load2(q_own + c0) : 0u, q2 = q_lo ? load2(q_own + c0 + 8) : 0u;
    const unsigned q1 = q_hi ? load2(q_own + c0) : 0u, q3 = q_hi ? load2(q_own + c0 + 8) : 0u;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int j = (2 * wid + i) * 8 + gq;  // B's column: chunk row j
      const unsigned b0 = load2(&s_k[j][c0]), b1 = load2(&s_k[j][c0 + 8]);
      mma16816(kk[i], a0, a1, a2, a3, b0, b1);
      mma16816(qk[i], q0, q1, q2, q3, b0, b1);
    }
  }

  for (int h = 0; h < VG; ++h) {
    const int hv = hv0 + h;
    const long long row = (long long)n * HV + hv;
    const float g_p = A[start * stride_at + hv], beta_p = B[start * stride_bt + hv];
    // 1. the head's gates and betas (the slot's rows, the row's own at p, zeros past it) and G by the FMA dot
    //    of `gate_cumsum` (row i: fmaf(j <= i, g_j, acc) over j = 0 .. CH - 1); its T rows have landed
    if (wid == 0) {
      for (int j = lane; j < CH; j += 32) {
        sg[j] = j < p ? cg[j * HV + hv] : (j == p ? g_p : 0.f);
        sbeta[j] = j < p ? cb[j * HV + hv] : (j == p ? beta_p : 0.f);
      }
      gate_cumsum(sg, sG, lane);
    }
    cp_async_wait_all();
    __syncthreads();

    // 3. A of the tile's rows (`a_rows`: beta_i (k_i . k_j) exp(G_i - G_j) for j < i, else 0) to shared
    //    memory; the row's P (`output_weights`: dt((q . k_j) exp(G_p - G_j)) for j <= p) straight to its
    //    scratch row
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = gq + (e >= 2 ? 8 : 0), c = (2 * wid + i) * 8 + 2 * tq + (e & 1), pos = first + r;
        const bool before = c < pos;
        const float gi = sG[pos];  // pos < CH: first <= CH - ROWS
        const float x = __fmul_rn(__fmul_rn(sbeta[pos], kk[i][e]), texp(before ? __fsub_rn(gi, sG[c]) : 0.f));
        sa[r * (CH + 1) + c] = before ? x : 0.f;
        if (r == place) {
          const bool causal = c <= p;
          const float w = __fmul_rn(qk[i][e], texp(causal ? __fsub_rn(sG[p], sG[c]) : 0.f));
          P_ROW[row * CH + c] = f2bf(causal ? w : 0.f);
        }
      }
    __syncthreads();

    if (wid == 0) {
      // 4. the row's L within the tile (`solve_block_row_at`): acc = e_place, then fmaf(-a_j, L_j, acc) for
      //    j < place
      if (lane < ROWS) {
        const int i = lane;
        float acc = i == place ? 1.f : 0.f;
#pragma unroll
        for (int j = 0; j < ROWS; ++j)  // static bound: the loads issue ahead of the chain
          if (j < place) acc = __fmaf_rn(-sa[place * (CH + 1) + first + j], s_t[first + j][first + i], acc);
        sl[i] = i <= place ? acc : 0.f;
      }
      __syncwarp();

      // 5. the row's T before the tile (`tile_rows`): r = L a_off (FMA dot over the tile's 16 rows), then
      //    -r T_before (FMA dot over the chunk's 64 rows, zeros from `first` on; a lane's two columns together)
      for (int c = lane; c < CH; c += 32) {
        float acc = 0.f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) acc = __fmaf_rn(sl[i], c < first ? sa[i * (CH + 1) + c] : 0.f, acc);
        sr[c] = acc;
      }
      __syncwarp();
      float acc[2] = {0.f, 0.f};  // columns lane, lane + 32
#pragma unroll
      for (int j = 0; j < CH; ++j) {
        const float r = -sr[j];
        acc[0] = __fmaf_rn(r, j < first ? s_t[j][lane] : 0.f, acc[0]);
        acc[1] = __fmaf_rn(r, j < first ? s_t[j][lane + 32] : 0.f, acc[1]);
      }
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int c = lane + 32 * hh;
        // the row as `pick` takes it from the tile (a sum with zeros: exact, -0 becomes +0)
        const float t = __fadd_rn(c < first ? acc[hh] : (c < first + ROWS ? sl[c - first] : 0.f), 0.f);
        st[c] = t;
        T_ROW[row * CH + c] = t;
      }
    } else if (wid == 1) {  // y's row scales (the gates' slots are free now)
      for (int j = lane; j < CH; j += 32) sg[j] = __fmul_rn(sbeta[j], texp(sG[j]));
    }
    __syncthreads();
    if (h + 1 < VG) {  // the next head's T rows, while this one finishes (no one reads s_t until then)
      stage_t_rows(&s_t[0][0], ct, hv + 1, HV, p, ALIGN16);
      cp_async_commit();
    }

    // 6. W = dt(dt(T_row) y), y = dt(k_j beta_j exp(G_j)) (`solved_product` of `decayed_keys`); the row in
    //    row `place` of the A tile; the warp's four blocks of 8 key dims
    const bool w_lo = gq == place, w_hi = gq + 8 == place;
    unsigned ta[CH / 16][2];
#pragma unroll
    for (int ks = 0; ks < CH / 16; ++ks) {
      const int j0 = ks * 16 + 2 * tq;
      ta[ks][0] = pack2(f2bf(st[j0]), f2bf(st[j0 + 1]));
      ta[ks][1] = pack2(f2bf(st[j0 + 8]), f2bf(st[j0 + 9]));
    }
#pragma unroll
    for (int i = 0; i < DK / 8 / WWARPS; ++i) {
      const int nb = wid * (DK / 8 / WWARPS) + i;
      float w[4] = {0.f, 0.f, 0.f, 0.f};
      const int d = nb * 8 + gq;  // B's column: key dim d
#pragma unroll
      for (int ks = 0; ks < CH / 16; ++ks) {
        const int j0 = ks * 16 + 2 * tq;
        bf16 y[4];
        const int js[4] = {j0, j0 + 1, j0 + 8, j0 + 9};
#pragma unroll
        for (int e = 0; e < 4; ++e) y[e] = f2bf(__fmul_rn(bf2f(s_k[js[e]][d]), sg[js[e]]));  // zero keys past p
        const unsigned t0 = ta[ks][0], t2 = ta[ks][1];
        mma16816(w, w_lo ? t0 : 0u, w_hi ? t0 : 0u, w_lo ? t2 : 0u, w_hi ? t2 : 0u, pack2(y[0], y[1]),
                 pack2(y[2], y[3]));
      }
      if (w_lo || w_hi) {
        const int col = nb * 8 + 2 * tq;
        W_ROW[row * DK + col] = f2bf(w_lo ? w[0] : w[2]);
        W_ROW[row * DK + col + 1] = f2bf(w_lo ? w[1] : w[3]);
      }
    }

    // 7. dt(q exp(G_p)) (`output_weights`), and the row to the slot unless it completes the chunk
    const float eg = texp(sG[p]);
    for (int d = threadIdx.x; d < DK; d += 32 * WWARPS) QG_ROW[row * DK + d] = f2bf(__fmul_rn(bf2f(q_own[d]), eg));
    if (p < CH - 1) {
      if (threadIdx.x == 0) {
        cg[p * HV + hv] = g_p;
        cb[p * HV + hv] = beta_p;
      }
      for (int c = threadIdx.x; c < CH; c += 32 * WWARPS) ct[((long long)p * HV + hv) * CH + c] = st[c];
      if (hv % RATIO == 0)
        for (int d = threadIdx.x; d < DK; d += 32 * WWARPS)
          CK[slot * SK + ((long long)p * HK + hk) * DK + d] = k_own[d];
    }
    __syncthreads();  // every warp is done with the head's gates, A rows and T row before the next head's
  }
}

#define BV 32                     // value columns a decode_values block
#define WV 16                     // value columns a warp of it
#define VWARPS (BV / WV)          // warps a decode_values block
#define SP (DK + 8)               // a staged state row, bf16, padded: fragment reads free of bank conflicts
#define XP (BV + 8)               // a staged x / V' row, bf16, padded likewise

// Program: block (sequence n, v head hv, v tile iv of BV columns), each warp WV of them. V: prepared x =
// dt(beta v) [T, HV, DV]; OUT [T, HV, DV]; STATE, STATE_DT, CX, CVN: the cache's state, state_dt (dt(S), what
// the products read), x and vnew (slot strides in elements); READ [N]: the slot whose state the row reads (-1:
// zeros, and the slot's state and state_dt are zeroed: a sequence that starts here); the scratch rows of
// `decode_weights`; VN_ROW [N, HV, DV]: the row's V', which `decode_commit` reads where the row completes
// its chunk.
// U = dt(dt(T_row) x), V' = dt(U - W dt(S)), o = dt(q exp(G)) dt(S) + P V' (`_decode_kernel`); the row's x
// and V' then go to the slot unless the row completes its chunk. The block first stages its state rows and
// the chunk's x and V' rows (its columns) in shared memory, every copy in flight at once (the step is a read
// of the state: the bytes in flight set its speed), then each warp multiplies from there.
extern "C" __global__ void __launch_bounds__(32 * VWARPS) decode_values(
    const bf16* V, bf16* OUT, float* STATE, bf16* STATE_DT, bf16* CX, bf16* CVN, int S_STATE, int S_STATE_DT, int SX,
    int SVN, const long long* START, const long long* HELD, const long long* SLOT, const long long* READ,
    const float* T_ROW, const bf16* W_ROW, const bf16* P_ROW, const bf16* QG_ROW, bf16* VN_ROW, int n_seqs, int stride_vt, int stride_vh,
    int stride_ot, int stride_oh, int HV, int DV, int ALIGN16) {
  __shared__ __align__(16) bf16 s_state[BV][SP];   // the block's rows (v) of dt(S) over the key dim
  __shared__ __align__(16) bf16 s_x[CH][XP];       // the chunk's x rows at the block's columns
  __shared__ __align__(16) bf16 s_vn[CH][XP];      // and its V' rows (the row's own written in step 2)
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const int tiles = DV / BV;
  const long long prog = blockIdx.x;
  if (prog >= (long long)n_seqs * HV * tiles) return;
  const int iv = (int)(prog % tiles), hv = (int)(prog / tiles % HV), n = (int)(prog / tiles / HV);
  const long long slot = SLOT[n];
  if (slot < 0) return;  // a padded request (the whole block)
  const int p = (int)HELD[n], place = p & (ROWS - 1);
  const long long start = START[n], read = READ[n], row = (long long)n * HV + hv;
  const int v0 = iv * BV, c0 = wid * WV;  // the block's first column; the warp's first within the block
  const bf16* x_own = V + start * stride_vt + (long long)hv * stride_vh + v0;

  // 0. stage: the rows v0 .. v0 + BV - 1 of dt(S) (zeros where read < 0), the chunk's x rows (the slot's before
  //    p, the row's own at p, zeros past it) and V' rows (the slot's before p, zeros from p on)
  const bf16* s_rd = STATE_DT + (read < 0 ? 0 : read) * S_STATE_DT + ((long long)hv * DV + v0) * DK;
  for (int e = threadIdx.x; e < BV * DK / 8; e += 32 * VWARPS) {
    const int v = e / (DK / 8), c = e % (DK / 8) * 8;
    stage16(&s_state[v][c], s_rd + (long long)v * DK + c, read >= 0, ALIGN16);
  }
  for (int e = threadIdx.x; e < CH * BV / 8; e += 32 * VWARPS) {
    const int j = e / (BV / 8), c = e % (BV / 8) * 8;
    const long long off = ((long long)j * HV + hv) * DV + v0 + c;
    stage16(&s_x[j][c], j < p ? CX + slot * SX + off : x_own + c, j <= p, ALIGN16);
    stage16(&s_vn[j][c], CVN + slot * SVN + off, j < p, ALIGN16);
  }
  cp_async_commit();
  // the row's A fragments (row `place` of a 16-row tile, lanes gq == place % 8; zeros elsewhere): its T row
  // rounded to dt and P over the chunk's rows (4 steps of 16); W's and q's over the key dim (8 steps)
  const bool lo = gq == place, hi = gq + 8 == place, mine = lo || hi;  // lanes holding the row in A
  unsigned ta[CH / 16][2], pa[CH / 16][2], wa[DK / 16][2], qa[DK / 16][2];
#pragma unroll
  for (int ks = 0; ks < CH / 16; ++ks) {
    const int j0 = ks * 16 + 2 * tq;
    const float* tr = T_ROW + row * CH + j0;
    ta[ks][0] = mine ? f2bf2(tr[0], tr[1]) : 0u;
    ta[ks][1] = mine ? f2bf2(tr[8], tr[9]) : 0u;
    pa[ks][0] = mine ? load2(P_ROW + row * CH + j0) : 0u;
    pa[ks][1] = mine ? load2(P_ROW + row * CH + j0 + 8) : 0u;
  }
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {
    const int d0 = ks * 16 + 2 * tq;
    wa[ks][0] = mine ? load2(W_ROW + row * DK + d0) : 0u;
    wa[ks][1] = mine ? load2(W_ROW + row * DK + d0 + 8) : 0u;
    qa[ks][0] = mine ? load2(QG_ROW + row * DK + d0) : 0u;
    qa[ks][1] = mine ? load2(QG_ROW + row * DK + d0 + 8) : 0u;
  }
  cp_async_wait_all();
  __syncthreads();

  // V' = dt(dt(U) - W S) (`delta_rows`), then `pick`'s sum with the tile's zeros (exact, but -0 becomes +0)
  auto delta = [](float u, float ws) { return f2bf(__fadd_rn(bf2f(f2bf(__fsub_rn(bf2f(f2bf(u)), ws))), 0.f)); };
  // the fragment (a0, a1, a2, a3) of a row-`place` A from its two registers (columns 2t.., 2t+8..)
  auto mma_row = [&](float* c, const unsigned* a, unsigned b0, unsigned b1) {
    mma16816(c, lo ? a[0] : 0u, hi ? a[0] : 0u, lo ? a[1] : 0u, hi ? a[1] : 0u, b0, b1);
  };
  // B fragments of a staged bf16 tile's rows 16 ks .. 16 ks + 15 at the warp's columns: b[nb][0..1] for
  // column blocks nb = 0, 1 (lane 8m + r: row 16 ks + 8 (m & 1) + r, columns c0 + 8 (m >> 1))
  auto tile_b = [&](bf16 (*tile)[XP], int ks, unsigned (*b)[2]) {
    unsigned r[4];
    ldsm_x4_trans(r, &tile[ks * 16 + ((lane >> 3) & 1) * 8 + (lane & 7)][c0 + (lane >> 4) * 8]);
    b[0][0] = r[0], b[0][1] = r[1], b[1][0] = r[2], b[1][1] = r[3];
  };

  // 1. U = dt(T_row) x; W dt(S)^T and dt(q exp(G)) dt(S)^T over the key dim; the row's V' = dt(U - W S)
  //    (`delta_rows`: U rounded to dt first) into its place among the staged V' rows
  float u[2][4], ws[2][4], o[2][4];
#pragma unroll
  for (int nb = 0; nb < 2; ++nb)
#pragma unroll
    for (int e = 0; e < 4; ++e) u[nb][e] = ws[nb][e] = o[nb][e] = 0.f;
#pragma unroll
  for (int ks = 0; ks < CH / 16; ++ks) {
    unsigned b[2][2];
    tile_b(s_x, ks, b);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) mma_row(u[nb], ta[ks], b[nb][0], b[nb][1]);
  }
#pragma unroll
  for (int ks = 0; ks < DK / 16; ++ks) {  // dt(S)^T's columns v = c0 + 8 nb + g at keys 16 ks + 2t (+1, +8, +9)
    unsigned b[4];                         // (lane 8m + r: row c0 + 8 (m >> 1) + r, keys 16 ks + 8 (m & 1))
    ldsm_x4(b, &s_state[c0 + (lane >> 4) * 8 + (lane & 7)][ks * 16 + ((lane >> 3) & 1) * 8]);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      mma_row(ws[nb], wa[ks], b[2 * nb], b[2 * nb + 1]);
      mma_row(o[nb], qa[ks], b[2 * nb], b[2 * nb + 1]);
    }
  }
  if (mine) {  // the row's outputs: c0, c1 (row gq) or c2, c3 (row gq + 8)
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      const int c = c0 + nb * 8 + 2 * tq;
      s_vn[p][c] = delta(hi ? u[nb][2] : u[nb][0], hi ? ws[nb][2] : ws[nb][0]);
      s_vn[p][c + 1] = delta(hi ? u[nb][3] : u[nb][1], hi ? ws[nb][3] : ws[nb][1]);
    }
  }
  __syncwarp();
  // 2. o += P V'; the row to OUT
#pragma unroll
  for (int ks = 0; ks < CH / 16; ++ks) {
    unsigned b[2][2];
    tile_b(s_vn, ks, b);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) mma_row(o[nb], pa[ks], b[nb][0], b[nb][1]);
  }
  if (mine) {
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      bf16* out = OUT + start * stride_ot + (long long)hv * stride_oh + v0 + c0 + nb * 8 + 2 * tq;
      out[0] = f2bf(hi ? o[nb][2] : o[nb][0]);
      out[1] = f2bf(hi ? o[nb][3] : o[nb][1]);
    }
  }
  // 3. the row's x and V' to the slot (a sequence that starts here also gets a zero boundary state), or, where
  //    the row completes its chunk, its V' to VN_ROW for `decode_commit`
  if (lane < WV) {
    const bf16 vn = s_vn[p][c0 + lane];
    if (p < CH - 1) {
      const long long off = ((long long)p * HV + hv) * DV + v0 + c0 + lane;
      CX[slot * SX + off] = x_own[c0 + lane];
      CVN[slot * SVN + off] = vn;
    } else {
      VN_ROW[row * DV + v0 + c0 + lane] = vn;
    }
  }
  if (p < CH - 1 && read < 0) {
    float* st = STATE + slot * S_STATE + ((long long)hv * DV + v0 + c0) * DK;
    bf16* sd = STATE_DT + slot * S_STATE_DT + ((long long)hv * DV + v0 + c0) * DK;
    if (ALIGN16) {
      for (int e = lane; e < WV * DK / 4; e += 32) reinterpret_cast<float4*>(st)[e] = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int e = lane; e < WV * DK / 8; e += 32) reinterpret_cast<uint4*>(sd)[e] = make_uint4(0u, 0u, 0u, 0u);
    } else {
      for (int e = lane; e < WV * DK; e += 32) st[e] = 0.f, sd[e] = (bf16)0;
    }
  }
}

#define BC 64                // value columns a decode_commit tile
#define CWARPS (BC / WV)     // warps a decode_commit block, WV value rows each
#define CP (BC + 8)          // a staged V' row, bf16, padded
#define CSEQ 32              // sequences a decode_commit block looks at, at most (its argument cseq)

// decode_commit's work for sequence n, v head hv (the block's shared buffers passed in); the block's threads
// all call it, and it ends on a barrier, so the next call may refill the buffers.
__device__ __forceinline__ void commit_one(
    const bf16* K, const float* A, float* STATE, bf16* STATE_DT, const bf16* CVN, const bf16* CK, const float* CG,
    int S_STATE, int S_STATE_DT, int SVN, int SK, int SG, const long long* START, const long long* SLOT,
    const long long* READ, const bf16* VN_ROW, int n, int hv, int stride_kt, int stride_kh, int stride_at, int HK,
    int HV, int DV, int RATIO, int VEC_K, int ALIGN16, float* s_g, float* s_G, unsigned (*s_y)[CH / 2 + 4],
    bf16 (*s_vn)[CP]) {
  const int wid = threadIdx.x >> 5, lane = threadIdx.x & 31, gq = lane >> 2, tq = lane & 3;
  const int p = CH - 1, hk = hv / RATIO, r0 = wid * WV;  // r0: the warp's first value row of a tile
  const long long slot = SLOT[n], start = START[n], read = READ[n], row = (long long)n * HV + hv;

  if (wid == 0) {
    for (int j = lane; j < CH; j += 32) s_g[j] = j < p ? CG[slot * SG + (long long)j * HV + hv] : A[start * stride_at + hv];
    gate_cumsum(s_g, s_G, lane);
    for (int j = lane; j < CH; j += 32) s_g[j] = texp(__fsub_rn(s_G[CH - 1], s_G[j]));  // the rows' decay to the end
  }
  __syncthreads();
  const float e_last = texp(s_G[CH - 1]);
  const bf16* k_own = K + start * stride_kt + (long long)hk * stride_kh;
  // y^T to shared memory: a thread's task rows j, j + 1 (j / 2 the fastest: stores free of bank conflicts)
  // at 8 key columns, 16 bytes a row (every row held or the row's own)
#pragma unroll
  for (int e = threadIdx.x; e < CH / 2 * (DK / 8); e += 32 * CWARPS) {
    const int jp = e % (CH / 2), d0 = e / (CH / 2) * 8, j = 2 * jp;
    const uint4 r0k = chunk_key8(CK + slot * SK, k_own, j, p, HK, hk, d0, VEC_K);
    const uint4 r1k = chunk_key8(CK + slot * SK, k_own, j + 1, p, HK, hk, d0, VEC_K);
    const unsigned w0[4] = {r0k.x, r0k.y, r0k.z, r0k.w}, w1[4] = {r1k.x, r1k.y, r1k.z, r1k.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const bf16 k0 = (bf16)(w0[i / 2] >> (16 * (i & 1))), k1 = (bf16)(w1[i / 2] >> (16 * (i & 1)));
      s_y[d0 + i][jp] = pack2(f2bf(__fmul_rn(bf2f(k0), s_g[j])), f2bf(__fmul_rn(bf2f(k1), s_g[j + 1])));
    }
  }
  for (int v0 = 0; v0 < DV; v0 += BC) {
    // the chunk's V' rows at the tile's columns (the slot's, the row's own from VN_ROW) to shared memory
    for (int e = threadIdx.x; e < CH * BC / 8; e += 32 * CWARPS) {
      const int j = e / (BC / 8), c = e % (BC / 8) * 8;
      const bf16* src = j < p ? CVN + slot * SVN + ((long long)j * HV + hv) * DV + v0 + c : VN_ROW + row * DV + v0 + c;
      stage16(&s_vn[j][c], src, true, ALIGN16);
    }
    cp_async_commit();
    // the state's rows r0 + g, r0 + g + 8 at key columns nc * 8 + 2t (+1): the accumulators' layout
    const float* s_rd = STATE + read * S_STATE + ((long long)hv * DV + v0 + r0) * DK;
    float2 s[2][DK / 8];
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int nc = 0; nc < DK / 8; ++nc)
        s[h][nc] = read >= 0 ? load_f2(s_rd + (long long)(gq + 8 * h) * DK + nc * 8 + 2 * tq, ALIGN16)
                             : make_float2(0.f, 0.f);
    cp_async_wait_all();
    __syncthreads();
    // A = V'^T (value rows g, g + 8; chunk rows 2t.., 2t + 8..) from the staged V' rows (lane 8m + r: chunk
    // row 16 ks + 8 (m >> 1) + r, value columns r0 + 8 (m & 1))
    unsigned va[CH / 16][4];
#pragma unroll
    for (int ks = 0; ks < CH / 16; ++ks)
      ldsm_x4_trans(va[ks], &s_vn[ks * 16 + (lane >> 4) * 8 + (lane & 7)][r0 + ((lane >> 3) & 1) * 8]);
    float* s_wr = STATE + slot * S_STATE + ((long long)hv * DV + v0 + r0) * DK;
    bf16* d_wr = STATE_DT + slot * S_STATE_DT + ((long long)hv * DV + v0 + r0) * DK;
#pragma unroll
    for (int nc = 0; nc < DK / 8; ++nc) {  // key columns nc * 8 + 2 tq (+ 1)
      const int d = nc * 8 + gq;           // B's column
      const float2 s0 = s[0][nc], s1 = s[1][nc];  // `state_tile`
      float acc[4] = {__fmul_rn(s0.x, e_last), __fmul_rn(s0.y, e_last), __fmul_rn(s1.x, e_last),
                      __fmul_rn(s1.y, e_last)};
#pragma unroll
      for (int ks = 0; ks < CH / 16; ++ks)
        mma16816(acc, va[ks][0], va[ks][1], va[ks][2], va[ks][3], s_y[d][ks * 8 + tq], s_y[d][ks * 8 + 4 + tq]);
      const int c = nc * 8 + 2 * tq;
      store_f2(s_wr + (long long)gq * DK + c, acc[0], acc[1], ALIGN16);
      store_f2(s_wr + (long long)(gq + 8) * DK + c, acc[2], acc[3], ALIGN16);
      store_bf2(d_wr + (long long)gq * DK + c, f2bf2(acc[0], acc[1]), ALIGN16);
      store_bf2(d_wr + (long long)(gq + 8) * DK + c, f2bf2(acc[2], acc[3]), ALIGN16);
    }
    __syncthreads();  // every warp has read the tile's V' rows before the next tile's copies land
  }
}

// Program: block (sequences cseq g .. cseq g + cseq - 1, v head hv; cseq <= CSEQ, the launcher's choice), for
// each of those sequences whose row completes its chunk (HELD[n] = CH - 1; the others, padded requests and
// sequences past n_seqs are skipped, so a step where no chunk completes costs a few blocks that read HELD and
// SLOT) each warp WV value rows of a tile of BC, tile after tile. K, A: prepared k_hat [T, HK, DK] and g
// [T, HV]; STATE, CVN, CK, CG: the cache's state, vnew, k and g; VN_ROW: the row's V' (`decode_values`).
// S'^T = exp(G_last) S^T + V'^T y, y_j = dt(k_j exp(G_last - G_j)) (`state_after`, a product the chunk
// kernels run as a 64-row wgmma, whose elements have mma.sync's bits on the H200), by 16 x 8 output blocks
// over the warp's value rows and the 128 key columns; S from READ's slot (zeros where -1), S' and dt(S')
// (STATE_DT) to the sequence's slot.
extern "C" __global__ void __launch_bounds__(32 * CWARPS) decode_commit(
    const bf16* K, const float* A, float* STATE, bf16* STATE_DT, const bf16* CVN, const bf16* CK, const float* CG,
    int S_STATE, int S_STATE_DT, int SVN, int SK, int SG, const long long* START, const long long* HELD,
    const long long* SLOT, const long long* READ, const bf16* VN_ROW, int n_seqs, int stride_kt, int stride_kh, int stride_at, int HK,
    int HV, int DV, int RATIO, int VEC_K, int ALIGN16, int cseq) {
  __shared__ float s_g[CH], s_G[CH];
  __shared__ unsigned s_y[DK][CH / 2 + 4];      // y^T in bf16 pairs (rows j, j + 1), padded: no bank conflicts
  __shared__ __align__(16) bf16 s_vn[CH][CP];  // the chunk's V' rows at the tile's columns
  const int hv = (int)(blockIdx.x % HV), n0 = (int)(blockIdx.x / HV) * cseq;
  unsigned todo = 0;  // bit i: sequence n0 + i completes its chunk
  for (int i = 0; i < cseq; ++i) {
    const bool in = n0 + i < n_seqs;
    const long long slot = in ? SLOT[n0 + i] : -1, held = in ? HELD[n0 + i] : 0;
    todo |= (slot >= 0 && held == CH - 1 ? 1u : 0u) << i;
  }
  for (int i = 0; i < cseq; ++i)
    if (todo >> i & 1) commit_one(K, A, STATE, STATE_DT, CVN, CK, CG, S_STATE, S_STATE_DT, SVN, SK, SG, START, SLOT,
                                  READ, VN_ROW, n0 + i, hv, stride_kt, stride_kh, stride_at, HK, HV, DV, RATIO, VEC_K,
                                  ALIGN16, s_g, s_G, s_y, s_vn);
}
