// CUDA implementation of the chunk state pass op (ops/gdr_chunk_state.h): the sequential
// chunk walk is one kernel launch each way (kernels/gdr_chunk_state.cu); everything that
// does not depend on the carry (O, P^T dO, Qd^T dO, dW, dQd, dP, dKend, dGlast) is a
// handful of batched cuBLAS / ATen calls over all (batch, head, chunk) at once. No atomics
// anywhere: the kernel's sums are per-thread in fixed order (Note [Chunk state scan
// determinism]) and the batched products and the dGlast sum are ATen's deterministic
// ops. Registered for the CUDA dispatch key; linked into CUDA binaries only.
#include <ATen/TensorOperators.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "kernels/gdr_chunk_state.h"
#include "ops/gdr_chunk_state.h"

namespace gdr {
namespace {

using chunk_state_internal::present;

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == cudaSuccess, "chunk_state_pass: ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

void check_kernel_shape(const char* op, const at::Tensor& reference, int64_t C, int64_t dk,
                        int64_t dv) {
  TORCH_CHECK(reference.scalar_type() == at::kFloat, op,
              ": the CUDA implementation expects Float inputs but got ", reference.scalar_type());
  TORCH_CHECK(C == kernels::kChunkStateChunk, op, ": the CUDA implementation expects chunks of ",
              kernels::kChunkStateChunk, " rows (C) but got C = ", C);
  TORCH_CHECK(kernels::chunk_state_scan_supports(dk, dv), op,
              ": the CUDA implementation expects dk in {64, 128, 256} and dv a multiple of ",
              kernels::kChunkStateTileDv, " but got dk = ", dk, ", dv = ", dv);
}

// A [B, H, N, C, d] tensor as a kernel operand (unit stride in d, b and h merged into one
// index). Views such as narrow() slices of the solve's [U | W] output need no copy; other
// layouts are made contiguous into `holder`, which must outlive the launch.
kernels::ChunkOperand chunk_operand(const at::Tensor& t, at::Tensor& holder) {
  const int64_t B = t.size(0), H = t.size(1);
  const bool merge = B == 1 || H == 1 || t.stride(0) == H * t.stride(1);
  holder = (t.stride(4) == 1 && merge) ? t : t.contiguous();
  const int64_t stride_bh = holder.size(1) == 1 ? holder.stride(0) : holder.stride(1);
  return {holder.data_ptr<float>(), stride_bh, holder.stride(2), holder.stride(3)};
}

// [B, H, N, r, c] -> [B*H*N, r, c] for batched matmuls.
at::Tensor batched(const at::Tensor& t) { return t.reshape({-1, t.size(-2), t.size(-1)}); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_state_forward_cuda(
    const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd, const at::Tensor& p,
    const at::Tensor& kend, const at::Tensor& g_last,
    const std::optional<at::Tensor>& initial_state) {
  chunk_state_internal::check_forward_inputs(u, w, qd, p, kend, g_last, initial_state);
  const int64_t B = u.size(0), H = u.size(1), N = u.size(2), C = u.size(3), dv = u.size(4);
  const int64_t dk = w.size(4);
  check_kernel_shape("chunk_state_pass", u, C, dk, dv);
  const c10::cuda::CUDAGuard device_guard(u.device());
  const auto options = u.options();

  const at::Tensor decay = g_last.exp().contiguous();
  const at::Tensor initial = present(initial_state) ? initial_state->contiguous() : at::Tensor();
  at::Tensor states = at::empty({B, H, N, dk, dv}, options);
  at::Tensor v_new = at::empty({B, H, N, C, dv}, options);
  at::Tensor final_state = at::empty({B, H, dk, dv}, options);
  at::Tensor u_holder, w_holder, kend_holder;

  // V_n = U_n - W_n S_n;  S_{n+1} = exp(Glast_n) S_n + Kend_n^T V_n.
  kernels::ChunkStateScanArgs args;
  args.batch_heads = B * H;
  args.chunks = N;
  args.dk = static_cast<int>(dk);
  args.dv = static_cast<int>(dv);
  args.reverse = false;
  args.base = chunk_operand(u, u_holder);
  args.left = chunk_operand(w, w_holder);
  args.left_sign = -1.0f;
  args.right = chunk_operand(kend, kend_holder);
  args.right_sign = 1.0f;
  args.decay = decay.data_ptr<float>();
  args.carry_in = initial.defined() ? initial.data_ptr<float>() : nullptr;
  args.rows_out = v_new.data_ptr<float>();
  args.carries_out = states.data_ptr<float>();
  args.carry_final = final_state.data_ptr<float>();
  check_launch(kernels::launch_chunk_state_scan(args, c10::cuda::getCurrentCUDAStream().stream()),
               "forward scan");

  // O_n = Qd_n S_n + P_n V_n for every chunk at once.
  at::Tensor o = at::bmm(batched(qd), batched(states));
  o.baddbmm_(batched(p), batched(v_new));
  return {o.view({B, H, N, C, dv}), final_state, states, v_new};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_state_backward_cuda(const std::optional<at::Tensor>& grad_o,
                          const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                          const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                          const at::Tensor& g_last, const at::Tensor& states,
                          const at::Tensor& v_new) {
  chunk_state_internal::check_backward_inputs(grad_o, grad_final_state, w, qd, p, kend, g_last,
                                              states, v_new);
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), C = w.size(3), dk = w.size(4);
  const int64_t dv = v_new.size(4);
  check_kernel_shape("chunk_state_pass_backward", w, C, dk, dv);
  const c10::cuda::CUDAGuard device_guard(w.device());
  const auto options = w.options();

  const at::Tensor dO = present(grad_o) ? *grad_o : at::zeros({B, H, N, C, dv}, options);
  const at::Tensor dO3 = batched(dO);
  // The carry-independent parts of dV_n (P_n^T dO_n) and of g_n (Qd_n^T dO_n), all chunks
  // at once, so the sequential walk only does the two carry products.
  const at::Tensor pt_do = at::bmm(batched(p).transpose(1, 2), dO3).view({B, H, N, C, dv});
  const at::Tensor qt_do = at::bmm(batched(qd).transpose(1, 2), dO3);  // [BHN, dk, dv]
  const at::Tensor decay = g_last.exp().contiguous();
  const at::Tensor grad_final =
      present(grad_final_state) ? grad_final_state->contiguous() : at::Tensor();
  at::Tensor carries = at::empty({B, H, N, dk, dv}, options);  // g_{n+1}, entering chunk n
  at::Tensor du = at::empty({B, H, N, C, dv}, options);
  at::Tensor d_initial = at::empty({B, H, dk, dv}, options);
  at::Tensor base_holder, kend_holder, w_holder;

  // dV_n = P_n^T dO_n + Kend_n g_{n+1};  g_n = a_n g_{n+1} + Qd_n^T dO_n - W_n^T dV_n.
  kernels::ChunkStateScanArgs args;
  args.batch_heads = B * H;
  args.chunks = N;
  args.dk = static_cast<int>(dk);
  args.dv = static_cast<int>(dv);
  args.reverse = true;
  args.base = chunk_operand(pt_do, base_holder);
  args.left = chunk_operand(kend, kend_holder);
  args.left_sign = 1.0f;
  args.right = chunk_operand(w, w_holder);
  args.right_sign = -1.0f;
  args.extra = qt_do.data_ptr<float>();
  args.decay = decay.data_ptr<float>();
  args.carry_in = grad_final.defined() ? grad_final.data_ptr<float>() : nullptr;
  args.rows_out = du.data_ptr<float>();
  args.carries_out = carries.data_ptr<float>();
  args.carry_final = d_initial.data_ptr<float>();
  check_launch(kernels::launch_chunk_state_scan(args, c10::cuda::getCurrentCUDAStream().stream()),
               "backward scan");

  const at::Tensor S3 = batched(states), G3 = batched(carries), V3 = batched(v_new);
  at::Tensor dw = at::bmm(batched(du), S3.transpose(1, 2)).neg_().view({B, H, N, C, dk});
  at::Tensor dqd = at::bmm(dO3, S3.transpose(1, 2)).view({B, H, N, C, dk});
  at::Tensor dp = at::bmm(dO3, V3.transpose(1, 2)).view({B, H, N, C, C});
  at::Tensor dkend = at::bmm(V3, G3.transpose(1, 2)).view({B, H, N, C, dk});
  at::Tensor dg_last = decay * (states * carries).sum({-2, -1});
  return {du, dw, dqd, dp, dkend, dg_last, d_initial};
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("chunk_state_pass", &chunk_state_forward_cuda);
  m.impl("chunk_state_pass_backward", &chunk_state_backward_cuda);
}

}  // namespace gdr
