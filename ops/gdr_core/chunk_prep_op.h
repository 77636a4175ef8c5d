// The per-chunk preparation of the chunked gated delta rule (steps 1-6 of the spec, shared
// design note qwen3_5.md) as one dispatcher op with its own backward, so that the CUDA path
// runs it as one kernel each way (kernels/gdr_core/chunk_prep.h) instead of ~40 ATen launches
// of transposes, pads, casts, masks, products and a cuBLAS triangular solve (and their
// autograd backwards).
//
// Inputs (one device): q, k [B, T, Hk, dk] (one floating dtype), v [B, T, H, dv] (any
// floating dtype) with H a multiple of Hk, g, beta [B, T, H] (Float or Double); scale (q's
// multiplier); chunk_size C; l2_normalize_qk. Value head h uses key head h / (H / Hk) of q
// and k (repeat_interleave's mapping), and with l2_normalize_qk every row of q and k is
// first L2-normalised: chunk_prep_qk below is the definition (the steps see its q and k).
// Outputs, in the compute dtype (Double when any input is Double, else Float), contiguous,
// N = ceil(T / C), tail rows of the last chunk zero-padded (g = beta = q = k = v = 0):
//   u [B, H, N, C, dv], w [B, H, N, C, dk], qd [B, H, N, C, dk], p [B, H, N, C, C],
//   kend [B, H, N, C, dk], g_last [B, H, N]
// exactly the operands of chunk_state_pass (ops/gdr_core/chunk_state_op.h). Per chunk:
//   Q = scale q;  G = cumsum(g);  L_ij = exp(G_i - G_j) (i >= j, else 0)
//   M = strict_lower(beta_i (K K^T)_ij L_ij);  A = I + M;  X = [U | W] = A^-1 R,
//   R = [beta V | beta K exp(G)];  P = (Q K^T) .* L;  Qd = Q exp(G);
//   Kend = K exp(G_last - G);  G_last = G_{C-1}
//
// Note [Chunk prep backward]
// Hand-derived; the CPU tests check it against libtorch autograd of the ATen steps 1-6 in
// FP64. Given dU, dW, dQd, dP, dKend, dGlast (absent = zeros), per chunk:
//   dR = A^-T [dU | dW]                    (back substitution, A^T unit upper triangular)
//   dM = -(dR X^T) strictly below the diagonal (A's diagonal is constant)
//   dV = beta dR_u;  dbeta_i = <V_i, dRu_i> + exp(G_i) <K_i, dRw_i> + sum_j dM_ij (KK^T L)_ij
//   dKK = dM_ij beta_i L_ij;  dQK = dP .* L
//   dK = (dKK + dKK^T) K + dQK^T Q + beta exp(G) dR_w + exp(G_last - G) dKend
//   dQ = dQK K + exp(G) dQd;  dq = scale dQ
//   E_ij = L_ij dL_ij for i > j, dL = beta_i dM (K K^T) + dP (Q K^T)  (the diagonal cancels)
//   F_i = exp(G_last - G_i) <dKend_i, K_i>
//   dG_i = beta_i exp(G_i) <K_i, dRw_i> + exp(G_i) <dQd_i, Q_i> - F_i + sum_j E_ij - sum_j E_ji
//   dG_{C-1} += dGlast + sum_i F_i;  dg = reverse cumsum of dG within the chunk.
// Gradients of padded rows are dropped (their dG still reaches the real rows' dg). dq, dk
// above are those of chunk_prep_qk's rows; they then go back through it: the value heads
// of each key head summed, and with the L2 norm, per row, xn = x r, r = (|x|^2 + eps)^-1/2:
//   dx = r (dxn - xn <xn, dxn>).
//
// CPU: any C, plain loops in the compute dtype (the reference), chunk_prep_qk's q and k
// and its backward in ATen. CUDA (ops/gdr_core/gdr_core_op_cuda.cc, linked through //ops:cuda_ops):
// q, k and v each Float or BFloat16 (Half is cast to Float first; Float q, k with BFloat16
// v cast v to Float), g, beta Float, C = 64, kernels::chunk_prep_supports(dk, dv); the L2
// norm and the head mapping run inside the kernels (Note [Fused q/k L2 norm]), so the
// normalised, repeated q and k never exist in memory; inputs are read in place in their
// own layout (any batch / token / head strides, unit stride in the head dim; otherwise one
// contiguous() copy) and the tail chunk past T is zero-filled inside the kernels, not by
// padded copies; Float outputs; the current stream; deterministic by construction (Note
// [Chunk prep determinism] in kernels/gdr_core/chunk_prep_kernel.cuh). Gradients come back
// contiguous in the inputs' dtypes and shapes, dq / dk / dv written by the kernel directly
// in BF16 for BF16 inputs (no cast pass) when H = Hk; when H > Hk the kernel writes FP32
// dq / dk partials per value head, summed in a fixed order here (Note [Head group
// gradient sum] in ops/gdr_core/chunk_prep_op.cc).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <tuple>

