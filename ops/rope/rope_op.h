// Fused partial rotary position embedding (rotate-half RoPE on the first `rotary_dim`
// channels) of x [B, H, T, hd], positions 0..T-1, inv_freq = theta^(-2i/rotary_dim): the
// gated attention's q and k. Math in FP32 (FP64 for Double x, CPU only), result in x's
// dtype.
//
// partial_rope_composite is the ATen composition (narrows, a cast, a negation, cats,
// products and a sum: the reference, the model's path on the CPU). The fused op runs one
// kernel each way on CUDA (kernels/rope/rope.h) with the composite's cos / sin tables, the
// composite's roundings (Note [Rope rounding]) and the composite's output values; the
// gradient is the sum of the same two non-zero terms autograd adds for the composite (the
// same values; the sign of an exactly-zero element may differ, as autograd also adds the
// zero-filled narrow backwards). Its output keeps x's memory layout (the model's
// transposed [B, T, H, hd] views stay in the layout flash attention reads). CPU: the same
// formulas through ATen ops. Elementwise, deterministic.
//
// The model's switch: the execution policy's rope = fused|composite (kernels.rope,
// environment override GDR_ROPE; default fused).
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/policy/execution_policy.h"

#include <cstdint>
#include <tuple>
#include <vector>

namespace gdr {

// cos and sin [T, rotary_dim] (FP32, or FP64 when `options` say Double; on the options'
// device), computed by the composite's ATen ops. The ops take FP64 tables with Double x
// only and FP32 tables otherwise.
std::tuple<at::Tensor, at::Tensor> rope_tables(int64_t tokens, int64_t rotary_dim, double theta,
                                               const at::TensorOptions& options);

at::Tensor partial_rope_composite(const at::Tensor& x, int64_t rotary_dim, double theta);

// The autograd-aware fused op (dispatches to CPU or CUDA).
at::Tensor partial_rope_fused(const at::Tensor& x, int64_t rotary_dim, double theta);

// The forward and backward ops alone (no autograd), with the tables given.
at::Tensor rope_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rope_backward(const at::Tensor& grad_y, const at::Tensor& cos, const at::Tensor& sin);

// The model's entry: the fused op for CUDA inputs of dtype Float, Half or BFloat16 when the
// switch says fused, else the composite.
at::Tensor partial_rope(const at::Tensor& x, int64_t rotary_dim, double theta);

// Packed documents (Note [Packed documents] in ops/packed/packed_documents.h): x [1, H, T, hd]
// holds documents back to back along T, document i being positions cu_seqlens[i] ..
// cu_seqlens[i+1]-1 (N + 1 non-decreasing offsets from 0 to T; empty documents allowed), and
// each document's positions restart at 0: partial_rope on each document alone, concatenated,
// bit for bit, forward and backward. The result's memory is laid out [1, T, H, hd] (the
// model's q / k layout).
at::Tensor partial_rope_varlen(const at::Tensor& x, int64_t rotary_dim, double theta,
                               const std::vector<int64_t>& cu_seqlens);

}  // namespace gdr
