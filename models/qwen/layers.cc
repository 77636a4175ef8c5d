#include "models/qwen/layers.h"
#include "ops/policy/execution_policy.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/split.h>
#include <ATen/ops/split_with_sizes.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <tuple>

#include "ops/attention/attention_op.h"
#include "ops/causal_conv1d/causal_conv1d_op.h"
#include "ops/gated_activation/gated_activation_op.h"
#include "ops/gdr_core/gdr_core_op.h"
#include "ops/linear_group/linear_group_op.h"
#include "ops/packed/packed_documents.h"
#include "ops/pre_gdr_gate/pre_gdr_full_fusion_op.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"
#include "ops/rms_norm/rms_norm_op.h"
#include "ops/rope/rope_op.h"

namespace gdr {
namespace {

torch::nn::Linear linear_no_bias(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

void check_activation(const char* module, const at::Tensor& x, int64_t hidden) {
  TORCH_CHECK(x.dim() == 3 && x.size(-1) == hidden, module, ": expected x of shape [B, T, ", hidden,
              "] but got ", x.sizes());
}

// True when `documents` asks for per-document work on x [B, T, ...]: some row holds more
// than one document (Note [Document masking]). Checks that they describe x's rows.
bool packed_documents(const char* module, const at::Tensor& x, const DocumentBounds* documents) {
  if (documents == nullptr) return false;
  TORCH_CHECK(documents->rows() == x.size(0) && documents->length() == x.size(1), module,
              ": expected document bounds of ", x.size(0), " rows of ", x.size(1),
              " tokens (x's B, T) but got ", documents->rows(), " rows of ", documents->length());
  return !documents->single_documents();
}

// x [B, T, ...] as one packed sequence [1, B * T, ...] (a view where the strides allow).
at::Tensor flatten_rows(const at::Tensor& x) {
  std::vector<int64_t> shape = x.sizes().vec();
  shape[1] *= shape[0];
  shape[0] = 1;
  return x.reshape(shape);
}

// split_last_dim (see the header).
class SplitLastDim : public torch::autograd::Function<SplitLastDim> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x,
                                                const std::vector<int64_t>& sizes) {
    ctx->saved_data["sizes"] = sizes;
    ctx->saved_data["shape"] = x.sizes().vec();
    ctx->set_materialize_grads(false);
    std::vector<at::Tensor> pieces;
    int64_t offset = 0;
    for (int64_t size : sizes) {
      pieces.push_back(x.narrow(-1, offset, size));
      offset += size;
    }
    return pieces;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const std::vector<int64_t> sizes = ctx->saved_data["sizes"].toIntVector();
    const std::vector<int64_t> shape = ctx->saved_data["shape"].toIntVector();
    if (at::Tensor whole = tiled_buffer(grads, shape); whole.defined()) return {whole, {}};
    std::vector<at::Tensor> parts;
    std::vector<int64_t> piece_shape = shape;
    at::TensorOptions options;
    for (const at::Tensor& g : grads) {
      if (g.defined()) options = g.options();
    }
    if (!options.has_dtype()) return {at::Tensor(), at::Tensor()};
    for (size_t i = 0; i < grads.size(); ++i) {
      piece_shape.back() = sizes[i];
      parts.push_back(grads[i].defined() ? grads[i] : at::zeros(piece_shape, options));
    }
    return {at::cat(parts, -1), at::Tensor()};
  }

