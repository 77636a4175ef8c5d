#include "ops/packed/packed_documents.h"

#include <ATen/ops/split_with_sizes.h>
#include <c10/util/Exception.h>

namespace gdr {

void check_cu_seqlens(const char* op, const std::vector<int64_t>& cu_seqlens, int64_t tokens) {
  TORCH_CHECK(cu_seqlens.size() >= 2, op,
              ": expected cu_seqlens with at least 2 offsets (one document) but got ",
              cu_seqlens.size());
  TORCH_CHECK(cu_seqlens.front() == 0 && cu_seqlens.back() == tokens, op,
              ": expected cu_seqlens to run from 0 to T = ", tokens, " but got ",
              cu_seqlens.front(), " .. ", cu_seqlens.back());
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    TORCH_CHECK(cu_seqlens[i] >= cu_seqlens[i - 1], op,
                ": expected non-decreasing cu_seqlens but offset ", i, " (", cu_seqlens[i],
                ") < offset ", i - 1, " (", cu_seqlens[i - 1], ")");
  }
}

std::vector<int64_t> document_lengths(const std::vector<int64_t>& cu_seqlens) {
  std::vector<int64_t> lengths;
  for (size_t i = 1; i < cu_seqlens.size(); ++i) {
    lengths.push_back(cu_seqlens[i] - cu_seqlens[i - 1]);
  }
  return lengths;
}

std::vector<at::Tensor> split_documents(const char* op, const at::Tensor& x, int64_t dim,
                                        const std::vector<int64_t>& cu_seqlens) {
  TORCH_CHECK(x.defined() && dim >= 0 && dim < x.dim(), op, ": expected a tensor with dim ", dim,
              " to split into documents but got shape ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  check_cu_seqlens(op, cu_seqlens, x.size(dim));
  return at::split_with_sizes(x, document_lengths(cu_seqlens), dim);
}

}  // namespace gdr
