#include "models/qwen/model.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "ops/attention/attention_op.h"
#include "ops/cross_entropy/cross_entropy_op.h"
#include "ops/gdr_core/gdr_core_op.h"
#include "ops/policy/execution_policy.h"
#include "ops/recompute/recompute_op.h"

namespace gdr {

// Note [Residual add in the norm]: the pre-norm residual stream h + f(h) followed by the
// next norm is one op (add_zero_centered_rms_norm in layers.h): with the fused norm, the
// forward's add runs inside the norm kernel and the backward's add of the sum's two
// gradients inside or right after the norm's backward kernel, instead of separate ATen
// adds; the same bits (the GPU tests compare the model's loss and gradients with
// the policy's add_rms_norm composite bit for bit). The decoder loop hands each layer's MLP output
// to the next layer's input norm un-added (DecoderLayerImpl::forward_pending).

DecoderLayerImpl::DecoderLayerImpl(const QwenConfig& c, int64_t layer_index)
    : rms_norm_eps_(c.rms_norm_eps) {
  input_layernorm =
      register_module("input_layernorm", ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps));
  if (c.is_full_attention(layer_index)) {
    self_attn = register_module("self_attn", GatedAttention(c));
  } else {
    linear_attn = register_module("linear_attn", GatedDeltaNet(c));
  }
  post_attention_layernorm = register_module("post_attention_layernorm",
                                             ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps));
  mlp = register_module("mlp", Mlp(c));
}

at::Tensor DecoderLayerImpl::forward(const at::Tensor& hidden, const DocumentBounds* documents) {
  auto [h, mlp_out] = forward_pending(hidden, at::Tensor(), documents);
  return h + mlp_out;
}

std::pair<at::Tensor, at::Tensor> DecoderLayerImpl::forward_pending(
    const at::Tensor& hidden, const at::Tensor& pending, const DocumentBounds* documents) {
  at::Tensor normed, h;
  if (pending.defined()) {
    std::tie(normed, h) =
        add_zero_centered_rms_norm(hidden, pending, input_layernorm->weight, rms_norm_eps_);
  } else {
    normed = input_layernorm(hidden);
    h = hidden;
  }
  at::Tensor mixed;
  if (current_execution_policy().recompute == Recompute::kAttention) {
    // Note [Recomputation] in ops/recompute/recompute_op.h: only `normed` is kept. The
    // backward's run needs the bounds again: the block keeps its own copy.
    DecoderLayerImpl* self = this;
    std::shared_ptr<const DocumentBounds> bounds =
        documents ? std::make_shared<const DocumentBounds>(*documents) : nullptr;
    mixed = recompute_in_backward(
        [self, bounds](const std::vector<at::Tensor>& in) {
          return std::vector<at::Tensor>{self->linear_attn ? self->linear_attn(in[0], bounds.get())
                                                           : self->self_attn(in[0], bounds.get())};
        },
        {normed})[0];
  } else {
    mixed = linear_attn ? linear_attn(normed, documents) : self_attn(normed, documents);
  }
  auto [normed2, h2] =
      add_zero_centered_rms_norm(h, mixed, post_attention_layernorm->weight, rms_norm_eps_);
  return {h2, mlp(normed2)};
}

QwenModelImpl::QwenModelImpl(const QwenConfig& c) : rms_norm_eps_(c.rms_norm_eps) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.hidden_size));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers->push_back(DecoderLayer(c, i));
  norm = register_module("norm", ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps));
}

