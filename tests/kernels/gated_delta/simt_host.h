// Compiles kernels/gated_delta/incremental_decode.cu for the CPU, to run its warps as 32 host threads each
// (simt_harness.cpp): CUDA's qualifiers and built-ins, the warp barrier, and stand-ins for the instructions
// the .cu file issues in asm (cvt.rn.bf16.f32 and .bf16x2, ex2.approx.f32, mma.sync m16n8k16, ldmatrix with
// and without .trans, cp.async: a copy at once, zeros where the source is not there). The
// stand-ins follow the PTX ISA's fragment layouts; they round to bf16 toward zero as the Triton interpreter
// does (the reference the test compares with), the MMA sums in fp32 and exp2f is not ex2.approx: outputs
// near the interpreter's, not the GPU's bits. What this checks is the indexing, the fragments and the
// algorithm. One block runs at a time, its warps' lanes as threads (a barrier a warp, one for the block).
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct HostDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local HostDim3 threadIdx, blockIdx;
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
inline unsigned host_bits(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __fmul_rn(float a, float b) { return a * b; }  // compiled with -ffp-contract=off
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }

inline thread_local std::barrier<>* host_warp = nullptr;  // the lane's warp (32 lanes)
inline std::barrier<>* host_block = nullptr;                // the running block's threads
inline void __syncwarp() { host_warp->arrive_and_wait(); }
inline void __syncthreads() { host_block->arrive_and_wait(); }

inline unsigned short f2bf(float x) {  // toward zero, as the Triton interpreter rounds (the GPU: to nearest even)
  return (unsigned short)(host_bits(x) >> 16);
}
inline unsigned f2bf2(float lo, float hi) { return (unsigned)f2bf(lo) | ((unsigned)f2bf(hi) << 16); }
inline float texp(float x) { return std::exp2(x * __int_as_float(0x3FB8AA3B)); }

struct HostMmaLane {
  unsigned a[4], b[2];
};
inline HostMmaLane host_mma[32][32];  // [warp][lane]

// D = A B + C for the warp's 16 x 8 x 16 bf16 tile, each lane holding its fragments as PTX lays them out:
// a0..a3 rows (g, g + 8) x columns (2t.., 2t + 8..), b0, b1 rows 2t.., 2t + 8.. of column g, c0..c3 rows
// (g, g, g + 8, g + 8) x columns (2t, 2t + 1); g = lane / 4, t = lane % 4.
inline void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  HostMmaLane* warp = host_mma[threadIdx.x >> 5];
  warp[lane] = {{a0, a1, a2, a3}, {b0, b1}};
  host_warp->arrive_and_wait();
  auto half = [](unsigned r, int k) { return __uint_as_float((k & 1 ? r >> 16 : r & 0xFFFFu) << 16); };
  auto A = [&](int r, int k) { return half(warp[(r & 7) * 4 + ((k & 7) >> 1)].a[(r >= 8) + 2 * (k >= 8)], k); };
  auto B = [&](int k, int n) { return half(warp[n * 4 + ((k & 7) >> 1)].b[k >= 8], k); };
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int r = g + (e >= 2 ? 8 : 0), n = 2 * t + (e & 1);
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc = std::fma(A(r, k), B(k, n), acc);
    out[e] = acc;
  }
  host_warp->arrive_and_wait();  // every lane has read the fragments before any lane's next MMA writes its own
  for (int e = 0; e < 4; ++e) c[e] = out[e];
}

inline void cp_async16(void* dst, const void* src, bool valid) {
  if (valid) std::memcpy(dst, src, 16);
  else std::memset(dst, 0, 16);
}
inline void cp_async4(void* dst, const void* src, bool valid) {
  if (valid) std::memcpy(dst, src, 4);
  else std::memset(dst, 0, 4);
}
inline void cp_async_commit() {}
inline void cp_async_wait_all() {}  // the copies are done; the block's barrier that follows orders them

inline const void* host_ldsm[32][32];  // [warp][lane]: the row addresses of ldmatrix

// ldmatrix.x4: lane 8m + r gives row r's address of 8 x 8 bf16 matrix m; lane (g = lane / 4, t = lane % 4) gets,
// of each matrix, with .trans rows 2t (low half) and 2t + 1 (high half) at column g, without it row g at columns
// 2t, 2t + 1
inline void host_ldsm_x4(unsigned* r, const void* row_addr, bool trans) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const void** warp = host_ldsm[threadIdx.x >> 5];
  warp[lane] = row_addr;
  host_warp->arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    auto at = [&](int row, int col) { return (unsigned)static_cast<const unsigned short*>(warp[8 * m + row])[col]; };
    r[m] = trans ? at(2 * t, g) | (at(2 * t + 1, g) << 16) : at(g, 2 * t) | (at(g, 2 * t + 1) << 16);
  }
  host_warp->arrive_and_wait();  // every lane has read before any lane's next ldmatrix posts its address
}
inline void ldsm_x4_trans(unsigned* r, const void* row_addr) { host_ldsm_x4(r, row_addr, true); }
inline void ldsm_x4(unsigned* r, const void* row_addr) { host_ldsm_x4(r, row_addr, false); }
