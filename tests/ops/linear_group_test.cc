// CPU tests of the linear group op (ops/linear_group/linear_group_op.h): forward outputs and weight
// gradients against the composite's bits (one at::linear per weight, autograd through
// them), the input gradient against the composite within a stated FP64 bound and against
// a sum written from the spec, unused outputs, weights without gradients, the
// GDR_LINEAR_GROUP switch and the argument checks' exact messages.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <string>
#include <vector>

#include "ops/linear_group/linear_group_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"
#include "tests/ops/linear_group_run.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::error_of;
using test_support::LinearGroupResult;
using test_support::run_linear_group;

// A GDN-like group at small size: qkv, z, b, a of one x [B, T, in].
struct Case {
  at::Tensor x;
  std::vector<at::Tensor> weights, dys;
};

Case make_case(at::ScalarType dtype, uint64_t seed, std::vector<int64_t> x_shape = {2, 5, 16}) {
  at::manual_seed(seed);
  const int64_t in = x_shape.back();
  Case c;
  c.x = at::randn(x_shape).to(dtype);
  std::vector<int64_t> y_shape = x_shape;
  for (int64_t out : {24, 8, 3, 3}) {
    c.weights.push_back((at::randn({out, in}) / 4).to(dtype));
    y_shape.back() = out;
    c.dys.push_back(at::randn(y_shape).to(dtype));
  }
  return c;
}

void expect_same_bits(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& ref,
                      const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(got[i], ref[i])) << what << "[" << i << "]";
  }
}

// The bound for dX in FP64: the two differ only in how the products' sum is rounded
// (inside the GEMM vs. a separate add), so by a few FP64 ulps of the largest element.
void expect_fp64_close(const at::Tensor& got, const at::Tensor& ref, const std::string& what) {
  ASSERT_TRUE(got.defined() && ref.defined()) << what;
  ASSERT_EQ(got.sizes(), ref.sizes()) << what;
  const double scale = ref.abs().max().item<double>();
  EXPECT_LE((got - ref).abs().max().item<double>(), 1e-13 * scale) << what;
}

TEST(LinearGroupCpu, ForwardGivesTheBitsOfAtLinear) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const Case c = make_case(dtype, 1);
    const std::vector<at::Tensor> ys = linear_group(c.x, c.weights);
    ASSERT_EQ(ys.size(), c.weights.size());
    for (size_t i = 0; i < ys.size(); ++i) {
      EXPECT_TRUE(at::equal(ys[i], at::linear(c.x, c.weights[i]))) << dtype << " y" << i;
      EXPECT_TRUE(bitwise_equal(ys[i], at::linear(c.x, c.weights[i]))) << dtype << " y" << i;
    }
  }
}

TEST(LinearGroupCpu, ForwardAndWeightGradsAreTheCompositeBits) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const Case c = make_case(dtype, 2);
    const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys);
    const LinearGroupResult composite = run_linear_group(false, c.x, c.weights, c.dys);
    expect_same_bits(fused.ys, composite.ys, "y");
    expect_same_bits(fused.grad_weights, composite.grad_weights, "dW");
    EXPECT_EQ(fused.grad_x.sizes(), c.x.sizes());
  }
}

// x of 2 dims, 1 dim, and 3 dims whose leading dims do not fold into rows as a view
// (matmul folds it by a copy when the weight requires a gradient: Note [Linear group bits]).
TEST(LinearGroupCpu, OtherInputLayoutsGiveTheCompositeBits) {
  std::vector<std::pair<std::string, Case>> cases;
  cases.emplace_back("2-D", make_case(at::kFloat, 3, {7, 16}));
  cases.emplace_back("1-D", make_case(at::kFloat, 4, {16}));
  {
    Case c = make_case(at::kFloat, 5, {5, 2, 16});
    c.x = c.x.transpose(0, 1);  // [2, 5, 16], leading dims not foldable
    for (at::Tensor& dy : c.dys) dy = dy.transpose(0, 1).contiguous();
    cases.emplace_back("unfoldable 3-D", c);
  }
  for (const auto& [name, c] : cases) {
    for (bool weights_need_grad : {true, false}) {
      const std::vector<bool> needs(c.weights.size(), weights_need_grad);
      const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys, needs);
      const LinearGroupResult composite = run_linear_group(false, c.x, c.weights, c.dys, needs);
      const std::string what = name + (weights_need_grad ? "" : ", weights without grad");
      expect_same_bits(fused.ys, composite.ys, what + ": y");
      expect_same_bits(fused.grad_weights, composite.grad_weights, what + ": dW");
      EXPECT_EQ(fused.grad_x.sizes(), c.x.sizes()) << what;
      EXPECT_LE((fused.grad_x - composite.grad_x).abs().max().item<float>(),
                1e-5 * composite.grad_x.abs().max().item<float>())
          << what;
    }
  }
}

