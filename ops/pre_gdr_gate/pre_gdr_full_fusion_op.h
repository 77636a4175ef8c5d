// Full pre-GDR fusion op: the Gated DeltaNet's path from its projection outputs to the GDR
// core inputs as one CUDA op with its own backward (kernels:
// kernels/pre_gdr_gate/pre_gdr_full_fusion.h; spec: shared design note pre_gdr_gate.md, "What full
// pre-GDR fusion covers").
//
//   qkv [B, T, C] (C = 2*Hk*dk + Hv*dv), conv_weight [C, 1, 4], a / b [B, T, Hv],
//   A_log / dt_bias [Hv]  ->  q, k [B, T, Hv, dk], v [B, T, Hv, dv], g, beta [B, T, Hv]
//
// q/k/v: causal depthwise conv1d (kernel 4, no bias, left pad 3) + SiLU, split, q and k
// L2-normalised (eps 1e-6) and repeated onto the Hv / Hk value heads of their key head; all
// FP32 and contiguous. The conv and SiLU outputs are rounded to the activation dtype where
// the unfused composition stores them, so the two agree to FP32 summation order.
// g/beta: the pre-GDR gate (ops/pre_gdr_gate/pre_gdr_gate_op.h), FP32.
// dtypes: qkv and conv_weight FP32, FP16 or BF16 (the same); a/b/A_log/dt_bias as the gate
// op takes them on CUDA (not Double). qkv may have any batch / token strides (its channel stride is
// made 1).
//
// Backward (autograd or pre_gdr_full_fusion_backward): grad_qkv in qkv's dtype
// (contiguous), grad_conv_weight in conv_weight's dtype (FP32 accumulation), the gate's
// four gradients as the gate op gives them. It recomputes the conv/SiLU/norms from qkv;
// autograd saves only the inputs.
//
// CUDA only: on CPU the op fails with an error saying so (the plain C++ reference of the
// math is gdr::kernels::pre_gdr_full_fusion_{forward,backward}_reference). Work runs on the
// current CUDA stream, scratch from the caching allocator. Not deterministic: the
// conv-weight gradient is summed with atomicAdd, so the op refuses use_deterministic_mode()
// whenever a backward may run (forward with grad needed, or backward); the model config
// rejects deterministic_mode with pre_gdr_fusion: full for the same reason.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace gdr {

// Head counts and dims of a Gated DeltaNet layer (HF: linear_num_key_heads,
// linear_num_value_heads, linear_key_head_dim, linear_value_head_dim).
struct GdnHeads {
  int64_t num_k_heads = 0;  // Hk
  int64_t num_v_heads = 0;  // Hv, a multiple of Hk
  int64_t head_k_dim = 0;   // dk
  int64_t head_v_dim = 0;   // dv
  int64_t conv_dim() const { return 2 * num_k_heads * head_k_dim + num_v_heads * head_v_dim; }
};

// The GDR core's inputs.
struct GdrInputs {
  at::Tensor q, k, v, g, beta;
};

// Autograd-aware entry point (CUDA; CPU fails, see above).
GdrInputs pre_gdr_full_fusion(const at::Tensor& qkv, const at::Tensor& conv_weight,
                              const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                              const at::Tensor& dt_bias, const GdnHeads& heads);

struct PreGdrFullFusionGrads {
  at::Tensor qkv, conv_weight, a, b, A_log, dt_bias;
};

// The backward op alone (no autograd).
PreGdrFullFusionGrads pre_gdr_full_fusion_backward(
    const at::Tensor& grad_q, const at::Tensor& grad_k, const at::Tensor& grad_v,
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& qkv,
    const at::Tensor& conv_weight, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& A_log, const at::Tensor& dt_bias, const GdnHeads& heads);

// The unfused ATen composition of the same path (autograd through ATen ops), op for op
// what models/qwen/layers.cc GatedDeltaNetImpl::forward runs for pre_gdr_fusion none
// (fused_gate false) and gate (true) with the policy's causal_conv = aten, followed by the
// L2 norm and head repeat the model leaves to the core (gdr::chunk_prep_qk; by default the
// model runs the conv + SiLU as ops/causal_conv1d/causal_conv1d_op.h's kernel: the same
// roundings, its own FP32 tap order). NOTE: keep the two in sync. Any device; FP64 inputs
// stay FP64. The reference of the tests and the benchmark.
GdrInputs pre_gdr_full_fusion_composite(const at::Tensor& qkv, const at::Tensor& conv_weight,
                                        const at::Tensor& a, const at::Tensor& b,
                                        const at::Tensor& A_log, const at::Tensor& dt_bias,
                                        const GdnHeads& heads, bool fused_gate);

// Argument checks at the op boundary (both directions, any device); messages name the
// argument, the expected and the actual value.
void check_pre_gdr_full_fusion_inputs(const at::Tensor& qkv, const at::Tensor& conv_weight,
                                      const at::Tensor& a, const at::Tensor& b,
                                      const at::Tensor& A_log, const at::Tensor& dt_bias,
                                      const GdnHeads& heads);

// The upstream gradients of the backward op: FP32, the shapes of q, k, v, g, beta.
void check_pre_gdr_full_fusion_backward_grads(const at::Tensor& grad_q, const at::Tensor& grad_k,
                                              const at::Tensor& grad_v, const at::Tensor& grad_g,
                                              const at::Tensor& grad_beta, const at::Tensor& qkv,
                                              const GdnHeads& heads);

// Throws when use_deterministic_mode() is on (the conv-weight gradient has no ordered
// reduction); `when` names the call site in the message.
void check_pre_gdr_full_fusion_not_deterministic(const char* when);

}  // namespace gdr