#include "kernels/gdr_core/chunk_prep.h"

namespace gdr {

// eps of the L2 norm of q and k (the model's; HF's use_qk_l2norm_in_kernel).
constexpr double kQkL2NormEps = 1e-6;

// q and k as steps 1-6 use them, in ATen (autograd differentiates it): in `dtype`,
// [B, T, value_heads, dk], key head j repeated for value heads j * G .. j * G + G - 1
// (G = value_heads / Hk, repeat_interleave), and with l2_normalize every row x replaced
// by x * rsqrt(sum(x^2) + kQkL2NormEps), computed in `dtype` before the repeat. The one
// definition of the fused L2 norm: the composite core and the CPU op run it, the CUDA
// kernels reproduce it (to FP32 rounding). Returns q and k unchanged but for the cast when
// l2_normalize is false and value_heads equals Hk.
std::tuple<at::Tensor, at::Tensor> chunk_prep_qk(const at::Tensor& q, const at::Tensor& k,
                                                 int64_t value_heads, bool l2_normalize,
                                                 at::ScalarType dtype);

// Autograd-aware entry point (dispatches to CPU or CUDA). Returns
// (u, w, qd, p, kend, g_last).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_prep(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, int64_t chunk_size, bool l2_normalize_qk = false);

// The backward alone (no autograd): u and w are the forward's outputs. Returns
// (dq, dk, dv, dg, dbeta) in the dtypes and shapes of q, k, v, g, beta.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_prep_backward(
    const std::optional<at::Tensor>& grad_u, const std::optional<at::Tensor>& grad_w,
    const std::optional<at::Tensor>& grad_qd, const std::optional<at::Tensor>& grad_p,
    const std::optional<at::Tensor>& grad_kend, const std::optional<at::Tensor>& grad_g_last,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& u, const at::Tensor& w, double scale,
    int64_t chunk_size, bool l2_normalize_qk = false);

// True when a CUDA implementation of the op is linked into this binary.
bool chunk_prep_has_cuda_kernel();

namespace chunk_prep_internal {

// The kernel-based implementation the CUDA op runs, device-agnostic so that CPU tests can
// run it with a host emulation of the kernels: a launcher must do what
// kernels::launch_chunk_prep_forward / _backward do. Checks the kernel's constraints
// (dtypes, C = 64, supported dk / dv) with messages naming `chunk_prep`.
using ForwardLauncher = std::function<void(const kernels::ChunkPrepForwardArgs&)>;
using BackwardLauncher = std::function<void(const kernels::ChunkPrepBackwardArgs&)>;
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
forward_via_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta, double scale, int64_t chunk_size,
                   bool l2_normalize_qk, const ForwardLauncher& launch);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_via_kernel(
    const std::optional<at::Tensor>& grad_u, const std::optional<at::Tensor>& grad_w,
    const std::optional<at::Tensor>& grad_qd, const std::optional<at::Tensor>& grad_p,
    const std::optional<at::Tensor>& grad_kend, const std::optional<at::Tensor>& grad_g_last,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& u, const at::Tensor& w, double scale,
    int64_t chunk_size, bool l2_normalize_qk, const BackwardLauncher& launch);

}  // namespace chunk_prep_internal
}  // namespace gdr
