// The building blocks of a Qwen3.5 decoder layer (spec: shared design note qwen3_5.md):
// the two RMSNorm flavours, the Gated DeltaNet mixer, the gated full-attention mixer and
// the SwiGLU MLP. Submodule and parameter names are Hugging Face's, so named_parameters()
// of the model gives checkpoint names.
//
// Activations are [B, T, D] in the parameters' dtype (FP32 or BF16; FP64 on the CPU for
// tests) on any device; norms, gates, the GDR core, RoPE and the causal-conv output feed
// FP32 math as the spec asks (FP64 math for an FP64 model: every op on the CPU path takes
// Double and computes in FP64, tests/models/hf_parity_test.cc checks it against
// transformers), and each module returns its input's dtype. All modules are
// autograd-differentiable through ATen ops and gdr ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "models/qwen/config.h"
#include "models/qwen/document_bounds.h"

namespace gdr {

// Zero-centred RMSNorm over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + w), FP32 math
// (FP64 for Double), result in x's dtype. On CUDA (FP32/FP16/BF16) the fused op unless the
// execution policy says rms_norm composite; otherwise the composition
// (ops/rms_norm/rms_norm_op.h: zero_centered_rms_norm_composite, the reference).
at::Tensor zero_centered_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// (zero_centered_rms_norm(x + residual), x + residual) for the pre-norm residual stream:
// where that norm takes the fused op and the policy's add_rms_norm says fused (the default), the
// add happens inside the norm's kernels (ops/rms_norm/rms_norm_op.h:
// add_zero_centered_rms_norm_fused, the same bits); otherwise ATen's add, then the norm.
std::pair<at::Tensor, at::Tensor> add_zero_centered_rms_norm(const at::Tensor& x,
                                                             const at::Tensor& residual,
                                                             const at::Tensor& weight, double eps);

// Gated RMSNorm of the GDN output, over the last dim:
// (o * rsqrt(mean(o^2) + eps)) * w * silu(z), FP32 math (FP64 for Double), result in
// `out_dtype`.
// o, z: [..., dv]; weight: [dv]. Dispatch as for zero_centered_rms_norm (reference:
// gated_rms_norm_composite in ops/rms_norm/rms_norm_op.h).
at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight,
                          double eps, at::ScalarType out_dtype);

// The GDN's causal depthwise conv1d + SiLU over its qkv projection: x [B, T, C], weight
// [C, 1, K] -> [B, T, C] in x's dtype. On CUDA (FP32/FP16/BF16, K in [2, 4]) the fused op
// (ops/causal_conv1d/causal_conv1d_op.h: causal_conv1d_silu, contiguous result) unless the
// execution policy says causal_conv aten; otherwise the composition
// (causal_conv1d_silu_composite, the reference; a transposed view).
at::Tensor gdn_causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight);

// The same conv with the state reset at every document start (Note [Document masking] in
// models/qwen/document_bounds.h): x [B, T, C] with `documents` of B rows of T tokens; the
// same choice of implementation per document (ops/causal_conv1d/causal_conv1d_op.h:
// causal_conv1d_silu_varlen). Returns [B, T, C] contiguous.
at::Tensor gdn_causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight,
                                  const DocumentBounds& documents);

// x [..., sum(sizes)] split along the last dim into views of `sizes` (as
// at::split_with_sizes), differentiable. The backward returns the pieces' gradients as one
// tensor without a copy when they already are the consecutive column slices of one
// buffer of x's shape (the GDN core writes dq, dk, dv so: Note [Gradients in the inputs'
// layout] in ops/gdr_core/chunk_prep_op.cc), else concatenates them (zeros for a piece without a
// gradient). The same values either way.
std::vector<at::Tensor> split_last_dim(const at::Tensor& x, const std::vector<int64_t>& sizes);

// Rotate-half RoPE on the first `rotary_dim` channels of x: [B, H, T, hd], positions
// 0..T-1, inv_freq = theta^(-2i/rotary_dim). Math in FP32 (FP64 for Double), result in
// x's dtype. The fused op on CUDA unless the execution policy says rope composite, else the
// ATen composite (ops/rope/rope_op.h).
at::Tensor apply_partial_rope(const at::Tensor& x, int64_t rotary_dim, double theta);

