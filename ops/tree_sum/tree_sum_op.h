// pairwise_tree_sum_out: the sum of a few same-shaped tensors by the fixed binary-counter
// tree of Note [Gradient reduction tree] (gdr/distributed.h), written to an FP32 `out`.
// inputs[i] holds leaf_counts[i] leaves (a partial sum of that many, or 1 for a leaf);
// the tree pushes the inputs in order, merges the two newest partial sums whenever they
// hold equally many leaves (older += newer), then merges what is left, newest into older.
// Each merge is one FP32 add (16-bit inputs widen exactly), so the result has the bits of
// the add-by-add evaluation with at::add; PairwiseSum relies on that.
//
// CPU: that evaluation (the reference). CUDA: one pass of kernels/tree_sum/tree_sum.h (each input
// read once, out written once) when every operand is contiguous and the tree fits the
// kernel (at most kTreeSumMaxInputs inputs, kTreeSumMaxSlots partial sums at once),
// else the reference. Deterministic by construction either way.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace gdr {

// inputs: Float, BFloat16 or Half, all of out's shape and device; out: Float, may be one
// of the Float inputs (it is read before it is written). Errors name the argument.
void pairwise_tree_sum_out(const std::vector<at::Tensor>& inputs,
                           const std::vector<int64_t>& leaf_counts, const at::Tensor& out);

namespace tree_sum_internal {
// Argument checks shared by both devices (TORCH_CHECK with the op's name).
void check_inputs(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& leaf_counts,
                  const at::Tensor& out);
// The add-by-add evaluation (the CPU implementation and the CUDA fallback).
void tree_sum_reference(const std::vector<at::Tensor>& inputs,
                        const std::vector<int64_t>& leaf_counts, const at::Tensor& out);
}  // namespace tree_sum_internal

}  // namespace gdr
