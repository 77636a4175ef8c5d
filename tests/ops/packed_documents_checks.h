// The packed-documents checks shared by the CPU and GPU tests (Note [Packed documents] in
// ops/packed/packed_documents.h): an op's *_varlen entry point on documents packed along one
// dim against the op on each document alone, bit for bit, outputs and input gradients.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <functional>
#include <string>
#include <vector>

#include "tests/ops/bitwise_equal.h"

namespace gdr::test_support {

// An input of the op: `time_dim` is the dim the documents are packed along, or -1 for an
// input every document shares (a weight), which is passed whole to every call.
struct PackedInput {
  std::string name;
  at::Tensor value;
  int64_t time_dim = -1;
};

using PackedOp = std::function<at::Tensor(const std::vector<at::Tensor>&)>;

// Runs `packed` on the whole inputs and `alone` on each non-empty document's slices (fresh
// contiguous copies: each document really alone), both with autograd and one fixed output
// gradient, and expects bit-identical outputs and gradients of the packed inputs; a shared
// input's gradient is the sum of the documents' (in autograd's order), so it is compared to
// their sum within `shared_rtol` of its largest magnitude. Every packed-input gradient must be
// non-zero somewhere, so that the comparison is not vacuous.
inline void expect_packed_equals_alone(const std::vector<PackedInput>& inputs,
                                       int64_t output_time_dim,
                                       const std::vector<int64_t>& cu_seqlens,
                                       const PackedOp& packed, const PackedOp& alone,
                                       double shared_rtol = 1e-5) {
  std::vector<at::Tensor> leaves;
  for (const PackedInput& in : inputs) leaves.push_back(in.value.detach().clone().requires_grad_());
  const at::Tensor y = packed(leaves);
  at::manual_seed(4242);
  const at::Tensor grad_y = at::randn(y.sizes(), y.options().requires_grad(false));
  const std::vector<at::Tensor> grads = torch::autograd::grad({y}, leaves, {grad_y});

  std::vector<at::Tensor> shared_sums(inputs.size());
  for (size_t d = 0; d + 1 < cu_seqlens.size(); ++d) {
    const int64_t start = cu_seqlens[d], length = cu_seqlens[d + 1] - start;
    if (length == 0) continue;
    std::vector<at::Tensor> doc_leaves;
    for (const PackedInput& in : inputs) {
      const at::Tensor v = in.time_dim < 0 ? in.value : in.value.narrow(in.time_dim, start, length);
      doc_leaves.push_back(v.detach().contiguous().clone().requires_grad_());
    }
    const at::Tensor y_doc = alone(doc_leaves);
    EXPECT_TRUE(bitwise_equal(y.narrow(output_time_dim, start, length), y_doc))
        << "output of document " << d << " [" << start << ", " << start + length << ")";
    const std::vector<at::Tensor> doc_grads = torch::autograd::grad(
        {y_doc}, doc_leaves, {grad_y.narrow(output_time_dim, start, length).contiguous()});
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (inputs[i].time_dim < 0) {
        shared_sums[i] = shared_sums[i].defined() ? shared_sums[i] + doc_grads[i] : doc_grads[i];
        continue;
      }
      EXPECT_TRUE(bitwise_equal(grads[i].narrow(inputs[i].time_dim, start, length), doc_grads[i]))
          << "gradient of " << inputs[i].name << ", document " << d;
    }
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    EXPECT_GT(grads[i].abs().max().item<double>(), 0.0) << inputs[i].name;
    if (inputs[i].time_dim >= 0) continue;
    const double scale = shared_sums[i].abs().max().item<double>();
    const double diff =
        (grads[i].to(at::kDouble) - shared_sums[i].to(at::kDouble)).abs().max().item<double>();
    EXPECT_LE(diff, shared_rtol * scale) << "gradient of the shared " << inputs[i].name;
  }
}

// True when `op` run on the packed inputs without the documents' bounds (one sequence) gives
// other values than `packed` somewhere: the boundaries matter, so the check above can fail.
inline bool boundaries_change_the_output(const std::vector<PackedInput>& inputs,
                                         const PackedOp& packed, const PackedOp& unbounded) {
  std::vector<at::Tensor> values;
  for (const PackedInput& in : inputs) values.push_back(in.value);
  at::NoGradGuard no_grad;
  return !bitwise_equal(packed(values), unbounded(values));
}

}  // namespace gdr::test_support
