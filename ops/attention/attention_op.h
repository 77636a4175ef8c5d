// Causal grouped-query attention for the model's full-attention layers: cuDNN's flash
// attention graphs on CUDA (with cuDNN's own deterministic backward in deterministic
// mode), ATen's scaled_dot_product_attention everywhere else.
//
// Note [Attention backends]: ATen's SDPA, asked for deterministic algorithms, skips its
// cuDNN backend and runs FlashAttention 2 with split dQ accumulators, much slower per 0.8B
// step than cuDNN's kernels (measured: docs/benchmarks.md, Causal attention and Decisions).
// The op here calls cuDNN directly and asks for its deterministic backward when
// use_deterministic_mode() is true, so deterministic mode stops paying for attention. It
// takes ATen's SDPA instead when
//   - the execution policy's attention choice says aten (kernels.attention: aten, or
//     GDR_ATTENTION=aten; cudnn, the default: cuDNN where it can),
//   - the tensors are not CUDA, or not BF16/FP16,
//   - or cuDNN cannot run the problem (head_dim not a multiple of 8 or above 256, rows not
//     16-byte aligned, or cuDNN's own check refuses it): attention_backend() says why.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/policy/execution_policy.h"

namespace gdr {

// Which implementation causal_attention() takes for these inputs. When it is not cuDNN and
// `why_not_cudnn` is given, that gets one line saying why.
AttentionBackend attention_backend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   double scale, std::string* why_not_cudnn = nullptr);

// softmax(scale * q k^T + causal mask) v with grouped-query heads, differentiable.
// q: [B, Hq, T, D]; k, v: [B, Hkv, T, D] with Hq a multiple of Hkv (query head h reads key
// head h / (Hq / Hkv), as in enable_gqa). Returns [B, Hq, T, D]; on the cuDNN path its
// memory is laid out [B, T, Hq, D], so out.transpose(1, 2).reshape({B, T, Hq * D}) is free.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            double scale);

// Packed documents (Note [Packed documents] in ops/packed/packed_documents.h): q [1, Hq, T, D],
// k, v [1, Hkv, T, D] hold documents back to back along T, document i being positions
// cu_seqlens[i] .. cu_seqlens[i+1]-1 (N + 1 non-decreasing offsets from 0 to T; empty
// documents allowed); each document's queries attend causally to its own keys only (a
// block-diagonal causal mask). The result is causal_attention on each document alone,
// concatenated, bit for bit, forward and backward: [1, Hq, T, D] whose memory is laid out
// [1, T, Hq, D] (as the cuDNN path's), so out.transpose(1, 2).reshape({1, T, Hq * D}) is
// free. cuDNN's padded-ragged (THD) variant, one launch for all documents, is future work.
at::Tensor causal_attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                   double scale, const std::vector<int64_t>& cu_seqlens);

// The reference: explicit score matrix, FP32 math (FP64 for double inputs). Returns the
// output in q's dtype and the rows' log-sum-exp [B, Hq, T] (FP32, or FP64 for double).
// The CPU implementation of the gdr::causal_attention_forward op, and what the cuDNN
// path is tested against.
std::tuple<at::Tensor, at::Tensor> causal_attention_reference_forward(const at::Tensor& q,
                                                                      const at::Tensor& k,
                                                                      const at::Tensor& v,
                                                                      double scale);

// The reference backward, from the forward's output and log-sum-exp: grad_q, grad_k,
// grad_v (grad_k / grad_v summed over each key head's query group), in the inputs' dtypes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_attention_reference_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& logsumexp, double scale);

}  // namespace gdr