// dX differs from the composite only in the rounding of the sum (Note [Linear group input
// gradient]); in FP64 both are within 1e-13 of the largest element of each other and of
// sum_i dY_i @ W_i written from the spec (an independent check).
TEST(LinearGroupCpu, InputGradIsTheSumOfTheProductsInFp64) {
  const Case c = make_case(at::kDouble, 6);
  const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys);
  const LinearGroupResult composite = run_linear_group(false, c.x, c.weights, c.dys);
  expect_fp64_close(fused.grad_x, composite.grad_x, "dX vs composite");
  at::Tensor spec = at::zeros_like(c.x);
  for (size_t i = 0; i < c.weights.size(); ++i) {
    spec += at::einsum("bto,oi->bti", {c.dys[i], c.weights[i]});
  }
  expect_fp64_close(fused.grad_x, spec, "dX vs spec");
  expect_same_bits(fused.grad_weights, composite.grad_weights, "dW");
}

// One used output: dX is that one product, the composite's bits too.
TEST(LinearGroupCpu, OneUsedOutputGivesTheCompositeBits) {
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    Case c = make_case(dtype, 7);
    for (size_t i = 0; i < c.dys.size(); ++i) {
      if (i != 1) c.dys[i] = at::Tensor();
    }
    const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys);
    const LinearGroupResult composite = run_linear_group(false, c.x, c.weights, c.dys);
    EXPECT_TRUE(bitwise_equal(fused.grad_x, composite.grad_x)) << dtype;
    expect_same_bits(fused.grad_weights, composite.grad_weights, "dW");
    EXPECT_FALSE(fused.grad_weights[0].defined());
    EXPECT_TRUE(fused.grad_weights[1].defined());
  }
}

// The products enter dX in order of increasing out_i, ties in index order (Note [Linear
// group input gradient]): here out = {24, 8, 3, 3}, so W_2, W_3, W_1, W_0.
TEST(LinearGroupCpu, InputGradAddsTheProductsInIncreasingWidth) {
  const Case c = make_case(at::kBFloat16, 12);
  const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys);
  auto rows = [](const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); };
  at::Tensor dx = rows(c.dys[2]).mm(c.weights[2]);
  for (int i : {3, 1, 0}) dx.addmm_(rows(c.dys[i]), c.weights[i], 1, 1);
  EXPECT_TRUE(bitwise_equal(fused.grad_x, dx.view(c.x.sizes())));
}

// BF16 error of dX against FP64 from the same BF16 operands (Frobenius, relative), on a
// GDN-like group: no larger than the composite's (measured 0.7-0.8x of it on the CPU).
TEST(LinearGroupCpu, InputGradInBf16IsNoLessAccurateThanTheComposite) {
  at::manual_seed(13);
  const int64_t in = 256;
  Case c;
  c.x = at::randn({1, 128, in}).to(at::kBFloat16);
  for (int64_t out : {1536, 512, 16, 16}) {
    c.weights.push_back((at::randn({out, in}) / 16).to(at::kBFloat16));
    c.dys.push_back(at::randn({1, 128, out}).to(at::kBFloat16));
  }
  at::Tensor ref = at::zeros({1, 128, in}, at::kDouble);
  for (size_t i = 0; i < c.weights.size(); ++i) {
    ref += at::matmul(c.dys[i].to(at::kDouble), c.weights[i].to(at::kDouble));
  }
  auto error = [&](const at::Tensor& dx) {
    return (dx.to(at::kDouble) - ref).norm().item<double>() / ref.norm().item<double>();
  };
  const double fused = error(run_linear_group(true, c.x, c.weights, c.dys).grad_x);
  const double composite = error(run_linear_group(false, c.x, c.weights, c.dys).grad_x);
  EXPECT_LE(fused, composite) << "fused " << fused << ", composite " << composite;
  EXPECT_LE(fused, 1e-2);
}

TEST(LinearGroupCpu, UnusedOutputsGetNoGradient) {
  Case c = make_case(at::kDouble, 8);
  c.dys[0] = at::Tensor();  // the first product is not the one that starts dX
  c.dys[3] = at::Tensor();
  const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys);
  const LinearGroupResult composite = run_linear_group(false, c.x, c.weights, c.dys);
  expect_same_bits(fused.grad_weights, composite.grad_weights, "dW");
  EXPECT_FALSE(fused.grad_weights[0].defined());
  EXPECT_FALSE(fused.grad_weights[3].defined());
  expect_fp64_close(fused.grad_x, composite.grad_x, "dX");
  const at::Tensor spec = at::einsum("bto,oi->bti", {c.dys[1], c.weights[1]}) +
                          at::einsum("bto,oi->bti", {c.dys[2], c.weights[2]});
  expect_fp64_close(fused.grad_x, spec, "dX vs spec");
}