 private:
  // The tensor of `shape` (contiguous) whose consecutive column slices the gradients are,
  // as a view of their storage; undefined when they are not exactly that.
  static at::Tensor tiled_buffer(const torch::autograd::variable_list& grads,
                                 const std::vector<int64_t>& shape) {
    const int64_t width = shape.back();
    int64_t expected_offset = -1;
    for (const at::Tensor& g : grads) {
      if (!g.defined() || g.dim() != static_cast<int64_t>(shape.size()) ||
          g.scalar_type() != grads[0].scalar_type() ||
          !g.storage().is_alias_of(grads[0].storage()) || g.stride(-1) != 1) {
        return {};
      }
      // Row-major strides of `shape` on every dim but the last (size-1 dims are free).
      int64_t stride = width;
      for (int64_t d = g.dim() - 2; d >= 0; --d) {
        if (g.size(d) != shape[d] || (shape[d] > 1 && g.stride(d) != stride)) return {};
        stride *= shape[d];
      }
      if (expected_offset >= 0 && g.storage_offset() != expected_offset) return {};
      expected_offset = g.storage_offset() + g.size(-1);
    }
    if (expected_offset - grads[0].storage_offset() != width) return {};
    std::vector<int64_t> strides(shape.size(), 1);
    for (int64_t d = static_cast<int64_t>(shape.size()) - 2; d >= 0; --d) {
      strides[d] = strides[d + 1] * shape[d + 1];
    }
    return grads[0].as_strided(shape, strides, grads[0].storage_offset());
  }
};

}  // namespace

std::vector<at::Tensor> split_last_dim(const at::Tensor& x, const std::vector<int64_t>& sizes) {
  int64_t total = 0;
  for (int64_t size : sizes) total += size;
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == total, "split_last_dim: expected x's last dim to be ",
              total, " (the sum of the sizes) but got shape ", x.sizes());
  return SplitLastDim::apply(x, sizes);
}

// Both norms take the fused op (ops/rms_norm/rms_norm_op.h) for CUDA FP32/FP16/BF16 inputs unless
// the execution policy says rms_norm composite; the CPU and FP64 keep the composition, so their
// numerics do not change.
namespace {
bool norm_takes_fused_op(const at::Tensor& x, const at::Tensor& weight) {
  return current_execution_policy().rms_norm == RmsNormImpl::kFused && rms_norm_fused_supports(x) &&
         weight.scalar_type() != at::kDouble;
}
}  // namespace

at::Tensor zero_centered_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  if (norm_takes_fused_op(x, weight)) return zero_centered_rms_norm_fused(x, weight, eps);
  return zero_centered_rms_norm_composite(x, weight, eps);
}

std::pair<at::Tensor, at::Tensor> add_zero_centered_rms_norm(const at::Tensor& x,
                                                             const at::Tensor& residual,
                                                             const at::Tensor& weight, double eps) {
  if (current_execution_policy().add_rms_norm == AddRmsNormImpl::kFused &&
      norm_takes_fused_op(x, weight) && residual.scalar_type() == x.scalar_type() &&
      residual.sizes() == x.sizes()) {
    auto [normed, sum] = add_zero_centered_rms_norm_fused(x, residual, weight, eps);
    return {normed, sum};
  }
  at::Tensor sum = x + residual;
  return {zero_centered_rms_norm(sum, weight, eps), sum};
}

at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight,
                          double eps, at::ScalarType out_dtype) {
  TORCH_CHECK(o.sizes() == z.sizes(), "gated_rms_norm: expected z of shape ", o.sizes(),
              " (same as o) but got ", z.sizes());
  const bool fused = current_execution_policy().rms_norm == RmsNormImpl::kFused;
  if (fused && rms_norm_fused_supports(o) && z.scalar_type() != at::kDouble &&
      weight.scalar_type() != at::kDouble && out_dtype != at::kDouble) {
    return gated_rms_norm_fused(o, z, weight, eps, out_dtype);
  }
  return gated_rms_norm_composite(o, z, weight, eps, out_dtype);
}

// The fused op for CUDA FP32/FP16/BF16 inputs with K in [2, 4] unless the execution policy
// says causal_conv aten; the CPU and FP64 keep the composition, so their numerics do not
// change.
at::Tensor gdn_causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight) {
  const bool kernel = current_execution_policy().causal_conv == CausalConvImpl::kKernel;
  if (kernel && causal_conv1d_kernel_supports(x, weight)) return causal_conv1d_silu(x, weight);
  return causal_conv1d_silu_composite(x, weight);
}

at::Tensor gdn_causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight,
                                  const DocumentBounds& documents) {
  TORCH_CHECK(x.dim() == 3, "gdn_causal_conv1d_silu: expected x of shape [B, T, C] but got ",
              x.sizes());
  packed_documents("gdn_causal_conv1d_silu", x, &documents);
  const at::Tensor packed = flatten_rows(x);
  const bool kernel = current_execution_policy().causal_conv == CausalConvImpl::kKernel &&
                      causal_conv1d_kernel_supports(packed, weight);
  return causal_conv1d_silu_varlen(packed, weight, documents.cu_seqlens(),
                                   kernel ? CausalConvImpl::kKernel : CausalConvImpl::kAten)
      .view(x.sizes());
}

