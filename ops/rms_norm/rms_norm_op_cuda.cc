// CUDA implementation of the RMSNorm ops (ops/rms_norm/rms_norm_op.h): argument checks, the row
// layout of each operand, dtype normalisation, scratch from the caching allocator and the
// launches of kernels/rms_norm/rms_norm.cu on the current stream (forward: 1 launch; backward: the
// row kernel and the ordered weight-gradient reduction, Note [RMSNorm determinism]).
// Registered for the CUDA dispatch key; linked into CUDA binaries only (via :cuda_ops).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "kernels/rms_norm/rms_norm.h"
#include "ops/policy/execution_policy.h"
#include "ops/rms_norm/rms_norm_internal.h"
#include "ops/rms_norm/rms_norm_op.h"

namespace gdr {
namespace {

using rms_norm_internal::check_add_backward_inputs;
using rms_norm_internal::check_backward_inputs;
using rms_norm_internal::check_forward_inputs;
using rms_norm_internal::check_same_as_x;

// The execution policy's kernels.rms_norm_kernel: the register-resident kernels or the
// streaming ones whose bits they reproduce (Note [RMSNorm register-resident rows]).
bool streaming_kernels() {
  return current_execution_policy().rms_norm_kernel == RmsNormKernel::kStreaming;
}

void check_launch(int error, const char* op, const char* what) {
  TORCH_CHECK(error == cudaSuccess, op, ": ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

kernels::NormDtype norm_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::NormDtype::kFloat32;
    case at::kHalf: return kernels::NormDtype::kFloat16;
    case at::kBFloat16: return kernels::NormDtype::kBFloat16;
    default: TORCH_CHECK(false, "rms_norm: unsupported dtype ", t, " on CUDA");
  }
}

void check_out_dtype(const char* op, at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16, op,
              ": expected out_dtype Float, Half or BFloat16 on CUDA, but got ", out_dtype);
}

// Operands whose leading dims do not fit the kernel's row decoding (more than
// kRmsNormMaxRowDims of them) are flattened to [rows, D] contiguous; operands whose last
// dim is strided are made contiguous. Everything else is read in place.
bool needs_flatten(const at::Tensor& x) { return x.dim() - 1 > kernels::kRmsNormMaxRowDims; }

at::Tensor rows_of(const at::Tensor& t, bool flatten) {
  if (flatten) return t.contiguous().view({-1, t.size(-1)});
  if (t.size(-1) > 1 && t.stride(-1) != 1) return t.contiguous();
  return t;
}

kernels::RmsNormShape shape_of(const at::Tensor& t) {
  kernels::RmsNormShape shape;
  shape.cols = t.size(-1);
  shape.rows = t.numel() / shape.cols;
  if (t.dim() == 1) {
    shape.row_dims = 1;
    shape.row_sizes[0] = 1;
    return shape;
  }
  shape.row_dims = static_cast<int>(t.dim() - 1);
  for (int k = 0; k < shape.row_dims; ++k) shape.row_sizes[k] = t.size(k);
  return shape;
}

kernels::RowOperand operand_of(const at::Tensor& t) {
  kernels::RowOperand op;
  op.data = t.data_ptr();
  for (int64_t k = 0; k + 1 < t.dim(); ++k) op.row_strides[k] = t.stride(k);
  return op;
}

// The kernels take the weight in the activation dtype or FP32; any other pairing is
// widened to FP32 (exact), which changes no result.
std::pair<at::Tensor, bool> weight_for(const at::Tensor& weight, at::ScalarType activation) {
  if (weight.scalar_type() == at::kFloat) return {weight.contiguous(), true};
  if (weight.scalar_type() == activation) return {weight.contiguous(), false};
  return {weight.to(at::kFloat).contiguous(), true};
}

at::Tensor rstd_like(const at::Tensor& x) {
  return at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
}

// Backward launches: the row kernel, then the ordered reduction into dw (weight's dtype).
at::Tensor launch_backward(kernels::RmsNormBackwardArgs& args, const at::Tensor& weight,
                           const at::Tensor& like, const char* op) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const kernels::RmsNormBackwardLaunch launch =
      kernels::derive_rms_norm_backward_launch(args.shape.rows, args.shape.cols);
  at::Tensor partials =
      at::empty({std::max<int64_t>(launch.scratch_floats, 1)}, like.options().dtype(at::kFloat));
  at::Tensor dw = at::empty({args.shape.cols}, weight.options());
  args.partials = partials.data_ptr<float>();
  check_launch(kernels::launch_rms_norm_backward(args, stream), op, "backward");
  check_launch(kernels::launch_rms_norm_reduce_partials(
                   args.partials, launch.programs, args.shape.cols,
                   norm_dtype(weight.scalar_type()), dw.data_ptr(), stream),
               op, "weight-gradient reduction");
  return dw;
}

