// CUDA implementation of tied_embedding_add_rows_ (ops/tied_embedding/tied_embedding_op.h):
// argument checks and one launch of kernels/tied_embedding/embedding_rows.cu on the current stream;
// allocates nothing. Registered for the CUDA dispatch key; linked into CUDA binaries only (via
// :cuda_ops).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "kernels/tied_embedding/embedding_rows.h"
#include "ops/tied_embedding/tied_embedding_internal.h"
#include "ops/tied_embedding/tied_embedding_op.h"

namespace gdr {
namespace {

kernels::EmbeddingRowsDtype rows_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::EmbeddingRowsDtype::kFloat32;
    case at::kHalf: return kernels::EmbeddingRowsDtype::kFloat16;
    case at::kBFloat16: return kernels::EmbeddingRowsDtype::kBFloat16;
    default: TORCH_CHECK(false, "tied_embedding_add_rows_: unsupported dtype ", t, " on CUDA");
  }
}

void add_rows_cuda(at::Tensor& grad_weight, const at::Tensor& ids, const at::Tensor& rows) {
  tied_embedding_internal::check_add_rows_inputs(grad_weight, ids, rows);
  const c10::cuda::CUDAGuard device_guard(grad_weight.device());
  const at::Tensor ids_c = ids.contiguous();
  kernels::EmbeddingRowsArgs args;
  args.dtype = rows_dtype(grad_weight.scalar_type());
  args.tokens = ids.size(0);
  args.hidden = grad_weight.size(1);
  args.vocab = grad_weight.size(0);
  if (args.tokens > 0 && args.hidden > 0) {
    args.ids = ids_c.data_ptr<int64_t>();
    args.rows = rows.data_ptr();
    args.dw = grad_weight.data_ptr();
  }
  const int error =
      kernels::launch_add_token_rows(args, c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(error == cudaSuccess, "tied_embedding_add_rows_: launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(error)));
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) { m.impl("tied_embedding_add_rows_", &add_rows_cuda); }

}  // namespace gdr
