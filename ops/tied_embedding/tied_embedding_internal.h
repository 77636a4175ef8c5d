// Shared by the CPU and CUDA implementations of the tied embedding ops; not a public API.
#pragma once

#include <ATen/core/Tensor.h>

namespace gdr::tied_embedding_internal {

// tied_embedding_add_rows_'s argument checks; messages name the argument and say what was
// expected and what was given.
void check_add_rows_inputs(const at::Tensor& grad_weight, const at::Tensor& ids,
                           const at::Tensor& rows);

}  // namespace gdr::tied_embedding_internal