// Zero-centred RMSNorm module; parameter `weight` [dim], initialised to 0.
class ZeroCenteredRMSNormImpl : public torch::nn::Module {
 public:
  ZeroCenteredRMSNormImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(ZeroCenteredRMSNorm);

// Gated RMSNorm module of the GDN mixer; parameter `weight` [dv], initialised to 1.
class RMSNormGatedImpl : public torch::nn::Module {
 public:
  RMSNormGatedImpl(int64_t dim, double eps);
  at::Tensor forward(const at::Tensor& o, const at::Tensor& z);
  at::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNormGated);

// Which GDR implementation the mixer calls. kDispatch (the default) is gdr::gated_delta_rule;
// the others let tests compare the chunked and recurrent forms inside the model.
enum class GdrCoreAlgorithm { kDispatch, kChunked, kRecurrent };

// Gated DeltaNet mixer (`linear_attn`). Parameters: in_proj_qkv [2*Hk*dk + Hv*dv, D],
// in_proj_z [Hv*dv, D], in_proj_b / in_proj_a [Hv, D], conv1d.weight [conv_dim, 1, K],
// dt_bias [Hv], A_log [Hv], norm.weight [dv], out_proj [D, Hv*dv]. No biases.
// pre_gdr_fusion: none = causal conv + SiLU (gdn_causal_conv1d_silu) and the gate as ATen
// ops, then the core with the raw q / k heads and GdrQkNorm::kL2 (the core L2-normalises q
// and k and maps value heads to key heads: fused into the prep kernel on CUDA); gate = the
// same with the fused gate op; full = one fused CUDA op from the projections to the core
// inputs, q / k already normalised and repeated (gdr::pre_gdr_full_fusion; forward on a
// CPU tensor fails saying it needs CUDA).
//
// With `documents` (Note [Document masking]) whose rows are not all single documents, the
// conv (state reset), the core (zero state at every start: gated_delta_rule_varlen over the
// batch flattened to one sequence) and, with full fusion, the fused op run per document; the
// core algorithm must then be kDispatch.
class GatedDeltaNetImpl : public torch::nn::Module {
 public:
  explicit GatedDeltaNetImpl(const QwenConfig& config);
  // [B, T, D] -> [B, T, D]; documents: B rows of T tokens, or null.
  at::Tensor forward(const at::Tensor& x, const DocumentBounds* documents = nullptr);

  void set_core_algorithm(GdrCoreAlgorithm algorithm) { core_algorithm_ = algorithm; }
  void set_pre_gdr_fusion(PreGdrFusion fusion);

  torch::nn::Linear in_proj_qkv{nullptr}, in_proj_z{nullptr}, in_proj_b{nullptr},
      in_proj_a{nullptr}, out_proj{nullptr};
  torch::nn::Conv1d conv1d{nullptr};
  at::Tensor dt_bias, A_log;
  RMSNormGated norm{nullptr};

 private:
  int64_t num_k_heads_, num_v_heads_, k_head_dim_, v_head_dim_, kernel_size_;
  PreGdrFusion fusion_;
  GdrCoreAlgorithm core_algorithm_ = GdrCoreAlgorithm::kDispatch;
};
TORCH_MODULE(GatedDeltaNet);

// Gated full attention (`self_attn`): q_proj [2*H*hd, D] (per head: hd query then hd
// gate), k_proj / v_proj [Hkv*hd, D], o_proj [D, H*hd], q_norm / k_norm zero-centred over
// hd, partial RoPE, causal GQA softmax attention with scale hd^-1/2, out * sigmoid(gate).
// With `documents` (Note [Document masking]) whose rows are not all single documents, RoPE
// positions restart at every document start and attention is per document
// (partial_rope_varlen, causal_attention_varlen over the batch flattened to one sequence).
class GatedAttentionImpl : public torch::nn::Module {
 public:
  explicit GatedAttentionImpl(const QwenConfig& config);
  // [B, T, D] -> [B, T, D]; documents: B rows of T tokens, or null.
  at::Tensor forward(const at::Tensor& x, const DocumentBounds* documents = nullptr);

  torch::nn::Linear q_proj{nullptr}, k_proj{nullptr}, v_proj{nullptr}, o_proj{nullptr};
  ZeroCenteredRMSNorm q_norm{nullptr}, k_norm{nullptr};

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_, rotary_dim_;
  double rope_theta_;
};
TORCH_MODULE(GatedAttention);

// SwiGLU MLP: down_proj(silu(gate_proj(x)) * up_proj(x)), no biases.
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const QwenConfig& config);
  at::Tensor forward(const at::Tensor& x);

  torch::nn::Linear gate_proj{nullptr}, up_proj{nullptr}, down_proj{nullptr};
};
TORCH_MODULE(Mlp);

}  // namespace gdr
