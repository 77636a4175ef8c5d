// Fused RMSNorm ops for the two norms of the Qwen3.5 model, over the last dim (D):
//   zero-centred: y = x * rsqrt(mean(x^2) + eps) * (1 + w)        result in x's dtype
//   gated:        y = (o * rsqrt(mean(o^2) + eps)) * w * silu(z)   result in out_dtype
// FP32 math for FP32/FP16/BF16 storage, FP64 math for Double (CPU only). x, o, z: [..., D] with any
// strides (on CUDA, rows are read in place when the last dim is contiguous and the leading dims
// collapse to at most 4; otherwise one contiguous copy is made); weight: [D]; z has o's shape.
//
// CPU implementation: the libtorch compositions below (the references), forward
// bit-for-bit, backward as the analytic formula in ATen. CUDA implementation: the kernels
// of kernels/rms_norm/rms_norm.h (1 launch forward, 2 backward) on the current CUDA stream with
// scratch from the caching allocator; FP64 is refused on CUDA (use the composite) and
// D must be in [1, kernels::kRmsNormMaxCols]. Every output, the weight gradient included,
// is deterministic by construction on both devices (Note [RMSNorm determinism]).
// Differentiable once (the backward is not itself differentiable).
//
// The model picks the fused op or the composite on CUDA for its norms with the execution
// policy's kernels.rms_norm (ops/policy/execution_policy.h; models/qwen/layers.cc); the CPU
// and FP64 inputs always take the composite.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

namespace gdr {

// The unfused libtorch compositions (autograd through ATen ops): the one reference of
// each formula, and the model's path on the CPU and for FP64.
at::Tensor zero_centered_rms_norm_composite(const at::Tensor& x, const at::Tensor& weight,
                                            double eps);
at::Tensor gated_rms_norm_composite(const at::Tensor& o, const at::Tensor& z,
                                    const at::Tensor& weight, double eps, at::ScalarType out_dtype);

// Autograd-aware fused ops (dispatch to CPU or CUDA).
at::Tensor zero_centered_rms_norm_fused(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor gated_rms_norm_fused(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight,
                                double eps, at::ScalarType out_dtype);

// The forward and backward ops alone (no autograd). rstd: FP32 [...] (x's shape without
// the last dim; FP64 for FP64 gated inputs on the CPU). Gradients come back in the dtype
// of the input they belong to (dx: x, dz: z, dw: weight).
std::tuple<at::Tensor, at::Tensor> zero_centered_rms_norm_forward(const at::Tensor& x,
                                                                  const at::Tensor& weight,
                                                                  double eps);  // (y, rstd)
std::tuple<at::Tensor, at::Tensor> zero_centered_rms_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight,
    const at::Tensor& rstd);  // (dx, dw)
std::tuple<at::Tensor, at::Tensor> gated_rms_norm_forward(const at::Tensor& o, const at::Tensor& z,
                                                          const at::Tensor& weight, double eps,
                                                          at::ScalarType out_dtype);  // (y, rstd)
std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_rms_norm_backward(
    const at::Tensor& grad_y, const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight,
    const at::Tensor& rstd);  // (do, dz, dw)

// The zero-centred norm of a residual sum, for the pre-norm residual stream
// (h = x + residual; normed = norm(h)): returns (y, sum) with sum = x + residual in x's
// dtype (ATen's add, one rounding) and y = zero_centered_rms_norm(sum). The gradients of
// x and residual are both d(sum) = dx_norm(grad_y) + grad_sum, rounded as autograd would
// round the norm's dx and the add of the two (Note [RMSNorm with the residual add] in
// kernels/rms_norm/rms_norm_kernel.cuh), so the fused op gives the bits of the composite
//   sum = x + residual; y = zero_centered_rms_norm_fused(sum)
// in one kernel each way instead of three (the add, the norm, autograd's add of the two
// gradients of sum). x and residual: one shape, dtype and device.
std::tuple<at::Tensor, at::Tensor> add_zero_centered_rms_norm_fused(const at::Tensor& x,
                                                                    const at::Tensor& residual,
                                                                    const at::Tensor& weight,
                                                                    double eps);
// The ops alone: (y, sum, rstd); and (dx, dw) where dx is the gradient of the sum (that is,
// of x and of residual). grad_sum may be undefined (no other use of the sum).
std::tuple<at::Tensor, at::Tensor, at::Tensor> add_zero_centered_rms_norm_forward(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_zero_centered_rms_norm_backward(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& weight, const at::Tensor& rstd);

// True when the fused CUDA op takes `x` (and a matching weight): a CUDA tensor of dtype
// Float, Half or BFloat16 with a last dim in [1, kernels::kRmsNormMaxCols].
bool rms_norm_fused_supports(const at::Tensor& x);

}  // namespace gdr
