// CUDA implementation of the RoPE ops (ops/rope/rope_op.h): argument checks, the output in x's
// memory layout, and one launch of kernels/rope/rope.cu each way on the current stream.
// Registered for the CUDA dispatch key; linked into CUDA binaries only (via :cuda_ops).
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "kernels/rope/rope.h"
#include "ops/rope/rope_internal.h"
#include "ops/rope/rope_op.h"

namespace gdr {
namespace {

kernels::RopeDtype rope_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::RopeDtype::kFloat32;
    case at::kHalf: return kernels::RopeDtype::kFloat16;
    case at::kBFloat16: return kernels::RopeDtype::kBFloat16;
    default: TORCH_CHECK(false, "rope: unsupported dtype ", t, " on CUDA");
  }
}

kernels::RopeOperand operand_of(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

at::Tensor run(const char* op, const at::Tensor& in, const at::Tensor& cos, const at::Tensor& sin,
               bool backward) {
  rope_internal::check_inputs(op, in, backward ? "grad_y" : "x", cos, sin);
  const c10::cuda::CUDAGuard device_guard(in.device());
  // The kernel reads rows with any [B, H, T] strides but a contiguous head dim.
  const at::Tensor src = in.stride(3) == 1 || in.size(3) == 1 ? in : in.contiguous();
  // Same memory layout as the input (a transposed [B, T, H, hd] view stays one).
  at::Tensor out = at::empty_like(src, at::MemoryFormat::Preserve);
  if (out.stride(3) != 1) out = at::empty(src.sizes(), src.options());
  const at::Tensor cos_c = cos.contiguous(), sin_c = sin.contiguous();
  kernels::RopeArgs args;
  args.dtype = rope_dtype(src.scalar_type());
  args.batch = src.size(0);
  args.heads = src.size(1);
  args.tokens = src.size(2);
  args.head_dim = static_cast<int>(src.size(3));
  args.rotary = static_cast<int>(cos.size(1));
  args.cos = cos_c.data_ptr<float>();
  args.sin = sin_c.data_ptr<float>();
  args.in = operand_of(src);
  args.out = operand_of(out);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int error = backward ? kernels::launch_rope_backward(args, stream)
                             : kernels::launch_rope_forward(args, stream);
  TORCH_CHECK(error == cudaSuccess, op,
              ": kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
  return out;
}

at::Tensor forward_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return run("rope", x, cos, sin, /*backward=*/false);
}

at::Tensor backward_cuda(const at::Tensor& grad_y, const at::Tensor& cos, const at::Tensor& sin) {
  return run("rope_backward", grad_y, cos, sin, /*backward=*/true);
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("rope", &forward_cuda);
  m.impl("rope_backward", &backward_cuda);
}

}  // namespace gdr
