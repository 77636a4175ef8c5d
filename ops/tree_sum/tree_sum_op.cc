// The pairwise tree sum op (ops/tree_sum/tree_sum_op.h): schema, checks, the reference evaluation
// (CPU implementation). The CUDA implementation registers itself from
// ops/tree_sum/tree_sum_op_cuda.cc.
#include "ops/tree_sum/tree_sum_op.h"

#include <ATen/ops/add.h>
#include <c10/core/DispatchKeySet.h>
#include <torch/library.h>

#include <utility>

namespace gdr {
namespace tree_sum_internal {

void check_inputs(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& leaf_counts,
                  const at::Tensor& out) {
  TORCH_CHECK(!inputs.empty(), "pairwise_tree_sum_out: expected at least one input");
  TORCH_CHECK(inputs.size() == leaf_counts.size(), "pairwise_tree_sum_out: expected ",
              inputs.size(), " leaf counts (one per input) but got ", leaf_counts.size());
  TORCH_CHECK(out.scalar_type() == at::kFloat,
              "pairwise_tree_sum_out: expected out of dtype Float but got ", out.scalar_type());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    TORCH_CHECK(leaf_counts[i] >= 1, "pairwise_tree_sum_out: expected leaf_counts[", i,
                "] >= 1 but got ", leaf_counts[i]);
    TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                    t.scalar_type() == at::kHalf,
                "pairwise_tree_sum_out: expected inputs[", i,
                "] of dtype Float, BFloat16 or Half but got ", t.scalar_type());
    TORCH_CHECK(t.sizes() == out.sizes(), "pairwise_tree_sum_out: expected inputs[", i,
                "] of out's shape ", out.sizes(), " but got ", t.sizes());
    TORCH_CHECK(t.device() == out.device(), "pairwise_tree_sum_out: expected inputs[", i,
                "] on out's device ", out.device(), " but got ", t.device());
  }
}

void tree_sum_reference(const std::vector<at::Tensor>& inputs,
                        const std::vector<int64_t>& leaf_counts, const at::Tensor& out) {
  std::vector<std::pair<int64_t, at::Tensor>> stack;  // (leaves, FP32 partial sum)
  auto merge_newest = [&] {
    at::Tensor newer = std::move(stack.back().second);
    const int64_t leaves = stack.back().first;
    stack.pop_back();
    stack.back().second = at::add(stack.back().second, newer);  // out of place: inputs kept
    stack.back().first += leaves;
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    stack.emplace_back(leaf_counts[i], inputs[i].to(at::kFloat));  // exact widening
    while (stack.size() >= 2 && stack[stack.size() - 1].first == stack[stack.size() - 2].first) {
      merge_newest();
    }
  }
  while (stack.size() >= 2) merge_newest();
  if (!stack.back().second.is_same(out)) out.copy_(stack.back().second);
}

}  // namespace tree_sum_internal

namespace {

void tree_sum_cpu(at::TensorList inputs, at::IntArrayRef leaf_counts, const at::Tensor& out) {
  const std::vector<at::Tensor> in = inputs.vec();
  const std::vector<int64_t> counts = leaf_counts.vec();
  tree_sum_internal::check_inputs(in, counts, out);
  tree_sum_internal::tree_sum_reference(in, counts, out);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def("pairwise_tree_sum_out(Tensor[] inputs, int[] leaf_counts, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) { m.impl("pairwise_tree_sum_out", &tree_sum_cpu); }

void pairwise_tree_sum_out(const std::vector<at::Tensor>& inputs,
                           const std::vector<int64_t>& leaf_counts, const at::Tensor& out) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::pairwise_tree_sum_out", "")
                             .typed<void(at::TensorList, at::IntArrayRef, const at::Tensor&)>();
  op.call(inputs, leaf_counts, out);
}

}  // namespace gdr
