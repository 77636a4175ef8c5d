// CPU tests of the gated activation ops (ops/gated_activation/gated_activation_op.h): an FP64 loop
// written from the formulas against the composite, the CPU op and its autograd against the
// composite's autograd (the same ATen ops, so the same bits), the GDR_GATED_ACTIVATION switch and
// the argument checks' exact messages.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <vector>

#include "ops/gated_activation/gated_activation_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"
#include "tests/ops/gated_activation_run.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::error_of;

using Result = test_support::GatedActivationResult;

Result run(bool fused, const at::Tensor& gate, const at::Tensor& x, const at::Tensor& dy,
           GatedActivationKind kind) {
  return test_support::run_gated_activation(fused, gate, x, dy, kind);
}

// The attention's layout: gate is the second half of each head of a [B, T, H, 2 hd]
// projection (a split, last dim contiguous); x is [B, T, H hd].
struct Case {
  at::Tensor gate, x, dy;
};

Case make_case(at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t B = 2, T = 5, H = 3, hd = 8;
  const at::Tensor projection = (at::randn({B, T, H, 2 * hd}) * 3).to(dtype);
  Case c;
  c.gate = at::split(projection, hd, -1)[1];
  c.x = (at::randn({B, T, H * hd}) * 2).to(dtype);
  c.dy = at::randn({B, T, H * hd}).to(dtype);
  return c;
}

TEST(GatedActivationCpu, CompositeMatchesTheFormulasInFp64) {
  const Case c = make_case(at::kDouble, 1);
  for (GatedActivationKind kind : {GatedActivationKind::kSilu, GatedActivationKind::kSigmoid}) {
    const Result r = run(false, c.gate, c.x, c.dy, kind);
    const at::Tensor g = c.gate.contiguous().reshape({-1}), x = c.x.reshape({-1});
    const at::Tensor dy = c.dy.reshape({-1});
    const at::Tensor y = r.y.reshape({-1}), dgate = r.grad_gate.contiguous().reshape({-1});
    const at::Tensor dx = r.grad_x.reshape({-1});
    for (int64_t e = 0; e < x.numel(); ++e) {
      const double gv = g[e].item<double>(), xv = x[e].item<double>(), d = dy[e].item<double>();
      const double sig = 1.0 / (1.0 + std::exp(-gv));
      const double act = kind == GatedActivationKind::kSilu ? gv * sig : sig;
      const double dact =
          kind == GatedActivationKind::kSilu ? sig * (1.0 + gv * (1.0 - sig)) : sig * (1.0 - sig);
      EXPECT_NEAR(y[e].item<double>(), act * xv, 1e-12) << e;
      EXPECT_NEAR(dx[e].item<double>(), d * act, 1e-12) << e;
      EXPECT_NEAR(dgate[e].item<double>(), d * xv * dact, 1e-12) << e;
    }
  }
}

TEST(GatedActivationCpu, FusedOpGivesTheCompositeBits) {
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    const Case c = make_case(dtype, 2);
    for (GatedActivationKind kind : {GatedActivationKind::kSilu, GatedActivationKind::kSigmoid}) {
      const Result fused = run(true, c.gate, c.x, c.dy, kind);
      const Result composite = run(false, c.gate, c.x, c.dy, kind);
      EXPECT_TRUE(bitwise_equal(fused.y, composite.y)) << dtype;
      EXPECT_TRUE(bitwise_equal(fused.grad_x, composite.grad_x)) << dtype;
      EXPECT_TRUE(bitwise_equal(fused.grad_gate, composite.grad_gate.contiguous())) << dtype;
      EXPECT_EQ(fused.grad_gate.sizes(), c.gate.sizes());
    }
  }
}

TEST(GatedActivationCpu, SwitchSelectsTheImplementation) {
  const Case c = make_case(at::kFloat, 3);
  {
    const test_support::PolicyForTest policy("GDR_GATED_ACTIVATION", "composite");
    EXPECT_EQ(current_execution_policy().gated_activation, GatedActivationImpl::kComposite);
  }
  {
    const test_support::PolicyForTest policy("GDR_GATED_ACTIVATION", "fused");
    EXPECT_EQ(current_execution_policy().gated_activation, GatedActivationImpl::kFused);
    // CPU inputs take the composite whatever the switch says: the same values.
    EXPECT_TRUE(bitwise_equal(gated_activation(c.gate, c.x, GatedActivationKind::kSilu),
                              gated_activation_composite(c.gate, c.x, GatedActivationKind::kSilu)));
  }
  EXPECT_EQ(test_support::policy_error("GDR_GATED_ACTIVATION", "fast"),
            "GDR_GATED_ACTIVATION: expected fused or composite, but got 'fast'");
}

TEST(GatedActivationCpu, ArgumentErrorsNameTheArgument) {
  const at::Tensor x = at::zeros({2, 4});
  EXPECT_EQ(error_of([&] {
              gated_activation_forward(at::zeros({2, 3}), x, GatedActivationKind::kSilu);
            }),
            "gated_activation: expected gate with as many elements as x (8, shape [2, 4]), but got "
            "6 (shape [2, 3])");
  EXPECT_EQ(error_of([&] {
              gated_activation_forward(at::zeros({2, 4}, at::kBFloat16), x,
                                       GatedActivationKind::kSigmoid);
            }),
            "gated_activation: expected gate of dtype Float (x's), but got BFloat16");
  EXPECT_EQ(error_of([&] {
              gated_activation_forward(at::zeros({2, 4}, at::kInt), at::zeros({2, 4}, at::kInt),
                                       GatedActivationKind::kSilu);
            }),
            "gated_activation: expected x of dtype Float, Half, BFloat16 or Double, but got Int");
  EXPECT_EQ(
      error_of([&] {
        gated_activation_backward(at::zeros({4, 2}), x, x, GatedActivationKind::kSilu);
      }),
      "gated_activation_backward: expected grad_y of shape [2, 4] (same as x), but got [4, 2]");
  const auto op = c10::Dispatcher::singleton()
                      .findSchemaOrThrow("gdr::gated_activation_forward", "")
                      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t)>();
  EXPECT_EQ(error_of([&] { op.call(x, x, 2); }),
            "gated_activation: expected activation 0 (silu) or 1 (sigmoid), but got 2");
}

}  // namespace
}  // namespace gdr
