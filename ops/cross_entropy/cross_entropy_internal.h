// Shared by the CPU and CUDA implementations of the cross-entropy ops; not a public API.
#pragma once

#include <ATen/core/Tensor.h>

namespace gdr::cross_entropy_internal {

// Argument checks at the op boundary; messages name the op and the argument and say what
// was expected and what was given.
// The math type of the CPU op and the composite, and the dtype of lse and count: FP64 for
// Double logits (CPU only), FP32 otherwise.
at::ScalarType compute_type(const at::Tensor& logits);

void check_inputs(const char* op, const at::Tensor& logits, const at::Tensor& labels);
void check_backward_inputs(const char* op, const at::Tensor& grad_loss, const at::Tensor& logits,
                           const at::Tensor& labels, const at::Tensor& lse,
                           const at::Tensor& count);

// See Note [Cross-entropy target check]: `targets` are labels[:, 1:] as a CPU int64 tensor
// [B, T - 1]; the first one outside [0, vocab) that is not ignore_index is an error
// naming its value, its position in labels and V.
void check_targets(const char* op, const at::Tensor& targets, int64_t vocab, int64_t ignore_index);

}  // namespace gdr::cross_entropy_internal