// The zero-centred forward, with the residual add when `residual` is given (Note
// [RMSNorm with the residual add] in kernels/rms_norm/rms_norm_kernel.cuh: the sum is written
// contiguous and normalised in the same pass). Returns (y, sum or undefined, rstd).
std::tuple<at::Tensor, at::Tensor, at::Tensor> zero_centered_forward_launch(
    const char* op, const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
    double eps) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  // Both operands through one row decoding: flatten both when either needs it.
  const bool flatten = needs_flatten(x);
  const at::Tensor xr = rows_of(x, flatten);
  const at::Tensor rr = residual != nullptr ? rows_of(*residual, flatten) : at::Tensor();
  const auto [w, weight_fp32] = weight_for(weight, x.scalar_type());
  at::Tensor y = at::empty(x.sizes(), x.options());
  at::Tensor sum = residual != nullptr ? at::empty(x.sizes(), x.options()) : at::Tensor();
  at::Tensor rstd = rstd_like(x);
  kernels::RmsNormForwardArgs args;
  args.streaming_only = streaming_kernels();
  args.flavour = kernels::RmsNormFlavour::kZeroCentred;
  args.dtype = norm_dtype(x.scalar_type());
  args.weight_fp32 = weight_fp32;
  args.shape = shape_of(xr);
  args.x = operand_of(xr);
  if (residual != nullptr) {
    args.residual = operand_of(rr);
    args.sum = sum.data_ptr();
  }
  args.weight = w.data_ptr();
  args.eps = static_cast<float>(eps);
  args.y = y.data_ptr();
  args.rstd = rstd.data_ptr<float>();
  check_launch(kernels::launch_rms_norm_forward(args, c10::cuda::getCurrentCUDAStream().stream()),
               op, "forward");
  return {y, sum, rstd};
}

std::tuple<at::Tensor, at::Tensor> zero_centered_forward_cuda(const at::Tensor& x,
                                                              const at::Tensor& weight,
                                                              double eps) {
  constexpr const char* kOp = "zero_centered_rms_norm";
  check_forward_inputs(kOp, x, "x", nullptr, weight);
  auto [y, sum, rstd] = zero_centered_forward_launch(kOp, x, nullptr, weight, eps);
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> add_zero_centered_forward_cuda(
    const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  constexpr const char* kOp = "add_zero_centered_rms_norm";
  check_forward_inputs(kOp, x, "x", nullptr, weight);
  check_same_as_x(kOp, residual, "residual", x, "x");
  return zero_centered_forward_launch(kOp, x, &residual, weight, eps);
}

// The zero-centred backward; with `grad_sum`, dx also carries the residual stream's
// gradient (Note [RMSNorm with the residual add]).
std::tuple<at::Tensor, at::Tensor> zero_centered_backward_launch(
    const char* op, const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor* grad_sum,
    const at::Tensor& weight, const at::Tensor& rstd) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  const at::ScalarType t = x.scalar_type();
  const bool flatten = needs_flatten(x);
  const at::Tensor xr = rows_of(x, flatten);
  const at::Tensor gr = rows_of(grad_y.to(t), flatten);
  const at::Tensor dsr = grad_sum != nullptr ? rows_of(*grad_sum, flatten) : at::Tensor();
  const at::Tensor rstd_c = rstd.contiguous();
  const auto [w, weight_fp32] = weight_for(weight, t);
  at::Tensor dx = at::empty(x.sizes(), x.options());
  kernels::RmsNormBackwardArgs args;
  args.streaming_only = streaming_kernels();
  args.flavour = kernels::RmsNormFlavour::kZeroCentred;
  args.dtype = norm_dtype(t);
  args.weight_fp32 = weight_fp32;
  args.shape = shape_of(xr);
  args.grad_y = operand_of(gr);
  args.x = operand_of(xr);
  if (grad_sum != nullptr) args.grad_sum = operand_of(dsr);
  args.weight = w.data_ptr();
  args.rstd = rstd_c.data_ptr<float>();
  args.dx = dx.data_ptr();
  at::Tensor dw = launch_backward(args, weight, x, op);
  return {dx, dw};
}

std::tuple<at::Tensor, at::Tensor> zero_centered_backward_cuda(const at::Tensor& grad_y,
                                                               const at::Tensor& x,
                                                               const at::Tensor& weight,
                                                               const at::Tensor& rstd) {
  constexpr const char* kOp = "zero_centered_rms_norm_backward";
  check_backward_inputs(kOp, grad_y, x, "x", nullptr, weight, rstd);
  return zero_centered_backward_launch(kOp, grad_y, x, nullptr, weight, rstd);
}