// The execution policy's gdr_core_v_fp32 (Note [GDR core value dtype]): false keeps v in the
// activations' dtype; true widens it to FP32.
static bool core_v_fp32() { return current_execution_policy().gdr_core_v_fp32; }

at::Tensor apply_partial_rope(const at::Tensor& x, int64_t rotary_dim, double theta) {
  return partial_rope(x, rotary_dim, theta);
}

ZeroCenteredRMSNormImpl::ZeroCenteredRMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::zeros({dim}));
}

at::Tensor ZeroCenteredRMSNormImpl::forward(const at::Tensor& x) {
  return zero_centered_rms_norm(x, weight, eps_);
}

RMSNormGatedImpl::RMSNormGatedImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", at::ones({dim}));
}

at::Tensor RMSNormGatedImpl::forward(const at::Tensor& o, const at::Tensor& z) {
  return gated_rms_norm(o, z, weight, eps_, z.scalar_type());
}

GatedDeltaNetImpl::GatedDeltaNetImpl(const QwenConfig& c)
    : num_k_heads_(c.linear_num_key_heads),
      num_v_heads_(c.linear_num_value_heads),
      k_head_dim_(c.linear_key_head_dim),
      v_head_dim_(c.linear_value_head_dim),
      kernel_size_(c.linear_conv_kernel_dim),
      fusion_(PreGdrFusion::kGate) {
  set_pre_gdr_fusion(c.pre_gdr_fusion);
  const int64_t D = c.hidden_size;
  const int64_t conv_dim = c.linear_conv_dim();
  in_proj_qkv = register_module("in_proj_qkv", linear_no_bias(D, conv_dim));
  in_proj_z = register_module("in_proj_z", linear_no_bias(D, c.linear_value_dim()));
  in_proj_b = register_module("in_proj_b", linear_no_bias(D, num_v_heads_));
  in_proj_a = register_module("in_proj_a", linear_no_bias(D, num_v_heads_));
  // Depthwise: one length-K filter per channel; causality comes from the explicit left
  // pad in forward, so the module itself pads nothing.
  conv1d = register_module(
      "conv1d",
      torch::nn::Conv1d(
          torch::nn::Conv1dOptions(conv_dim, conv_dim, kernel_size_).groups(conv_dim).bias(false)));
  dt_bias = register_parameter("dt_bias", at::ones({num_v_heads_}));
  // Placeholder value; init_qwen_weights draws log U(0.01, 16) from the seed.
  A_log = register_parameter("A_log", at::zeros({num_v_heads_}));
  norm = register_module("norm", RMSNormGated(v_head_dim_, c.rms_norm_eps));
  out_proj = register_module("out_proj", linear_no_bias(c.linear_value_dim(), D));
}

void GatedDeltaNetImpl::set_pre_gdr_fusion(PreGdrFusion fusion) { fusion_ = fusion; }

