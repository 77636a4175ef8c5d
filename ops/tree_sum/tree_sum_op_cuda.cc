// CUDA implementation of the pairwise tree sum (ops/tree_sum/tree_sum_op.h): one launch of
// kernels/tree_sum/tree_sum.h on the current stream when every operand is contiguous and the tree
// fits the kernel, else the reference evaluation (the same bits). Registered for the CUDA
// dispatch key; linked into CUDA binaries only (via :cuda_ops).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "kernels/tree_sum/tree_sum.h"
#include "ops/tree_sum/tree_sum_op.h"

namespace gdr {
namespace {

kernels::TreeSumDtype tree_sum_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::TreeSumDtype::kFloat32;
    case at::kBFloat16: return kernels::TreeSumDtype::kBFloat16;
    default: return kernels::TreeSumDtype::kFloat16;  // check_inputs allows no other
  }
}

void tree_sum_cuda(at::TensorList inputs, at::IntArrayRef leaf_counts, const at::Tensor& out) {
  const std::vector<at::Tensor> in = inputs.vec();
  const std::vector<int64_t> counts = leaf_counts.vec();
  tree_sum_internal::check_inputs(in, counts, out);
  const c10::cuda::CUDAGuard device_guard(out.device());
  kernels::TreeSumArgs args;
  bool fits = out.is_contiguous() &&
              kernels::tree_sum_program(counts.data(), static_cast<int>(counts.size()), &args);
  for (size_t i = 0; fits && i < in.size(); ++i) fits = in[i].is_contiguous();
  if (!fits) {
    tree_sum_internal::tree_sum_reference(in, counts, out);
    return;
  }
  for (size_t i = 0; i < in.size(); ++i) {
    args.inputs[i] = in[i].data_ptr();
    args.dtypes[i] = tree_sum_dtype(in[i].scalar_type());
  }
  args.numel = out.numel();
  args.out = out.data_ptr<float>();
  const int error = kernels::launch_tree_sum(args, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error == cudaSuccess, "pairwise_tree_sum_out: kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(error)));
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) { m.impl("pairwise_tree_sum_out", &tree_sum_cuda); }

}  // namespace gdr