std::tuple<at::Tensor, at::Tensor> add_zero_centered_backward_cuda(
    const at::Tensor& grad_y, const std::optional<at::Tensor>& grad_sum, const at::Tensor& sum,
    const at::Tensor& weight, const at::Tensor& rstd) {
  constexpr const char* kOp = "add_zero_centered_rms_norm_backward";
  const bool has_grad_sum = check_add_backward_inputs(kOp, grad_y, grad_sum, sum, weight, rstd);
  return zero_centered_backward_launch(kOp, grad_y, sum, has_grad_sum ? &*grad_sum : nullptr,
                                       weight, rstd);
}

std::tuple<at::Tensor, at::Tensor> gated_forward_cuda(const at::Tensor& o, const at::Tensor& z,
                                                      const at::Tensor& weight, double eps,
                                                      at::ScalarType out_dtype) {
  constexpr const char* kOp = "gated_rms_norm";
  check_forward_inputs(kOp, o, "o", &z, weight);
  check_out_dtype(kOp, out_dtype);
  const c10::cuda::CUDAGuard device_guard(o.device());
  // One storage dtype for o, z and y in the kernel; mixed dtypes compute in FP32 (the
  // widening is exact, and FP32 -> out_dtype afterwards is the one rounding the fused
  // store would have made).
  const at::ScalarType t =
      o.scalar_type() == z.scalar_type() && o.scalar_type() == out_dtype ? out_dtype : at::kFloat;
  const bool flatten = needs_flatten(o);
  const at::Tensor orows = rows_of(o.to(t), flatten);
  const at::Tensor zrows = rows_of(z.to(t), flatten);
  const auto [w, weight_fp32] = weight_for(weight, t);
  at::Tensor y = at::empty(o.sizes(), o.options().dtype(t));
  at::Tensor rstd = rstd_like(o);
  kernels::RmsNormForwardArgs args;
  args.streaming_only = streaming_kernels();
  args.flavour = kernels::RmsNormFlavour::kGated;
  args.dtype = norm_dtype(t);
  args.weight_fp32 = weight_fp32;
  args.shape = shape_of(orows);
  args.x = operand_of(orows);
  args.z = operand_of(zrows);
  args.weight = w.data_ptr();
  args.eps = static_cast<float>(eps);
  args.y = y.data_ptr();
  args.rstd = rstd.data_ptr<float>();
  check_launch(kernels::launch_rms_norm_forward(args, c10::cuda::getCurrentCUDAStream().stream()),
               kOp, "forward");
  return {y.to(out_dtype), rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> gated_backward_cuda(const at::Tensor& grad_y,
                                                                   const at::Tensor& o,
                                                                   const at::Tensor& z,
                                                                   const at::Tensor& weight,
                                                                   const at::Tensor& rstd) {
  constexpr const char* kOp = "gated_rms_norm_backward";
  check_backward_inputs(kOp, grad_y, o, "o", &z, weight, rstd);
  const c10::cuda::CUDAGuard device_guard(o.device());
  const at::ScalarType t =
      o.scalar_type() == z.scalar_type() && o.scalar_type() == grad_y.scalar_type()
          ? o.scalar_type()
          : at::kFloat;
  const bool flatten = needs_flatten(o);
  const at::Tensor orows = rows_of(o.to(t), flatten);
  const at::Tensor zrows = rows_of(z.to(t), flatten);
  const at::Tensor grows = rows_of(grad_y.to(t), flatten);
  const at::Tensor rstd_c = rstd.contiguous();
  const auto [w, weight_fp32] = weight_for(weight, t);
  at::Tensor d_o = at::empty(o.sizes(), o.options().dtype(t));
  at::Tensor dz = at::empty(o.sizes(), o.options().dtype(t));
  kernels::RmsNormBackwardArgs args;
  args.streaming_only = streaming_kernels();
  args.flavour = kernels::RmsNormFlavour::kGated;
  args.dtype = norm_dtype(t);
  args.weight_fp32 = weight_fp32;
  args.shape = shape_of(orows);
  args.grad_y = operand_of(grows);
  args.x = operand_of(orows);
  args.z = operand_of(zrows);
  args.weight = w.data_ptr();
  args.rstd = rstd_c.data_ptr<float>();
  args.dx = d_o.data_ptr();
  args.dz = dz.data_ptr();
  at::Tensor dw = launch_backward(args, weight, o, kOp);
  return {d_o.to(o.scalar_type()), dz.to(z.scalar_type()), dw};
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("zero_centered_rms_norm_forward", &zero_centered_forward_cuda);
  m.impl("zero_centered_rms_norm_backward", &zero_centered_backward_cuda);
  m.impl("add_zero_centered_rms_norm_forward", &add_zero_centered_forward_cuda);
  m.impl("add_zero_centered_rms_norm_backward", &add_zero_centered_backward_cuda);
  m.impl("gated_rms_norm_forward", &gated_forward_cuda);
  m.impl("gated_rms_norm_backward", &gated_backward_cuda);
}

}  // namespace gdr