at::Tensor QwenModelImpl::forward(const at::Tensor& input_ids, const DocumentBounds* documents) {
  TORCH_CHECK(input_ids.dim() == 2 && input_ids.scalar_type() == at::kLong,
              "QwenModel: expected input_ids of shape [B, T] and dtype Long but got shape ",
              input_ids.sizes(), " and dtype ", input_ids.scalar_type());
  TORCH_CHECK(documents == nullptr || (documents->rows() == input_ids.size(0) &&
                                       documents->length() == input_ids.size(1)),
              "QwenModel: expected document bounds of ", input_ids.size(0), " rows of ",
              input_ids.size(1), " tokens (input_ids' B, T) but got ",
              documents ? documents->rows() : 0, " rows of ", documents ? documents->length() : 0);
  // Rows that are each one document take the ordinary path (Note [Document masking]).
  if (documents != nullptr && documents->single_documents()) documents = nullptr;
  at::Tensor h = tied_embedding_state
                     ? tied_embedding_lookup(input_ids, embed_tokens->weight, tied_embedding_state)
                     : embed_tokens(input_ids);
  // Each layer hands its MLP output over un-added; the next norm adds it (Note [Residual
  // add in the norm]).
  at::Tensor pending;
  const bool recompute_layers = current_execution_policy().recompute == Recompute::kFull;
  std::shared_ptr<const DocumentBounds> bounds_copy;  // shared by the layers' blocks
  for (const auto& layer : *layers) {
    DecoderLayerImpl* decoder = layer->as<DecoderLayer>();
    if (!recompute_layers) {
      std::tie(h, pending) = decoder->forward_pending(h, pending, documents);
      continue;
    }
    // Note [Recomputation]: only the layer's inputs (h and the pending MLP output) are kept;
    // the block keeps its own copy of the bounds for the backward's run.
    if (documents != nullptr && bounds_copy == nullptr) {
      bounds_copy = std::make_shared<const DocumentBounds>(*documents);
    }
    const std::vector<at::Tensor> out = recompute_in_backward(
        [decoder, bounds_copy](const std::vector<at::Tensor>& in) {
          auto [next_h, next_pending] = decoder->forward_pending(in[0], in[1], bounds_copy.get());
          return std::vector<at::Tensor>{next_h, next_pending};
        },
        {h, pending});
    h = out[0];
    pending = out[1];
  }
  if (!pending.defined()) return norm(h);
  return add_zero_centered_rms_norm(h, pending, norm->weight, rms_norm_eps_).first;
}

namespace {
QwenConfig checked(const QwenConfig& config) {
  const absl::Status status = validate_qwen_config(config, "QwenConfig");
  TORCH_CHECK(status.ok(), "QwenForCausalLM: invalid config: ", status.message());
  return config;
}
}  // namespace

QwenForCausalLMImpl::QwenForCausalLMImpl(const QwenConfig& config) : config_(checked(config)) {
  model = register_module("model", QwenModel(config_));
  if (!config_.tie_word_embeddings) {
    lm_head = register_module(
        "lm_head",
        torch::nn::Linear(
            torch::nn::LinearOptions(config_.hidden_size, config_.vocab_size).bias(false)));
  }
}

at::Tensor QwenForCausalLMImpl::forward(const at::Tensor& input_ids) {
  return logits(input_ids, nullptr);
}

at::Tensor QwenForCausalLMImpl::forward(const at::Tensor& input_ids,
                                        const DocumentBounds& documents) {
  return logits(input_ids, &documents);
}

at::Tensor QwenForCausalLMImpl::logits(const at::Tensor& input_ids,
                                       const DocumentBounds* documents) {
  if (lm_head) return lm_head(model(input_ids, documents));
  const at::Tensor& weight = model->embed_tokens->weight;
  if (!tied_embedding_fusable(weight)) {
    return model(input_ids, documents).matmul(weight.t());  // composite
  }
  // The lookup and the LM head of this forward share one state, so W gets one gradient.
  const TiedEmbeddingStatePtr state = make_tied_embedding_state();
  struct Clear {
    QwenModelImpl& m;
    ~Clear() { m.tied_embedding_state = nullptr; }
  } clear{*model};
  model->tied_embedding_state = state;
  const at::Tensor hidden = model(input_ids, documents);
  return tied_lm_head(hidden, weight, state);
}

at::Tensor QwenForCausalLMImpl::loss(const at::Tensor& input_ids, const at::Tensor& labels) {
  return causal_lm_loss(forward(input_ids), labels);
}

at::Tensor QwenForCausalLMImpl::loss(const at::Tensor& input_ids, const at::Tensor& labels,
                                     const DocumentBounds& documents) {
  return causal_lm_loss(forward(input_ids, documents), document_masked_labels(labels, documents));
}

