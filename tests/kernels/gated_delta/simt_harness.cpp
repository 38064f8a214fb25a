// The decode step's CUDA kernels (kernels/gated_delta/incremental_decode.cu, its path in KERNEL_SOURCE) run
// on the CPU: each warp of the grid as 32 threads, one warp after another (simt_host.h). Built and called
// by test_decode_cuda.py through ctypes; the run_* functions take the kernels' arguments after the grid.
#include <functional>
#include <thread>
#include <vector>

#include "simt_host.h"
#include KERNEL_SOURCE

static void run_warps(int grid, const std::function<void()>& kernel) {
  for (int block = 0; block < grid; ++block)
    for (int warp = 0; warp < WARPS; ++warp) {
      std::barrier<> lanes(32);
      host_warp = &lanes;
      std::vector<std::thread> threads;
      for (int lane = 0; lane < 32; ++lane)
        threads.emplace_back([&, block, warp, lane] {
          threadIdx.x = warp * 32 + lane;
          blockIdx.x = block;
          kernel();
        });
      for (auto& t : threads) t.join();
    }
}

extern "C" void run_decode_weights(int grid, const bf16* Q, const bf16* K, const float* A, const float* B, bf16* CK,
                                   float* CG, float* CB, float* CT, int SK, int SG, int SB, int ST,
                                   const long long* START, const long long* HELD, const long long* SLOT, float* T_ROW,
                                   bf16* W_ROW, bf16* P_ROW, bf16* QG_ROW, int n_seqs, int stride_qt, int stride_qh,
                                   int stride_kt, int stride_kh, int stride_at, int stride_bt, int HK, int HV,
                                   int RATIO) {
  run_warps(grid, [&] {
    decode_weights(Q, K, A, B, CK, CG, CB, CT, SK, SG, SB, ST, START, HELD, SLOT, T_ROW, W_ROW, P_ROW, QG_ROW, n_seqs,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_at, stride_bt, HK, HV, RATIO);
  });
}

extern "C" void run_decode_values(int grid, const bf16* V, const bf16* K, const float* A, bf16* OUT, float* STATE,
                                  bf16* CX, bf16* CVN, const bf16* CK, const float* CG, int S_STATE, int SX, int SVN,
                                  int SK, int SG, const long long* START, const long long* HELD, const long long* SLOT,
                                  const long long* READ, const float* T_ROW, const bf16* W_ROW, const bf16* P_ROW,
                                  const bf16* QG_ROW, int n_seqs, int stride_vt, int stride_vh, int stride_kt,
                                  int stride_kh, int stride_at, int stride_ot, int stride_oh, int HK, int HV, int DV,
                                  int RATIO) {
  run_warps(grid, [&] {
    decode_values(V, K, A, OUT, STATE, CX, CVN, CK, CG, S_STATE, SX, SVN, SK, SG, START, HELD, SLOT, READ, T_ROW,
                  W_ROW, P_ROW, QG_ROW, n_seqs, stride_vt, stride_vh, stride_kt, stride_kh, stride_at, stride_ot,
                  stride_oh, HK, HV, DV, RATIO);
  });
}