TEST(LinearGroupCpu, WeightsAndInputWithoutGradGetNone) {
  const Case c = make_case(at::kFloat, 9);
  const std::vector<bool> needs{true, false, true, false};
  const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys, needs);
  const LinearGroupResult composite = run_linear_group(false, c.x, c.weights, c.dys, needs);
  expect_same_bits(fused.grad_weights, composite.grad_weights, "dW");
  EXPECT_TRUE(fused.grad_x.defined());

  // Through backward(): a weight that needs no gradient keeps none; x without one too.
  const at::Tensor x = c.x.detach();
  std::vector<at::Tensor> weights;
  for (size_t i = 0; i < c.weights.size(); ++i) {
    weights.push_back(c.weights[i].detach().requires_grad_(needs[i]));
  }
  const std::vector<at::Tensor> ys = linear_group(x, weights);
  at::Tensor loss = at::zeros({});
  for (const at::Tensor& y : ys) loss = loss + y.sum();
  loss.backward();
  EXPECT_FALSE(x.grad().defined());
  for (size_t i = 0; i < weights.size(); ++i) {
    EXPECT_EQ(weights[i].grad().defined(), needs[i]) << i;
  }
  const LinearGroupResult no_x =
      run_linear_group(true, c.x, c.weights, c.dys, needs, /*x_needs_grad=*/false);
  expect_same_bits(no_x.grad_weights, composite.grad_weights, "dW, x without grad");
}

TEST(LinearGroupCpu, NoGradModeGivesTheSameOutputs) {
  const Case c = make_case(at::kFloat, 10);
  std::vector<at::Tensor> weights;
  for (const at::Tensor& w : c.weights) weights.push_back(w.detach().requires_grad_(true));
  at::NoGradGuard no_grad;
  const std::vector<at::Tensor> ys = linear_group(c.x, weights);
  for (size_t i = 0; i < ys.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(ys[i], at::linear(c.x, weights[i]))) << i;
    EXPECT_FALSE(ys[i].requires_grad());
  }
}

TEST(LinearGroupCpu, SwitchSelectsTheImplementation) {
  const Case c = make_case(at::kFloat, 11);
  std::vector<at::Tensor> weights;
  for (const at::Tensor& w : c.weights) weights.push_back(w.detach().requires_grad_(true));
  auto node_name = [&] { return project(c.x, weights)[0].grad_fn()->name(); };
  {
    const test_support::PolicyForTest policy("GDR_LINEAR_GROUP", "");
    EXPECT_EQ(current_execution_policy().linear_group, LinearGroupImpl::kFused);
  }
  {
    const test_support::PolicyForTest policy("GDR_LINEAR_GROUP", "fused");
    EXPECT_EQ(current_execution_policy().linear_group, LinearGroupImpl::kFused);
    EXPECT_NE(node_name().find("LinearGroupFunction"), std::string::npos) << node_name();
  }
  {
    const test_support::PolicyForTest policy("GDR_LINEAR_GROUP", "composite");
    EXPECT_EQ(current_execution_policy().linear_group, LinearGroupImpl::kComposite);
    EXPECT_EQ(node_name().find("LinearGroupFunction"), std::string::npos) << node_name();
    expect_same_bits(project(c.x, weights), linear_group(c.x, weights), "y");
  }
  EXPECT_EQ(test_support::policy_error("GDR_LINEAR_GROUP", "fast"),
            "GDR_LINEAR_GROUP: expected fused or composite, but got 'fast'");
}

TEST(LinearGroupCpu, ArgumentErrorsNameTheArgument) {
  const at::Tensor x = at::zeros({2, 3, 8});
  const at::Tensor w = at::zeros({4, 8});
  EXPECT_EQ(error_of([&] { linear_group(x, {}); }),
            "linear_group: expected at least one weight, but got none");
  EXPECT_EQ(error_of([&] {
              linear_group(x, {w, at::zeros({2, 4, 8})});
            }),
            "linear_group: expected weights[1] of 2 dims [out, in], but got 3 (shape [2, 4, 8])");
  EXPECT_EQ(
      error_of([&] {
        linear_group(x, {w, at::zeros({4, 7})});
      }),
      "linear_group: expected weights[1] of shape [out, 8] (in = x.size(-1)), but got [4, 7]");
  EXPECT_EQ(error_of([&] {
              linear_group(x, {at::zeros({4, 8}, at::kBFloat16)});
            }),
            "linear_group: expected weights[0] of dtype Float (x's), but got BFloat16");
  EXPECT_EQ(error_of([&] {
              linear_group(x, {w, at::zeros({4, 8}, at::device(at::kMeta))});
            }),
            "linear_group: expected weights[1] on cpu (x's device), but got meta");
  EXPECT_EQ(error_of([&] {
              linear_group(x, {w, at::Tensor()});
            }),
            "linear_group: weights[1] is undefined");
  EXPECT_EQ(error_of([&] { linear_group(at::zeros({}), {w}); }),
            "linear_group: expected x of shape [..., in], but got a 0-dim tensor");
  EXPECT_EQ(error_of([&] { linear_group(at::Tensor(), {w}); }), "linear_group: x is undefined");
  // The composite checks the same.
  EXPECT_EQ(error_of([&] { linear_group_composite(x, {}); }),
            "linear_group: expected at least one weight, but got none");
}

}  // namespace
}  // namespace gdr
