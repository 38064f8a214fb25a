// The decode step's CUDA kernels (kernels/gated_delta/incremental_decode.cu, its path in KERNEL_SOURCE) run
// on the CPU: each block of the grid as 32 threads a warp, one block after another (simt_host.h). Built and called
// by test_decode_cuda.py through ctypes; the run_* functions take the kernels' arguments after the grid.
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "simt_host.h"
#include KERNEL_SOURCE

static void run_blocks(int grid, int warps_a_block, const std::function<void()>& kernel) {
  for (int block = 0; block < grid; ++block) {
    std::barrier<> threads_of_block(32 * warps_a_block);
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    for (int warp = 0; warp < warps_a_block; ++warp) warps.emplace_back(std::make_unique<std::barrier<>>(32));
    host_block = &threads_of_block;
    std::vector<std::thread> threads;
    for (int t = 0; t < 32 * warps_a_block; ++t)
      threads.emplace_back([&, block, t] {
        threadIdx.x = t;
        blockIdx.x = block;
        host_warp = warps[t / 32].get();
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
                                   int RATIO, int ALIGN16, int VG) {
  run_blocks(grid, WWARPS, [&] {
    decode_weights(Q, K, A, B, CK, CG, CB, CT, SK, SG, SB, ST, START, HELD, SLOT, T_ROW, W_ROW, P_ROW, QG_ROW, n_seqs,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_at, stride_bt, HK, HV, RATIO, ALIGN16, VG);
  });
}

extern "C" void run_decode_values(int grid, const bf16* V, bf16* OUT, float* STATE, bf16* STATE_DT, bf16* CX,
                                  bf16* CVN, int S_STATE, int S_STATE_DT, int SX, int SVN, const long long* START,
                                  const long long* HELD, const long long* SLOT, const long long* READ, const float* T_ROW, const bf16* W_ROW,
                                  const bf16* P_ROW, const bf16* QG_ROW, bf16* VN_ROW, int n_seqs, int stride_vt,
                                  int stride_vh, int stride_ot, int stride_oh, int HV, int DV, int ALIGN16) {
  run_blocks(grid, VWARPS, [&] {
    decode_values(V, OUT, STATE, STATE_DT, CX, CVN, S_STATE, S_STATE_DT, SX, SVN, START, HELD, SLOT, READ, T_ROW,
                  W_ROW, P_ROW, QG_ROW, VN_ROW, n_seqs, stride_vt, stride_vh, stride_ot, stride_oh, HV, DV, ALIGN16);
  });
}

extern "C" void run_decode_commit(int grid, const bf16* K, const float* A, float* STATE, bf16* STATE_DT,
                                  const bf16* CVN, const bf16* CK, const float* CG, int S_STATE, int S_STATE_DT,
                                  int SVN, int SK, int SG,
                                  const long long* START, const long long* HELD, const long long* SLOT,
                                  const long long* READ, const bf16* VN_ROW, int n_seqs, int stride_kt, int stride_kh,
                                  int stride_at, int HK, int HV, int DV, int RATIO, int VEC_K, int ALIGN16,
                                  int cseq) {
  run_blocks(grid, CWARPS, [&] {
    decode_commit(K, A, STATE, STATE_DT, CVN, CK, CG, S_STATE, S_STATE_DT, SVN, SK, SG, START, HELD, SLOT, READ,
                  VN_ROW, n_seqs, stride_kt, stride_kh, stride_at, HK, HV, DV, RATIO, VEC_K, ALIGN16, cseq);
  });
}