at::Tensor GatedDeltaNetImpl::forward(const at::Tensor& x, const DocumentBounds* documents) {
  check_activation("GatedDeltaNet", x, in_proj_qkv->options.in_features());
  const int64_t B = x.size(0), T = x.size(1);
  // Note [Document masking] (models/qwen/document_bounds.h): the conv, the core and the full
  // fusion per document; everything else here is per token.
  const bool packed = packed_documents("GatedDeltaNet", x, documents);
  TORCH_CHECK(!packed || core_algorithm_ == GdrCoreAlgorithm::kDispatch,
              "GatedDeltaNet: document bounds need the dispatching GDR core (the chunked and "
              "recurrent test hooks take none)");
  const int64_t key_dim = num_k_heads_ * k_head_dim_, value_dim = num_v_heads_ * v_head_dim_;

  TORCH_CHECK(fusion_ != PreGdrFusion::kFull || x.is_cuda(),
              "GatedDeltaNet: pre_gdr_fusion: full needs CUDA (the fully fused pre-GDR op has "
              "no CPU implementation) but x is on ",
              x.device(), "; use pre_gdr_fusion: gate or none on CPU");
  // The four projections of x as one group, so the backward sums their input gradients
  // inside the GEMMs (ops/linear_group/linear_group_op.h; the execution policy's linear_group
  // composite: four Linear calls).
  const std::vector<at::Tensor> projections =
      project(x, {in_proj_qkv->weight, in_proj_z->weight, in_proj_b->weight, in_proj_a->weight});
  const at::Tensor &mixed_qkv = projections[0], &z_flat = projections[1];
  const at::Tensor &b = projections[2], &a = projections[3];  // [B, T, Hv]

  at::Tensor q, k, v, g, beta;
  // q and k of the GDN are unit vectors before the core (HF: use_qk_l2norm_in_kernel).
  GdrQkNorm qk_norm = GdrQkNorm::kL2;
  if (fusion_ == PreGdrFusion::kFull) {
    // One fused CUDA op from the projections to the core inputs
    // (ops/pre_gdr_gate/pre_gdr_full_fusion_op.h).
    const GdnHeads heads{num_k_heads_, num_v_heads_, k_head_dim_, v_head_dim_};
    if (packed) {
      // One fused call per document, its conv starting from zero history (Note [Packed
      // documents] in ops/packed/packed_documents.h), the pieces concatenated.
      const char* op = "GatedDeltaNet (pre_gdr_fusion full)";
      const std::vector<int64_t>& cu = documents->cu_seqlens();
      const std::vector<at::Tensor> qkv_docs = split_documents(op, flatten_rows(mixed_qkv), 1, cu),
                                    a_docs = split_documents(op, flatten_rows(a), 1, cu),
                                    b_docs = split_documents(op, flatten_rows(b), 1, cu);
      std::vector<at::Tensor> qs, ks, vs, gs, betas;
      for (size_t i = 0; i < qkv_docs.size(); ++i) {
        const GdrInputs in = pre_gdr_full_fusion(qkv_docs[i], conv1d->weight, a_docs[i], b_docs[i],
                                                 A_log, dt_bias, heads);
        qs.push_back(in.q), ks.push_back(in.k), vs.push_back(in.v);
        gs.push_back(in.g), betas.push_back(in.beta);
      }
      q = at::cat(qs, 1).view({B, T, num_v_heads_, k_head_dim_});
      k = at::cat(ks, 1).view({B, T, num_v_heads_, k_head_dim_});
      v = at::cat(vs, 1).view({B, T, num_v_heads_, v_head_dim_});
      g = at::cat(gs, 1).view({B, T, num_v_heads_});
      beta = at::cat(betas, 1).view({B, T, num_v_heads_});
    } else {
      const GdrInputs in =
          pre_gdr_full_fusion(mixed_qkv, conv1d->weight, a, b, A_log, dt_bias, heads);
      q = in.q, k = in.k, v = in.v, g = in.g, beta = in.beta;
    }
    qk_norm = GdrQkNorm::kNone;  // normalised and repeated by the fused op
  } else {
    // NOTE: gdr::pre_gdr_full_fusion_composite is this same op sequence with
    // the policy's causal_conv aten, the L2 norm and the head repeat done there as the core's
    // chunk_prep_qk does them here (the tests' reference); keep the two in sync.
    // Causal depthwise conv over time + SiLU: [B, T, conv_dim], contiguous from the fused
    // op (so the narrow + reshape of q and k below are views), a transposed view from the
    // composition (they copy).
    const at::Tensor qkv = packed ? gdn_causal_conv1d_silu(mixed_qkv, conv1d->weight, *documents)
                                  : gdn_causal_conv1d_silu(mixed_qkv, conv1d->weight);

    // The raw key heads in x's dtype: the core normalises them (in FP32, or FP64 for FP64
    // inputs) and maps each of the Hv/Hk consecutive value heads of a key head to it, on
    // CUDA inside the prep kernel, which reads these views in place.
    // One split, not three narrows: see Note [Split, not narrow].
    const std::vector<at::Tensor> qkv_parts = split_last_dim(qkv, {key_dim, key_dim, value_dim});
    q = qkv_parts[0].reshape({B, T, num_k_heads_, k_head_dim_});
    k = qkv_parts[1].reshape({B, T, num_k_heads_, k_head_dim_});
    // Note [GDR core value dtype]: the core computes in FP32 whatever its inputs and returns
    // o in v's dtype. v stays in x's dtype (BF16 in training, as in HF's and FLA's
    // kernels): the prep kernel widens it as it reads, dv comes back in BF16, and o comes
    // back BF16, so the gated norm below reads o, z and its output gradient in one dtype
    // with no cast passes either way. The execution policy's gdr_core_v_fp32 widens v first
    // (the core then returns an FP32 o, which the norm casts with z and the gradients).
    // pre_gdr_fusion: full hands the core its own FP32 q, k, v
    // (ops/pre_gdr_gate/pre_gdr_full_fusion_op.h) and rounds the core's FP32 o to the activations'
    // dtype after it (below).
    v = qkv_parts[2].reshape({B, T, num_v_heads_, v_head_dim_});
    if (x.scalar_type() != at::kDouble && v.scalar_type() != at::kFloat && core_v_fp32()) {
      v = v.to(at::kFloat);
    }

    // g and beta come back FP32 from either form of the gate.
    std::tie(g, beta) = fusion_ == PreGdrFusion::kGate
                            ? pre_gdr_gate(a, b, A_log, dt_bias)
                            : pre_gdr_gate_composite(a, b, A_log, dt_bias);
  }

  const double scale = 1.0 / std::sqrt(static_cast<double>(k_head_dim_));
  at::Tensor o;
  switch (core_algorithm_) {
    case GdrCoreAlgorithm::kDispatch:
      if (packed) {
        // The batch as one packed sequence: every row end is a document end too.
        o = std::get<0>(gated_delta_rule_varlen(flatten_rows(q), flatten_rows(k), flatten_rows(v),
                                                flatten_rows(g), flatten_rows(beta), scale,
                                                documents->cu_seqlens(), std::nullopt, false,
                                                qk_norm))
                .view({B, T, num_v_heads_, v_head_dim_});
      } else {
        o = std::get<0>(gated_delta_rule(q, k, v, g, beta, scale, std::nullopt, false, qk_norm));
      }
      break;
    case GdrCoreAlgorithm::kChunked:
      o = std::get<0>(gated_delta_rule_chunked(q, k, v, g, beta, scale, std::nullopt, false,
                                               kGdrChunkSize, qk_norm));
      break;
    case GdrCoreAlgorithm::kRecurrent:
      o = std::get<0>(
          gated_delta_rule_recurrent(q, k, v, g, beta, scale, std::nullopt, false, qk_norm));
      break;
  }
  // Full fusion hands the core FP32 v, so o comes back FP32: rounded here to the
  // activations' dtype as the other fusion levels' core rounds it (Note [GDR core value
  // dtype]), the same values into the norm whatever the fusion level.
  if (fusion_ == PreGdrFusion::kFull && !core_v_fp32()) o = o.to(x.scalar_type());
  const at::Tensor z = z_flat.reshape({B, T, num_v_heads_, v_head_dim_});
  o = norm(o, z);  // FP32 math, back to z's dtype
  return out_proj(o.reshape({B, T, value_dim}));
}

