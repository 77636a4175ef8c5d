// The inter-chunk state pass of the chunked gated delta rule (step 7 of the spec, shared
// design note qwen3_5.md) as one dispatcher op with its own backward, so that the CUDA
// path runs the sequential chunk walk as one kernel each way instead of a few small
// launches per chunk (kernels/gdr_core/chunk_state.h).
//
// Inputs, per (batch, head) and chunk n of C rows (all one floating dtype, one device):
//   u      [B, H, N, C, dv]   U_n     = T Vb                (step 5)
//   w      [B, H, N, C, dk]   W_n     = T (Kb * exp(G))     (step 5)
//   qd     [B, H, N, C, dk]   Qd_n    = Q * exp(G)
//   p      [B, H, N, C, C]    P_n     = (Q K^T) * L, lower triangular (step 6)
//   kend   [B, H, N, C, dk]   Kend_n  = K * exp(G_last - G)
//   g_last [B, H, N]          Glast_n = G at the chunk's last row
//   initial_state [B, H, dk, dv] or absent (zeros)
// Forward, S_0 = initial state, n = 0 .. N-1:
//   V_n = U_n - W_n S_n;  O_n = Qd_n S_n + P_n V_n;  S_{n+1} = exp(Glast_n) S_n + Kend_n^T V_n
// Returns (o [B, H, N, C, dv], final_state S_N [B, H, dk, dv], states [B, H, N, dk, dv]
// (S_n, the state entering chunk n), v_new [B, H, N, C, dv] (V_n)), all contiguous in
// the inputs' dtype. states and v_new are what the backward needs; they are not
// differentiable outputs.
//
// Backward (hand-derived; tests check it against libtorch autograd of the plain loop in
// FP64). With g_N = grad of final_state (zeros when absent), n = N-1 .. 0:
//   dV_n = P_n^T dO_n + Kend_n g_{n+1}        dU_n = dV_n
//   dW_n = -dV_n S_n^T      dQd_n = dO_n S_n^T      dP_n = dO_n V_n^T (full, not masked)
//   dKend_n = V_n g_{n+1}^T      dGlast_n = exp(Glast_n) * sum(S_n .* g_{n+1})
//   g_n = exp(Glast_n) g_{n+1} + Qd_n^T dO_n - W_n^T dV_n;  d initial_state = g_0
//
// CPU: FP32 or FP64, an ATen loop over chunks (the reference). CUDA
// (ops/gdr_core/gdr_core_op_cuda.cc, linked through //ops:cuda_ops): FP32, C = 64, dk in {64, 128,
// 256}, dv a multiple of 16; runs on the current stream; deterministic by construction (no atomics,
// every sum in a fixed order: see Note [Chunk state scan determinism] in
// kernels/gdr_core/chunk_state_kernel.cuh and Note [Chunk GEMM determinism] in
// kernels/gdr_core/chunk_gemm.h for the batched products).
// Saving S_n from the forward instead of recomputing it costs B*H*N*dk*dv*4 bytes
// (32 MiB per layer at B=1, T=2048, H=16, dk=dv=128) and saves a whole sequential pass in
// the backward, the part of this op that cannot use the whole GPU.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <tuple>

#include "kernels/gdr_core/chunk_gemm.h"
#include "kernels/gdr_core/chunk_state.h"

namespace gdr {

// Autograd-aware entry point (dispatches to CPU or CUDA).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_state_pass(
    const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd, const at::Tensor& p,
    const at::Tensor& kend, const at::Tensor& g_last,
    const std::optional<at::Tensor>& initial_state);

// The backward alone (no autograd). grad_o / grad_final_state may be absent (zeros).
// Returns (du, dw, dqd, dp, dkend, dg_last, d_initial_state), contiguous, inputs' dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_state_pass_backward(const std::optional<at::Tensor>& grad_o,
                          const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                          const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                          const at::Tensor& g_last, const at::Tensor& states,
                          const at::Tensor& v_new);

// True when a CUDA implementation of the op is linked into this binary.
bool chunk_state_pass_has_cuda_kernel();

