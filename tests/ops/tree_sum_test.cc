// CPU tests of the pairwise tree sum: the program builder of kernels/tree_sum/tree_sum.h (exact
// step lists), the op's reference evaluation against the leaf-by-leaf definition, and its
// argument errors (exact messages).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "kernels/tree_sum/tree_sum.h"
#include "ops/tree_sum/tree_sum_op.h"
#include "tests/ops/error_of.h"

namespace gdr {
namespace {

using test_support::error_of;

std::string program_of(std::vector<int64_t> counts) {
  kernels::TreeSumArgs args;
  if (!kernels::tree_sum_program(counts.data(), static_cast<int>(counts.size()), &args)) {
    return "refused";
  }
  std::string out;
  for (int k = 0; k < args.step_count; ++k) {
    const kernels::TreeSumStep s = args.steps[k];
    out += s.input >= 0 ? "p" + std::to_string(s.input) + ">" + std::to_string(s.slot)
                        : "m" + std::to_string(s.slot);
    out += " ";
  }
  return out;
}

TEST(TreeSumProgram, IsTheBinaryCounterTree) {
  EXPECT_EQ(program_of({1}), "p0>0 ");
  // ((0 + 1) + (2 + 3))
  EXPECT_EQ(program_of({1, 1, 1, 1}), "p0>0 p1>1 m0 p2>1 p3>2 m1 m0 ");
  // (0 + 1) + 2: the lone third leaf merges at the end.
  EXPECT_EQ(program_of({1, 1, 1}), "p0>0 p1>1 m0 p2>1 m0 ");
  // A partial of 8, one of 4, then three leaves and a last one: the leaves make a 4, which
  // merges with the 4, which merges with the 8.
  EXPECT_EQ(program_of({8, 4, 1, 1, 1, 1}), "p0>0 p1>1 p2>2 p3>3 m2 p4>3 p5>4 m3 m2 m1 m0 ");
  // Partials 8 and 2 and one leaf: nothing equal, so newest into older at the end.
  EXPECT_EQ(program_of({8, 2, 1}), "p0>0 p1>1 p2>2 m1 m0 ");
}

TEST(TreeSumProgram, RefusesWhatTheKernelCannotHold) {
  EXPECT_EQ(program_of({}), "refused");
  EXPECT_EQ(program_of({1, 0}), "refused");
  EXPECT_EQ(program_of(std::vector<int64_t>(17, 1)), "refused");  // > kTreeSumMaxInputs
  // Nine strictly decreasing partial sums need nine slots at once (> kTreeSumMaxSlots).
  EXPECT_EQ(program_of({256, 128, 64, 32, 16, 8, 4, 2, 1}), "refused");
  EXPECT_NE(program_of({128, 64, 32, 16, 8, 4, 2, 1}), "refused");
}

// The definition, with at::add, for inputs holding `counts` leaves each.
at::Tensor add_by_add(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& counts) {
  std::vector<std::pair<int64_t, at::Tensor>> stack;
  auto merge = [&] {
    const auto newer = stack.back();
    stack.pop_back();
    stack.back() = {stack.back().first + newer.first, at::add(stack.back().second, newer.second)};
  };
  for (size_t i = 0; i < inputs.size(); ++i) {
    stack.emplace_back(counts[i], inputs[i].to(at::kFloat));
    while (stack.size() >= 2 && stack.back().first == stack[stack.size() - 2].first) merge();
  }
  while (stack.size() >= 2) merge();
  return stack.back().second;
}

TEST(TreeSumOp, CpuGivesTheAddByAddBitsForMixedDtypesAndCounts) {
  at::manual_seed(7);
  const std::vector<std::vector<int64_t>> patterns = {
      {1}, {1, 1}, {1, 1, 1}, {4, 1, 1, 1, 1}, {8, 2, 1}, {2, 1, 1, 1, 1, 1, 1, 1, 1}};
  const at::ScalarType dtypes[] = {at::kFloat, at::kBFloat16, at::kHalf};
  for (const auto& counts : patterns) {
    std::vector<at::Tensor> inputs;
    for (size_t i = 0; i < counts.size(); ++i) {
      const at::Tensor x = at::randn({3, 41}) * at::pow(10.0, at::randint(-3, 4, {3, 41}));
      inputs.push_back(x.to(dtypes[i % 3]));
    }
    const at::Tensor out = at::empty({3, 41});
    pairwise_tree_sum_out(inputs, counts, out);
    EXPECT_TRUE(at::equal(out, add_by_add(inputs, counts))) << counts.size() << " inputs";
  }
}

TEST(TreeSumOp, OutMayBeTheFirstInput) {
  const at::Tensor a = at::randn({100}) * 1e4, b = at::randn({100}), c = at::randn({100});
  const at::Tensor want = add_by_add({a, b, c}, {2, 1, 1});
  pairwise_tree_sum_out({a, b, c}, {2, 1, 1}, a);
  EXPECT_TRUE(at::equal(a, want));
}

TEST(TreeSumOp, BadArgumentsAreRefusedNamingThem) {
  const at::Tensor out = at::empty({4});
  EXPECT_EQ(error_of([&] { pairwise_tree_sum_out({}, {}, out); }),
            "pairwise_tree_sum_out: expected at least one input");
  EXPECT_EQ(error_of([&] {
              pairwise_tree_sum_out({at::ones({4})}, {1, 1}, out);
            }),
            "pairwise_tree_sum_out: expected 1 leaf counts (one per input) but got 2");
  EXPECT_EQ(
      error_of([&] { pairwise_tree_sum_out({at::ones({4})}, {1}, at::empty({4}, at::kHalf)); }),
      "pairwise_tree_sum_out: expected out of dtype Float but got Half");
  EXPECT_EQ(error_of([&] {
              pairwise_tree_sum_out({at::ones({4}), at::ones({4})}, {1, 0}, out);
            }),
            "pairwise_tree_sum_out: expected leaf_counts[1] >= 1 but got 0");
  EXPECT_EQ(error_of([&] { pairwise_tree_sum_out({at::ones({4}, at::kDouble)}, {1}, out); }),
            "pairwise_tree_sum_out: expected inputs[0] of dtype Float, BFloat16 or Half but got "
            "Double");
  EXPECT_EQ(error_of([&] {
              pairwise_tree_sum_out({at::ones({4}), at::ones({2, 2})}, {1, 1}, out);
            }),
            "pairwise_tree_sum_out: expected inputs[1] of out's shape [4] but got [2, 2]");
}

}  // namespace
}  // namespace gdr