GatedAttentionImpl::GatedAttentionImpl(const QwenConfig& c)
    : num_heads_(c.num_attention_heads),
      num_kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim),
      rotary_dim_(c.rotary_dim()),
      rope_theta_(c.rope_theta) {
  const int64_t D = c.hidden_size;
  q_proj = register_module("q_proj", linear_no_bias(D, 2 * num_heads_ * head_dim_));
  k_proj = register_module("k_proj", linear_no_bias(D, num_kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", linear_no_bias(D, num_kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", linear_no_bias(num_heads_ * head_dim_, D));
  q_norm = register_module("q_norm", ZeroCenteredRMSNorm(head_dim_, c.rms_norm_eps));
  k_norm = register_module("k_norm", ZeroCenteredRMSNorm(head_dim_, c.rms_norm_eps));
}

at::Tensor GatedAttentionImpl::forward(const at::Tensor& x, const DocumentBounds* documents) {
  check_activation("GatedAttention", x, q_proj->options.in_features());
  const int64_t B = x.size(0), T = x.size(1);
  const bool packed = packed_documents("GatedAttention", x, documents);
  // q, k, v as one group: see GatedDeltaNetImpl::forward.
  const std::vector<at::Tensor> projections =
      project(x, {q_proj->weight, k_proj->weight, v_proj->weight});
  const at::Tensor query_and_gate = projections[0].reshape({B, T, num_heads_, 2 * head_dim_});
  // Note [Split, not narrow]: the pieces of one projection's output come from one split, not
  // one narrow each. A narrow's backward zero-fills a gradient of the whole output and copies
  // its slice in, and autograd then adds those full-size gradients up (for the GDN's q, k, v:
  // 3 fills, 3 copies and 2 adds of [B, T, conv_dim] per layer); a split's backward
  // concatenates its pieces' gradients in one pass. The sums only ever add zeros, so the
  // values are the same (up to the sign of an all-zero gradient element). The GDN's q, k, v
  // split (split_last_dim) skips even that pass when the core wrote their gradients into one
  // buffer already (Note [Gradients in the inputs' layout] in ops/gdr_core/chunk_prep_op.cc).
  const std::vector<at::Tensor> query_and_gate_parts = at::split(query_and_gate, head_dim_, -1);
  at::Tensor q = query_and_gate_parts[0];
  const at::Tensor& gate = query_and_gate_parts[1];  // [B, T, H, hd], read in place
  at::Tensor k = projections[1].reshape({B, T, num_kv_heads_, head_dim_});
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim_));
  at::Tensor attn;  // [B, T, H * hd]
  if (packed) {
    // Note [Document masking]: the batch as one packed sequence [1, B * T, ...], RoPE
    // positions restarting and attention confined to each document.
    const std::vector<int64_t>& cu = documents->cu_seqlens();
    q = partial_rope_varlen(flatten_rows(q_norm(q)).transpose(1, 2), rotary_dim_, rope_theta_, cu);
    k = partial_rope_varlen(flatten_rows(k_norm(k)).transpose(1, 2), rotary_dim_, rope_theta_, cu);
    const at::Tensor v = flatten_rows(projections[2]).reshape({1, B * T, num_kv_heads_, head_dim_});
    attn = causal_attention_varlen(q, k, v.transpose(1, 2), scale, cu)
               .transpose(1, 2)
               .reshape({B, T, -1});
  } else {
    const at::Tensor v = projections[2].reshape({B, T, num_kv_heads_, head_dim_}).transpose(1, 2);
    q = apply_partial_rope(q_norm(q).transpose(1, 2), rotary_dim_, rope_theta_);  // [B, H, T, hd]
    k = apply_partial_rope(k_norm(k).transpose(1, 2), rotary_dim_, rope_theta_);  // [B, Hkv, T, hd]
    // cuDNN on CUDA (deterministic backward in deterministic mode), ATen's SDPA otherwise:
    // Note [Attention backends] in ops/attention/attention_op.h.
    attn = causal_attention(q, k, v, scale).transpose(1, 2).reshape({B, T, -1});
  }
  return o_proj(gated_activation(gate, attn, GatedActivationKind::kSigmoid));
}

MlpImpl::MlpImpl(const QwenConfig& c) {
  gate_proj = register_module("gate_proj", linear_no_bias(c.hidden_size, c.intermediate_size));
  up_proj = register_module("up_proj", linear_no_bias(c.hidden_size, c.intermediate_size));
  down_proj = register_module("down_proj", linear_no_bias(c.intermediate_size, c.hidden_size));
}

at::Tensor MlpImpl::forward(const at::Tensor& x) {
  // gate and up as one group: see GatedDeltaNetImpl::forward.
  const std::vector<at::Tensor> gate_up = project(x, {gate_proj->weight, up_proj->weight});
  return down_proj(gated_activation(gate_up[0], gate_up[1], GatedActivationKind::kSilu));
}

}  // namespace gdr
