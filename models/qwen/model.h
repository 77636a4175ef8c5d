// The Qwen3.5 text model for causal-LM training: decoder layers (pre-norm residual),
// final norm, LM head (tied to the embedding or not), loss and reference init.
//
// Names: QwenForCausalLM's named_parameters() are Hugging Face's checkpoint names, e.g.
//   model.embed_tokens.weight, model.layers.0.linear_attn.in_proj_qkv.weight,
//   model.layers.3.self_attn.q_proj.weight, model.layers.0.mlp.gate_proj.weight,
//   model.norm.weight, and lm_head.weight only when tie_word_embeddings is false.
// (HF's multimodal Qwen3_5ForConditionalGeneration nests the same names under
// model.language_model.; converting is the checkpoint code's business.)
//
// Tied models run the lookup and the LM head as the pair of ops/tied_embedding/tied_embedding_op.h
// (W gets one gradient; the execution policy's tied_embedding composite:
// torch::nn::Embedding + matmul instead).
//
// Dtype/device generic: build in FP32 on CPU, init, then module.to(dtype / device).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <utility>

#include "models/qwen/config.h"
#include "models/qwen/document_bounds.h"
#include "models/qwen/layers.h"
#include "ops/tied_embedding/tied_embedding_op.h"

namespace gdr {

// h = h + mixer(input_layernorm(h)); h = h + mlp(post_attention_layernorm(h)).
// The mixer is `linear_attn` (GatedDeltaNet) or `self_attn` (GatedAttention) by
// config.layer_types[layer_index]; the other member stays null.
class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const QwenConfig& config, int64_t layer_index);
  // documents (may be null): handed to the mixer (Note [Document masking]).
  at::Tensor forward(const at::Tensor& hidden, const DocumentBounds* documents = nullptr);
  // The same layer with the residual stream's last add left to the caller: `pending` (may
  // be undefined) is the previous layer's un-added MLP output, added to `hidden` by this
  // layer's input norm; returns (h, mlp_out) with the layer's output h + mlp_out. The model
  // loop uses it so that every residual add happens inside a norm (Note [Residual add in
  // the norm] in model.cc).
  std::pair<at::Tensor, at::Tensor> forward_pending(const at::Tensor& hidden,
                                                    const at::Tensor& pending,
                                                    const DocumentBounds* documents = nullptr);

  ZeroCenteredRMSNorm input_layernorm{nullptr}, post_attention_layernorm{nullptr};
  GatedDeltaNet linear_attn{nullptr};
  GatedAttention self_attn{nullptr};
  Mlp mlp{nullptr};

 private:
  double rms_norm_eps_;
};
TORCH_MODULE(DecoderLayer);

// `model.`: embed_tokens, layers, norm. input_ids [B, T] int64 -> hidden [B, T, D].
class QwenModelImpl : public torch::nn::Module {
 public:
  explicit QwenModelImpl(const QwenConfig& config);
  // documents (may be null): B rows of T tokens, handed to every layer (Note [Document
  // masking]).
  at::Tensor forward(const at::Tensor& input_ids, const DocumentBounds* documents = nullptr);

  torch::nn::Embedding embed_tokens{nullptr};
  torch::nn::ModuleList layers{nullptr};
  ZeroCenteredRMSNorm norm{nullptr};

  // Set by QwenForCausalLM around one forward when the tied pair runs (Note [Tied embedding
  // gradient] in ops/tied_embedding/tied_embedding_op.cc): forward() then looks the ids up with
  // tied_embedding_lookup on embed_tokens->weight. Null: embed_tokens(input_ids).
  TiedEmbeddingStatePtr tied_embedding_state;

 private:
  double rms_norm_eps_;
};
TORCH_MODULE(QwenModel);

class QwenForCausalLMImpl : public torch::nn::Module {
 public:
  // Throws c10::Error when validate_qwen_config rejects `config`.
  explicit QwenForCausalLMImpl(const QwenConfig& config);

  // input_ids [B, T] int64 -> logits [B, T, vocab] in the parameters' dtype.
  at::Tensor forward(const at::Tensor& input_ids);
  // The same with packed documents kept apart (Note [Document masking] in
  // models/qwen/document_bounds.h): `documents` has B rows of T tokens. Rows that are each
  // one document give forward(input_ids)'s bits.
  at::Tensor forward(const at::Tensor& input_ids, const DocumentBounds& documents);
  // causal_lm_loss(forward(input_ids), labels).
  at::Tensor loss(const at::Tensor& input_ids, const at::Tensor& labels);
  // causal_lm_loss(forward(input_ids, documents), document_masked_labels(labels, documents)).
  at::Tensor loss(const at::Tensor& input_ids, const at::Tensor& labels,
                  const DocumentBounds& documents);

  const QwenConfig& config() const { return config_; }
  // Test hooks: switch every GDN layer's core / pre-GDR gate implementation.
  void set_gdr_core_algorithm(GdrCoreAlgorithm algorithm);
  void set_pre_gdr_fusion(PreGdrFusion fusion);

  QwenModel model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // null when tie_word_embeddings

 private:
  at::Tensor logits(const at::Tensor& input_ids, const DocumentBounds* documents);

  QwenConfig config_;
};
TORCH_MODULE(QwenForCausalLM);

// Mean next-token cross-entropy, computed in FP32. `labels` [B, T] are aligned with the
// input ids (HF convention, labels = input_ids for plain LM): the shift happens here,
// logits[:, t] is scored against labels[:, t + 1]. Labels equal to -100 are ignored and
// the mean is over the remaining tokens (NaN when none remain, as in PyTorch). CUDA
// logits take the fused op of ops/cross_entropy/cross_entropy_op.h (the execution policy's
// cross_entropy composite: the composite); on CUDA an out-of-range target is an error (one
// host read of the labels).
at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

constexpr int64_t kIgnoreIndex = -100;

// labels [B, T] (aligned with the input ids, as causal_lm_loss takes them) with every
// document start after a row's first position set to kIgnoreIndex: the targets that would
// have a document's last position predict the next document's first token (Note [Document
// masking]). `documents` has B rows of T tokens; labels itself when every row is one
// document.
at::Tensor document_masked_labels(const at::Tensor& labels, const DocumentBounds& documents);

// Reference init, reproducible from `seed` alone (values drawn on CPU in FP32 in
// named_parameters() order, then copied into each parameter's dtype and device):
//   linears, embedding: normal(0, initializer_range)
//   linear_attn.A_log: log(U(0.01, 16));  linear_attn.dt_bias: 1
//   linear_attn.conv1d.weight: U(-1/sqrt(K), 1/sqrt(K)), PyTorch's default Conv1d init
//     (kaiming_uniform with a = sqrt(5), fan_in = K for a depthwise filter), drawn from
//     the seed so it is reproducible too
//   zero-centred norms (input/post_attention_layernorm, q_norm, k_norm, model.norm): 0
//   linear_attn.norm.weight (gated norm): 1
void init_qwen_weights(QwenForCausalLMImpl& model, uint64_t seed);

}  // namespace gdr
