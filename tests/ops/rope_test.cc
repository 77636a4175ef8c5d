// CPU tests of the partial RoPE ops (ops/rope/rope_op.h): the fused op's CPU implementation and its
// autograd against the composite's (the same ATen formulas: the same values), the
// GDR_ROPE switch, and the argument checks' exact messages. The composite itself is checked
// from the spec in tests/models/model_test.cc (PartialRope).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "ops/policy/execution_policy.h"
#include "ops/rope/rope_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::error_of;

struct Result {
  at::Tensor y, dx;
};

Result run(bool fused, const at::Tensor& x_in, const at::Tensor& dy, int64_t rotary) {
  at::Tensor x = x_in.detach().requires_grad_(true);
  const at::Tensor y =
      fused ? partial_rope_fused(x, rotary, 1e4) : partial_rope_composite(x, rotary, 1e4);
  return {y.detach(), torch::autograd::grad({y}, {x}, {dy})[0]};
}

TEST(RopeCpu, FusedOpGivesTheCompositeValues) {
  at::manual_seed(3);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (int64_t rotary : {2, 8, 16}) {
      // The model's layout: a transposed [B, T, H, hd] view.
      const at::Tensor x = at::randn({2, 9, 3, 16}).to(dtype).transpose(1, 2);
      const at::Tensor dy = at::randn({2, 3, 9, 16}).to(dtype);
      const Result fused = run(true, x, dy, rotary), composite = run(false, x, dy, rotary);
      EXPECT_TRUE(bitwise_equal(fused.y, composite.y)) << dtype << " rotary " << rotary;
      EXPECT_TRUE(at::equal(fused.dx, composite.dx)) << dtype << " rotary " << rotary;
    }
  }
}

TEST(RopeCpu, SwitchAndArgumentErrors) {
  {
    const test_support::PolicyForTest policy("GDR_ROPE", "composite");
    EXPECT_EQ(current_execution_policy().rope, RopeImpl::kComposite);
  }
  EXPECT_EQ(test_support::policy_error("GDR_ROPE", "slow"),
            "GDR_ROPE: expected fused or composite, but got 'slow'");
  const at::Tensor x = at::zeros({1, 2, 5, 8});
  EXPECT_EQ(error_of([&] { partial_rope_fused(x, 3, 1e4); }),
            "partial_rope: expected an even rotary_dim in (0, 8] but got 3");
  const auto [cos, sin] = rope_tables(5, 4, 1e4, x.options());
  EXPECT_EQ(error_of([&] {
              rope_forward(at::zeros({1, 2, 6, 8}), cos, sin);
            }),
            "rope: expected cos of shape [T, rotary_dim] with T = 6 and an even rotary_dim in [2, "
            "8], but got [5, 4]");
  EXPECT_EQ(error_of([&] { rope_forward(x.to(at::kInt), cos, sin); }),
            "rope: expected x of dtype Float, Half, BFloat16 or Double, but got Int");
  EXPECT_EQ(error_of([&] { rope_backward(x, cos.to(at::kDouble), sin); }),
            "rope_backward: expected cos of dtype Float on cpu but got Double on cpu");
}

}  // namespace
}  // namespace gdr