namespace chunk_state_internal {

// Argument checks shared by the CPU and CUDA implementations; messages name the
// argument and say what was expected and what was given.
void check_forward_inputs(const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd,
                          const at::Tensor& p, const at::Tensor& kend, const at::Tensor& g_last,
                          const std::optional<at::Tensor>& initial_state);
void check_backward_inputs(const std::optional<at::Tensor>& grad_o,
                           const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                           const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                           const at::Tensor& g_last, const at::Tensor& states,
                           const at::Tensor& v_new);

inline bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// The scan-based implementation the CUDA op runs, written device-agnostic so that CPU
// tests can run it with a host emulation of the kernels: `scan` must do what
// kernels::launch_chunk_state_scan does (on the CUDA op: launch it on the current stream
// and check the launch). Everything else is ATen or `gemm`: operand layouts, the
// carry-independent products before the backward scan (P^T dO, Qd^T dO) and the carry-free
// results after each scan (O; dW, dQd, dP, dKend) as batched matmuls over (b, h, n); dGlast
// is the sum of the backward scan's per-thread dot partials (one ATen sum, fixed order).
// The decay exp(g_last) is taken inside the kernel. FP32,
// C = kernels::kChunkStateChunk, kernels::chunk_state_scan_supports(dk, dv); refused
// otherwise with a message naming `op`.
using ScanLauncher = std::function<void(const kernels::ChunkStateScanArgs&)>;
// The batched products: when `gemm` is set, each product whose arguments
// kernels::chunk_gemm_supports accepts (every shape the scan supports: M in {64, dk}, N in
// {dv, dk, 64}, K in {dk, dv, 64}; the [B, H, N] chunks as one batch) goes to `gemm`, which
// must do what kernels::launch_chunk_gemm does (on the CUDA op: the 3xTF32 tensor-core GEMM
// on the current stream, unless the execution policy's chunk_gemm_tensor_cores is false); O
// is then one two-product GEMM. Products it does not accept (a batch over 2^31 - 1 blocks),
// and all of them when `gemm` is empty (the CPU tests, chunk_gemm_tensor_cores false), run
// as at::bmm / baddbmm_ (cuBLAS FP32 on CUDA). The results' dtypes, shapes and layouts are
// the same either way.
using ChunkGemmLauncher = std::function<void(const kernels::ChunkGemmArgs&)>;
// Note [State pass side stream]: in the backward, dQd = dO S^T and dP = dO V^T read only
// dO and the forward's S and V, not the reverse scan's carries, so they need not wait for
// the scan. The scan walks the chunks with one block per (b, h, 16 value columns), 128
// blocks at H = 16, dv = 128, each alone on its SM (190 KiB of shared memory at dk = 128
// with its two operand stages: no 68 KiB GEMM block fits beside it), bound by its
// per-chunk dependency chain. Beside it the two GEMMs get the SMs the scan leaves idle and
// then overlap dW, dKend and the dGlast sum: a small gain, the scan leaving little room
// (measured: docs/benchmarks.md, Decisions).
// A SideStream gives backward_via_scan that concurrency:
//   fork()     marks the current point of the caller's (current) stream;
//   run(work)  calls `work` with its launches ordered after that mark but concurrent with
//              whatever the caller launches after fork() (the CUDA op: a side stream that
//              waited for an event recorded at the mark);
//   join()     orders the caller's later launches after `work` (an event on the side
//              stream that the current stream waits for).
// The outputs `work` writes are allocated on the caller's stream before run(), and every
// input it reads stays referenced until join(), so the caching allocator never hands
// their memory to the caller's later launches while `work` may still touch it. The bits
// cannot change: each GEMM writes its own output with its own fixed order (Note [Chunk
// GEMM determinism]); only when they run changes. Without a SideStream (the execution
// policy's chunk_gemm_overlap false, or the cuBLAS products on CUDA) the two GEMMs run in
// line, after the scan. The CPU test passes one that fills the side GEMMs' outputs with NaN at
// run() and computes them at join(), so a read of dQd or dP before the join shows.
class SideStream {
 public:
  virtual ~SideStream() = default;
  virtual void fork() = 0;
  virtual void run(const std::function<void()>& work) = 0;
  virtual void join() = 0;
};
// backward_via_scan calls that ran their side work through a SideStream in this process
// (for tests and benchmarks: which path the op took; relaxed, process-wide).
int64_t backward_side_stream_runs();
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_via_scan(
    const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd, const at::Tensor& p,
    const at::Tensor& kend, const at::Tensor& g_last,
    const std::optional<at::Tensor>& initial_state, const ScanLauncher& scan,
    const ChunkGemmLauncher& gemm = {});
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
backward_via_scan(const std::optional<at::Tensor>& grad_o,
                  const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                  const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                  const at::Tensor& g_last, const at::Tensor& states, const at::Tensor& v_new,
                  const ScanLauncher& scan, const ChunkGemmLauncher& gemm = {},
                  SideStream* side = nullptr);

}  // namespace chunk_state_internal
}  // namespace gdr
