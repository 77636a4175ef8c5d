// Finite-difference checks of the hand-assembled differentiable pieces: the GDR core
// (chunked over several chunks with a padded tail, and the recurrent reference), the
// pre-GDR gate composite and the gated RMSNorm.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <vector>

#include "models/qwen/layers.h"
#include "ops/gdr_core/gdr_core_op.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"
#include "tests/models/finite_difference.h"

namespace gdr {
namespace {

using testing::check_gradients;
using testing::GradientTolerance;

at::Tensor leaf(at::Tensor t) { return t.contiguous().requires_grad_(true); }

struct CoreLeaves {
  std::vector<at::Tensor> leaves;  // q, k, v, g, beta, initial_state
  at::Tensor w_o, w_s;
};

CoreLeaves make_core_leaves(int64_t T) {
  at::manual_seed(21);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  at::Tensor q = at::randn({1, T, 2, 3}, f64), k = at::randn({1, T, 2, 3}, f64);
  CoreLeaves c;
  c.leaves = {leaf(q / q.norm(2, -1, true)),
              leaf(k / k.norm(2, -1, true)),
              leaf(at::randn({1, T, 2, 2}, f64)),
              leaf(-2.0 * at::rand({1, T, 2}, f64)),
              leaf(at::sigmoid(at::randn({1, T, 2}, f64))),
              leaf(at::randn({1, 2, 3, 2}, f64))};
  c.w_o = at::randn({1, T, 2, 2}, f64);
  c.w_s = at::randn({1, 2, 3, 2}, f64);
  return c;
}

// The helper itself must fail on a wrong gradient: detach() hides half of d(x^2)/dx.
TEST(GradientCheck, TheHelperReportsAWrongGradient) {
  const std::vector<at::Tensor> leaves = {leaf(at::randn({3}, at::kDouble) + 2.0)};
  auto f = [](const std::vector<at::Tensor>& x) { return (x[0].detach() * x[0]).sum(); };
  EXPECT_FALSE(check_gradients(f, leaves));
}

TEST(GradientCheck, ChunkedGdrCoreMatchesFiniteDifferences) {
  const CoreLeaves c = make_core_leaves(10);
  auto f = [&](const std::vector<at::Tensor>& x) {
    // chunk 4 over T = 10: three chunks, the last one padded.
    const auto [o, s] = gated_delta_rule_chunked(x[0], x[1], x[2], x[3], x[4], 0.7, x[5], true, 4);
    return (o * c.w_o).sum() + (s * c.w_s).sum();
  };
  EXPECT_TRUE(check_gradients(f, c.leaves));
}

TEST(GradientCheck, ChunkedGdrCoreWithTheDefaultChunkMatchesFiniteDifferences) {
  const CoreLeaves c = make_core_leaves(5);
  auto f = [&](const std::vector<at::Tensor>& x) {
    const auto [o, s] = gated_delta_rule_chunked(x[0], x[1], x[2], x[3], x[4], 0.7, x[5], true);
    return (o * c.w_o).sum() + (s * c.w_s).sum();
  };
  EXPECT_TRUE(check_gradients(f, c.leaves));
}

TEST(GradientCheck, RecurrentGdrCoreMatchesFiniteDifferences) {
  const CoreLeaves c = make_core_leaves(6);
  auto f = [&](const std::vector<at::Tensor>& x) {
    const auto [o, s] = gated_delta_rule_recurrent(x[0], x[1], x[2], x[3], x[4], 0.7, x[5], true);
    return (o * c.w_o).sum() + (s * c.w_s).sum();
  };
  EXPECT_TRUE(check_gradients(f, c.leaves));
}

TEST(GradientCheck, GatedRmsNormMatchesFiniteDifferences) {
  at::manual_seed(22);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const std::vector<at::Tensor> leaves = {leaf(at::randn({2, 3, 5}, f64)),
                                          leaf(at::randn({2, 3, 5}, f64)),
                                          leaf(1.0 + 0.1 * at::randn({5}, f64))};
  const at::Tensor w = at::randn({2, 3, 5}, f64);
  auto f = [&](const std::vector<at::Tensor>& x) {
    return (gated_rms_norm(x[0], x[1], x[2], 1e-6, at::kDouble) * w).sum();
  };
  EXPECT_TRUE(check_gradients(f, leaves));
}

// The same check in FP64 for the CPU op and the composite (Note [Gate FP64 on the CPU]).
TEST(GradientCheck, PreGdrGateOpAndCompositeMatchFiniteDifferencesInFp64) {
  at::manual_seed(24);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const std::vector<at::Tensor> leaves = {
      leaf(at::randn({2, 3, 4}, f64)), leaf(at::randn({2, 3, 4}, f64)),
      leaf(at::log(at::rand({4}, f64) * 15.99 + 0.01)), leaf(1.0 + 0.1 * at::randn({4}, f64))};
  const at::Tensor w_g = at::randn({2, 3, 4}, f64), w_beta = at::randn({2, 3, 4}, f64);
  for (const bool fused : {true, false}) {
    auto f = [&](const std::vector<at::Tensor>& x) {
      const auto [g, beta] = fused ? pre_gdr_gate(x[0], x[1], x[2], x[3])
                                   : pre_gdr_gate_composite(x[0], x[1], x[2], x[3]);
      EXPECT_EQ(g.scalar_type(), at::kDouble);
      return ((g / 16.0) * w_g).sum() + (beta * w_beta).sum();
    };
    EXPECT_TRUE(check_gradients(f, leaves)) << (fused ? "the CPU op" : "the composite");
  }
}

// FP32, with a larger step and tolerance (central-difference error ~ eps^2, rounding
// ~ 1e-7 / eps).
TEST(GradientCheck, PreGdrGateCompositeMatchesFiniteDifferencesInFp32) {
  at::manual_seed(23);
  const std::vector<at::Tensor> leaves = {leaf(at::randn({2, 3, 4})), leaf(at::randn({2, 3, 4})),
                                          leaf(at::log(at::rand({4}) * 15.99 + 0.01)),
                                          leaf(at::ones({4}) + 0.1 * at::randn({4}))};
  const at::Tensor w_g = at::randn({2, 3, 4}), w_beta = at::randn({2, 3, 4});
  auto f = [&](const std::vector<at::Tensor>& x) {
    const auto [g, beta] = pre_gdr_gate_composite(x[0], x[1], x[2], x[3]);
    // Divide g by its scale (exp(A_log) up to 16) so both terms weigh alike.
    return ((g / 16.0) * w_g).sum() + (beta * w_beta).sum();
  };
  EXPECT_TRUE(
      check_gradients(f, leaves, GradientTolerance{/*eps=*/1e-2, /*atol=*/2e-3, /*rtol=*/1e-2}));
}

}  // namespace
}  // namespace gdr