at::Tensor document_masked_labels(const at::Tensor& labels, const DocumentBounds& documents) {
  TORCH_CHECK(labels.dim() == 2 && documents.rows() == labels.size(0) &&
                  documents.length() == labels.size(1),
              "document_masked_labels: expected labels of shape [", documents.rows(), ", ",
              documents.length(), "] (the document bounds' rows and length) but got ",
              labels.sizes());
  if (documents.single_documents()) return labels;
  at::Tensor positions = at::tensor(documents.flat_starts_after_the_first(), at::kLong);
  // From pinned memory without blocking, as the trainer uploads the ids: a pageable copy
  // would wait for the GPU to finish the work queued so far.
  if (labels.is_cuda())
    positions = positions.pin_memory().to(labels.device(), /*non_blocking=*/true);
  return labels.reshape({-1}).index_fill(0, positions, kIgnoreIndex).view(labels.sizes());
}

void QwenForCausalLMImpl::set_gdr_core_algorithm(GdrCoreAlgorithm algorithm) {
  for (const auto& layer : *model->layers) {
    if (auto gdn = layer->as<DecoderLayer>()->linear_attn) gdn->set_core_algorithm(algorithm);
  }
}

void QwenForCausalLMImpl::set_pre_gdr_fusion(PreGdrFusion fusion) {
  for (const auto& layer : *model->layers) {
    if (auto gdn = layer->as<DecoderLayer>()->linear_attn) gdn->set_pre_gdr_fusion(fusion);
  }
  config_.pre_gdr_fusion = fusion;
}

at::Tensor causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 3, "causal_lm_loss: expected logits of shape [B, T, V] but got ",
              logits.sizes());
  TORCH_CHECK(labels.sizes() == logits.sizes().slice(0, 2),
              "causal_lm_loss: expected labels of shape ", logits.sizes().slice(0, 2),
              " (B, T of logits) but got ", labels.sizes());
  TORCH_CHECK(
      logits.size(1) >= 2,
      "causal_lm_loss: expected T >= 2 tokens to predict a next one but got T = ", logits.size(1));
  // CUDA logits take the fused op (no FP32 copy of the logits;
  // ops/cross_entropy/cross_entropy_op.h) unless the execution policy says cross_entropy composite;
  // the CPU and FP64 keep the composite, so their numerics do not change.
  const bool fused = current_execution_policy().cross_entropy == CrossEntropyImpl::kFused;
  if (fused && cross_entropy_fused_supports(logits)) {
    return causal_lm_cross_entropy(logits, labels, kIgnoreIndex);
  }
  return causal_lm_cross_entropy_composite(logits, labels, kIgnoreIndex);
}

void init_qwen_weights(QwenForCausalLMImpl& model, uint64_t seed) {
  at::NoGradGuard no_grad;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const double std_dev = model.config().initializer_range;
  const double conv_bound =
      1.0 / std::sqrt(static_cast<double>(model.config().linear_conv_kernel_dim));
  for (auto& item : model.named_parameters(/*recurse=*/true)) {
    const std::string& name = item.key();
    at::Tensor& param = item.value();
    const at::Tensor values = at::empty(param.sizes(), at::kFloat);
    if (absl::EndsWith(name, "linear_attn.A_log")) {
      values.uniform_(0.01, 16.0, gen).log_();
    } else if (absl::EndsWith(name, "linear_attn.dt_bias") ||
               absl::EndsWith(name, "linear_attn.norm.weight")) {
      values.fill_(1.0);
    } else if (absl::EndsWith(name, "linear_attn.conv1d.weight")) {
      values.uniform_(-conv_bound, conv_bound, gen);
    } else if (absl::EndsWith(name, "layernorm.weight") || absl::EndsWith(name, "q_norm.weight") ||
               absl::EndsWith(name, "k_norm.weight") || name == "model.norm.weight") {
      values.zero_();  // zero-centred: (1 + w) starts at identity
    } else {
      values.normal_(0.0, std_dev, gen);  // linears and the embedding
    }
    param.copy_(values);
  }
}

}  // namespace gdr
