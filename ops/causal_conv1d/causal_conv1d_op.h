// Fused causal depthwise conv1d + SiLU op: the Gated DeltaNet's short convolution over its
// qkv projection (models/qwen/layers.cc, pre_gdr_fusion none and gate).
//
//   x [B, T, C], weight [C, 1, K]  ->  y [B, T, C] contiguous, x's dtype
//   y[b, t, c] = silu(sum_{j<K} weight[c, 0, j] * x[b, t + j - K + 1, c])  (x = 0 before t = 0)
//
// dtypes: x and weight share one dtype, Float, Half or BFloat16 (Double on the CPU only);
// K in [2, 4]; B, T >= 0; C >= 1. x may have any strides (on CUDA the channel dim is read
// in place when its stride is 1, otherwise one contiguous copy is made; so is grad_y).
//
// CPU implementation: the ATen composition below (pad + conv1d + SiLU), forward bit for
// bit, backward as ATen's autograd of it computes (silu_backward, convolution_backward).
// CUDA implementation: the kernels of kernels/causal_conv1d/causal_conv1d.h (1 launch forward, 2
// backward) on the current CUDA stream with scratch from the caching allocator; the conv
// result and the SiLU are rounded to the activation dtype where the composition stores
// them, so the two differ by FP32 summation order only. Every output, the weight gradient
// included, is deterministic by construction on both devices (Note [Causal conv
// determinism]; on CUDA the bits do not depend on the strides of x or grad_y either).
// Differentiable once (autograd saves x and weight; the backward recomputes the conv and
// is not itself differentiable). Gradients come back in the dtype of their input (dx: x,
// dweight: weight) with the input's shape; dx is contiguous.
//
// The model's switch: the execution policy's causal_conv = kernel|aten (kernels.causal_conv,
// environment override GDR_CAUSAL_CONV; default kernel) picks this op or the composition on
// CUDA for the GDN (models/qwen/layers.cc); the CPU, FP64 and unsupported K always take
// the composition.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/policy/execution_policy.h"

#include <cstdint>
#include <tuple>
#include <vector>

namespace gdr {

// The unfused ATen composition (autograd through ATen ops), what the model ran before the
// op existed: the reference of the formula and the model's path on the CPU. Returns the
// [B, T, C] transpose of a contiguous [B, C, T] result (no copy).
at::Tensor causal_conv1d_silu_composite(const at::Tensor& x, const at::Tensor& weight);

// Autograd-aware fused op (dispatches to CPU or CUDA).
at::Tensor causal_conv1d_silu(const at::Tensor& x, const at::Tensor& weight);

// The forward and backward ops alone (no autograd).
at::Tensor causal_conv1d_silu_forward(const at::Tensor& x, const at::Tensor& weight);  // y
std::tuple<at::Tensor, at::Tensor> causal_conv1d_silu_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight);  // (dx, dweight)

// Packed documents (Note [Packed documents] in ops/packed/packed_documents.h): x [1, T, C]
// holds documents back to back, document i being tokens cu_seqlens[i] .. cu_seqlens[i+1]-1
// (N + 1 non-decreasing offsets from 0 to T; empty documents allowed). Every document starts
// from zero history (the conv state is reset at each boundary): the result is
// causal_conv1d_silu (impl kKernel: the op, CPU or CUDA by device) or
// causal_conv1d_silu_composite (kAten) on each document alone, concatenated, bit for bit,
// forward and backward (the weight gradient is the sum of the documents', in autograd's
// order). Returns [1, T, C] contiguous.
at::Tensor causal_conv1d_silu_varlen(const at::Tensor& x, const at::Tensor& weight,
                                     const std::vector<int64_t>& cu_seqlens,
                                     CausalConvImpl impl = CausalConvImpl::kKernel);

// True when the CUDA kernels take (x, weight): x a CUDA [B, T, C] tensor of dtype Float,
// Half or BFloat16, weight [C, 1, K] of x's dtype on x's device with K in [2, 4].
bool causal_conv1d_kernel_supports(const at::Tensor& x, const at::Tensor& weight);

}  // namespace gdr
