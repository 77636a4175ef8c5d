// CPU tests of the causal-LM cross-entropy ops (ops/cross_entropy/cross_entropy_op.h): the CPU op's
// loss and gradient against at::cross_entropy_loss on the FP32 composite (bit for bit, through
// autograd), an independent FP64 loop written from the formula, every row ignored (ATen's
// NaN), the GDR_CROSS_ENTROPY switch, causal_lm_loss on the CPU, the argument checks'
// exact messages and the launch rules of kernels/cross_entropy/cross_entropy.h.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cross_entropy/cross_entropy.h"
#include "models/qwen/model.h"
#include "ops/cross_entropy/cross_entropy_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

constexpr int64_t kIgnore = -100;

using test_support::bitwise_equal;

struct Problem {
  at::Tensor logits;  // [B, T, V]
  at::Tensor labels;  // [B, T] int64, some ignored
};

// Logits in `dtype`; `strided` makes them a view (transposed batch / token dims of a
// buffer with a wider vocab, narrowed) so the ops see non-trivial strides.
Problem make_problem(int64_t B, int64_t T, int64_t V, at::ScalarType dtype, bool strided,
                     uint64_t seed) {
  at::manual_seed(seed);
  Problem p;
  if (strided) {
    p.logits = (at::randn({T, B, V + 5}) * 3).to(dtype).transpose(0, 1).narrow(2, 0, V);
  } else {
    p.logits = (at::randn({B, T, V}) * 3).to(dtype);
  }
  p.labels = at::randint(0, V, {B, T}, at::kLong);
  // Every third scored position ignored (and labels[:, 0], which is never scored).
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; t += 3) p.labels[b][t] = kIgnore;
  }
  return p;
}

// Loss and logits gradient through autograd with upstream gradient `g`.
std::pair<at::Tensor, at::Tensor> loss_and_grad(bool fused, const Problem& p, double g) {
  at::Tensor logits = p.logits.detach().requires_grad_(true);
  const at::Tensor loss = fused ? causal_lm_cross_entropy(logits, p.labels, kIgnore)
                                : causal_lm_cross_entropy_composite(logits, p.labels, kIgnore);
  const at::Tensor grad = torch::autograd::grad({loss}, {logits}, {at::full({}, g, at::kFloat)})[0];
  return {loss.detach(), grad};
}

struct Case {
  int64_t B, T, V;
  at::ScalarType dtype;
  bool strided;
};

std::string name_of(const Case& c) {
  return std::to_string(c.B) + "x" + std::to_string(c.T) + "x" + std::to_string(c.V) + "_" +
         c10::toString(c.dtype) + (c.strided ? "_strided" : "");
}

class CrossEntropyCpu : public ::testing::TestWithParam<Case> {};

TEST_P(CrossEntropyCpu, LossAndGradientEqualTheCompositeBitForBit) {
  const Case c = GetParam();
  const Problem p = make_problem(c.B, c.T, c.V, c.dtype, c.strided, c.V + c.T);
  const auto [loss, grad] = loss_and_grad(true, p, 0.75);
  const auto [ref_loss, ref_grad] = loss_and_grad(false, p, 0.75);
  EXPECT_TRUE(bitwise_equal(loss, ref_loss))
      << loss.item<float>() << " vs " << ref_loss.item<float>();
  EXPECT_TRUE(bitwise_equal(grad, ref_grad));
  EXPECT_EQ(grad.scalar_type(), c.dtype);
  // The composite is at::cross_entropy_loss on the FP32 copy of the scored positions (FP64
  // for Double logits).
  const at::ScalarType math = c.dtype == at::kDouble ? at::kDouble : at::kFloat;
  EXPECT_EQ(loss.scalar_type(), math);
  const at::Tensor direct = at::cross_entropy_loss(
      p.logits.narrow(1, 0, c.T - 1).to(math).reshape({-1, c.V}),
      p.labels.narrow(1, 1, c.T - 1).reshape({-1}), {}, at::Reduction::Mean, kIgnore);
  EXPECT_TRUE(bitwise_equal(loss, direct));
}

// Independent check written from the formula (not the op's code): per scored row
// (b, t < T - 1) with target y = labels[b, t + 1] != ignore, loss_n = log(sum_v exp(x_v)) -
// x_y in FP64; mean over the counted rows; d loss / d x_v = g * (softmax(x)_v - [v == y]) /
// count, zero on the last position and on ignored rows.
TEST_P(CrossEntropyCpu, AgreesWithANaiveDoubleLoopFromTheFormula) {
  const Case c = GetParam();
  const Problem p = make_problem(c.B, c.T, c.V, c.dtype, c.strided, 7 * c.V + c.T);
  const double g = 0.75;
  const auto [loss, grad] = loss_and_grad(true, p, g);
  const at::Tensor x = p.logits.to(at::kDouble).contiguous();
  const auto X = x.accessor<double, 3>();
  const auto Y = p.labels.accessor<int64_t, 2>();
  double sum = 0.0;
  int64_t count = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t t = 0; t + 1 < c.T; ++t) {
      if (Y[b][t + 1] == kIgnore) continue;
      double m = X[b][t][0];
      for (int64_t v = 1; v < c.V; ++v) m = std::max(m, X[b][t][v]);
      double s = 0.0;
      for (int64_t v = 0; v < c.V; ++v) s += std::exp(X[b][t][v] - m);
      sum += m + std::log(s) - X[b][t][Y[b][t + 1]];
      ++count;
    }
  }
  ASSERT_GT(count, 0);
  const double expected = sum / static_cast<double>(count);
  EXPECT_NEAR(loss.item<double>(), expected, 2e-6 * (1.0 + std::fabs(expected)));

  const at::Tensor gd = grad.to(at::kDouble);
  const auto G = gd.accessor<double, 3>();
  // FP32 gradients: FP32 rounding of softmax; 16-bit ones add one rounding (2^-8 for BF16).
  const double rel = c.dtype == at::kBFloat16 ? 4e-3 : (c.dtype == at::kHalf ? 1e-3 : 1e-5);
  const double scale = g / static_cast<double>(count);
  // FP16 has subnormals below 6.1e-5 with a spacing of 6e-8: half of that absolute.
  const double abs_floor = 1e-7 * scale + (c.dtype == at::kHalf ? 3e-8 : 0.0);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t t = 0; t < c.T; ++t) {
      const bool counted = t + 1 < c.T && Y[b][t + 1] != kIgnore;
      double m = X[b][t][0], s = 0.0;
      for (int64_t v = 1; v < c.V; ++v) m = std::max(m, X[b][t][v]);
      for (int64_t v = 0; v < c.V; ++v) s += std::exp(X[b][t][v] - m);
      for (int64_t v = 0; v < c.V; ++v) {
        if (!counted) {
          ASSERT_EQ(G[b][t][v], 0.0) << "b " << b << " t " << t << " v " << v;
          continue;
        }
        const double ref = scale * (std::exp(X[b][t][v] - m) / s - (v == Y[b][t + 1] ? 1.0 : 0.0));
        ASSERT_NEAR(G[b][t][v], ref, rel * std::fabs(ref) + abs_floor)
            << "b " << b << " t " << t << " v " << v;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CrossEntropyCpu,
    ::testing::Values(Case{2, 5, 7, at::kFloat, false}, Case{2, 5, 7, at::kBFloat16, true},
                      Case{1, 2, 1, at::kFloat, false}, Case{3, 9, 1000, at::kBFloat16, false},
                      Case{2, 6, 4099, at::kFloat, true}, Case{2, 4, 300, at::kHalf, false},
                      Case{1, 7, 64, at::kDouble, false}),
    [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

TEST(CrossEntropyCpuEdges, EveryRowIgnoredGivesAtensNanAndAZeroGradient) {
  Problem p = make_problem(2, 4, 11, at::kFloat, false, 3);
  p.labels.fill_(kIgnore);
  const auto [loss, grad] = loss_and_grad(true, p, 1.0);
  const auto [ref_loss, ref_grad] = loss_and_grad(false, p, 1.0);
  EXPECT_TRUE(std::isnan(ref_loss.item<float>())) << "ATen's Mean reduction of 0 rows is 0 / 0";
  EXPECT_TRUE(std::isnan(loss.item<float>()));
  EXPECT_TRUE(bitwise_equal(grad, ref_grad));
  EXPECT_TRUE(at::equal(grad, at::zeros_like(grad)));
  auto [l, lse, count] = causal_lm_cross_entropy_forward(p.logits, p.labels, kIgnore);
  EXPECT_EQ(count.item<float>(), 0.0f);
}

TEST(CrossEntropyCpuEdges, IntLabelsAndACustomIgnoreIndexWork) {
  Problem p = make_problem(2, 6, 13, at::kFloat, false, 4);
  p.labels.masked_fill_(p.labels == kIgnore, 5);
  p.labels[0][2] = 7;
  const at::Tensor ref =
      at::cross_entropy_loss(p.logits.narrow(1, 0, 5).reshape({-1, 13}),
                             p.labels.narrow(1, 1, 5).reshape({-1}), {}, at::Reduction::Mean, 7);
  EXPECT_TRUE(bitwise_equal(causal_lm_cross_entropy(p.logits, p.labels.to(at::kInt), 7), ref));
  auto [l, lse, count] = causal_lm_cross_entropy_forward(p.logits, p.labels, 7);
  const int64_t ignored = (p.labels.narrow(1, 1, 5) == 7).sum().item<int64_t>();
  EXPECT_EQ(count.item<float>(), static_cast<float>(10 - ignored));
}

TEST(CrossEntropyCpuEdges, LseIsTheRowLogsumexp) {
  const Problem p = make_problem(2, 5, 33, at::kFloat, false, 5);
  auto [loss, lse, count] = causal_lm_cross_entropy_forward(p.logits, p.labels, kIgnore);
  EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{2, 4}));
  EXPECT_TRUE(at::allclose(lse, at::logsumexp(p.logits.narrow(1, 0, 4), {2}), 1e-6, 1e-6));
}

// ---------------------------------------------------------------------------
// The model's loss and the switch

TEST(CrossEntropySwitch, DefaultsToFusedReadsEveryCallAndNamesTheVariableOnABadValue) {
  EXPECT_EQ(current_execution_policy().cross_entropy, CrossEntropyImpl::kFused);
  test_support::PolicyForTest policy("GDR_CROSS_ENTROPY", "composite");
  EXPECT_EQ(current_execution_policy().cross_entropy, CrossEntropyImpl::kComposite);
  policy.set("GDR_CROSS_ENTROPY", "fused");
  EXPECT_EQ(current_execution_policy().cross_entropy, CrossEntropyImpl::kFused);
  EXPECT_EQ(test_support::policy_error("GDR_CROSS_ENTROPY", "fast"),
            "GDR_CROSS_ENTROPY: expected fused or composite, but got 'fast'");
}

TEST(CrossEntropySwitch, CpuLogitsAreNotTakenByTheFusedCudaPath) {
  EXPECT_FALSE(cross_entropy_fused_supports(at::randn({2, 3, 8})));
}

TEST(CrossEntropySwitch, CausalLmLossOnTheCpuIsTheCompositeWhateverTheSwitch) {
  const Problem p = make_problem(2, 7, 50, at::kBFloat16, false, 6);
  const at::Tensor ref = causal_lm_cross_entropy_composite(p.logits, p.labels, kIgnore);
  for (const char* value : {"fused", "composite"}) {
    const test_support::PolicyForTest policy("GDR_CROSS_ENTROPY", value);
    EXPECT_TRUE(bitwise_equal(causal_lm_loss(p.logits, p.labels), ref)) << value;
  }
  EXPECT_EQ(test_support::policy_error("GDR_CROSS_ENTROPY", "bogus"),
            "GDR_CROSS_ENTROPY: expected fused or composite, but got 'bogus'");
}

// ---------------------------------------------------------------------------
// Errors

using test_support::error_of;

TEST(CrossEntropyErrors, MessagesNameTheArgumentWithExpectedAndActual) {
  const at::Tensor logits = at::randn({2, 5, 16});
  const at::Tensor labels = at::randint(0, 16, {2, 5}, at::kLong);
  auto call = [](const at::Tensor& x, const at::Tensor& y) {
    return [x, y] { causal_lm_cross_entropy(x, y, kIgnore); };
  };
  EXPECT_EQ(error_of(call(at::randn({10, 16}), labels)),
            "causal_lm_cross_entropy: expected logits of shape [B, T, V] (3 dims), but got shape "
            "[10, 16]");
  EXPECT_EQ(error_of(call(logits.to(at::kLong), labels)),
            "causal_lm_cross_entropy: expected logits of dtype Float, Half or BFloat16 (or Double "
            "on the CPU), but got Long on cpu");
  EXPECT_EQ(error_of(call(logits, labels.reshape({10}))),
            "causal_lm_cross_entropy: expected labels of shape [B, T] (2 dims), but got shape "
            "[10]");
  EXPECT_EQ(error_of(call(logits, at::randint(0, 16, {2, 4}, at::kLong))),
            "causal_lm_cross_entropy: expected labels of shape [2, 5] (B, T of logits), but got "
            "[2, 4]");
  EXPECT_EQ(error_of(call(logits, labels.to(at::kFloat))),
            "causal_lm_cross_entropy: expected labels of an integral dtype (Long or Int), but got "
            "Float");
  EXPECT_EQ(error_of(call(logits, labels.to(at::kBool))),
            "causal_lm_cross_entropy: expected labels of an integral dtype (Long or Int), but got "
            "Bool");
  EXPECT_EQ(error_of(call(at::randn({2, 1, 16}), at::zeros({2, 1}, at::kLong))),
            "causal_lm_cross_entropy: expected T >= 2 tokens (logits.size(1)) to score a next "
            "token, but got T = 1");
  EXPECT_EQ(error_of(call(at::randn({2, 5, 0}), labels)),
            "causal_lm_cross_entropy: expected V >= 1 classes (logits.size(2)), but got V = 0");
  at::Tensor bad = labels.clone();
  bad[1][3] = 16;
  EXPECT_EQ(error_of(call(logits, bad)),
            "causal_lm_cross_entropy: target 16 at labels[1, 3] is out of range for V = 16; "
            "expected a class index in [0, 16) or ignore_index (-100)");
  bad[1][3] = -1;
  EXPECT_EQ(error_of(call(logits, bad)),
            "causal_lm_cross_entropy: target -1 at labels[1, 3] is out of range for V = 16; "
            "expected a class index in [0, 16) or ignore_index (-100)");
  // labels[:, 0] is never scored, so any value there is fine.
  bad[1][3] = 2;
  bad[0][0] = 12345;
  EXPECT_EQ(error_of(call(logits, bad)), "(no error)");

  auto [loss, lse, count] = causal_lm_cross_entropy_forward(logits, labels, kIgnore);
  const at::Tensor g = at::ones({});
  EXPECT_EQ(error_of([&] {
              causal_lm_cross_entropy_backward(g, logits, labels, lse.narrow(1, 0, 3), count,
                                               kIgnore);
            }),
            "causal_lm_cross_entropy_backward: expected lse of shape [2, 4] (B, T - 1 of logits), "
            "but got [2, 3]");
  EXPECT_EQ(error_of([&] {
              causal_lm_cross_entropy_backward(g, logits, labels, lse.to(at::kDouble), count,
                                               kIgnore);
            }),
            "causal_lm_cross_entropy_backward: expected lse of dtype Float (from the forward), but "
            "got Double");
  EXPECT_EQ(error_of([&] {
              causal_lm_cross_entropy_backward(at::ones({2}), logits, labels, lse, count, kIgnore);
            }),
            "causal_lm_cross_entropy_backward: expected grad_loss with one element (the gradient "
            "of the scalar loss), but got shape [2]");
}

TEST(CrossEntropyErrors, CausalLmLossKeepsItsOwnMessages) {
  EXPECT_EQ(error_of([] {
              causal_lm_loss(at::randn({4, 16}), at::zeros({4}, at::kLong));
            }),
            "causal_lm_loss: expected logits of shape [B, T, V] but got [4, 16]");
  EXPECT_EQ(error_of([] {
              causal_lm_loss(at::randn({2, 1, 16}), at::zeros({2, 1}, at::kLong));
            }),
            "causal_lm_loss: expected T >= 2 tokens to predict a next one but got T = 1");
}

// ---------------------------------------------------------------------------
// Launch rules (kernels/cross_entropy/cross_entropy.h): pure functions of the problem.

TEST(CrossEntropyLaunch, BlockSizeIsAPureFunctionOfV) {
  EXPECT_EQ(kernels::cross_entropy_block_threads(1), 32);
  EXPECT_EQ(kernels::cross_entropy_block_threads(7), 32);
  EXPECT_EQ(kernels::cross_entropy_block_threads(256), 32);
  EXPECT_EQ(kernels::cross_entropy_block_threads(257), 64);
  EXPECT_EQ(kernels::cross_entropy_block_threads(1000), 128);
  EXPECT_EQ(kernels::cross_entropy_block_threads(4099), 512);
  EXPECT_EQ(kernels::cross_entropy_block_threads(248320), kernels::kCrossEntropyMaxThreads);
  kernels::CrossEntropyProblem p;
  p.batch = 4;
  p.tokens = 2048;
  p.vocab = 248320;
  EXPECT_TRUE(kernels::cross_entropy_supports(p));
  EXPECT_EQ(kernels::cross_entropy_scored_rows(p), 4 * 2047);
  p.tokens = 1;
  EXPECT_FALSE(kernels::cross_entropy_supports(p));
  p.tokens = 2;
  p.vocab = 0;
  EXPECT_FALSE(kernels::cross_entropy_supports(p));
  p.vocab = 8;
  p.batch = int64_t{1} << 31;
  EXPECT_FALSE(kernels::cross_entropy_supports(p));
}

}  // namespace
}  // namespace gdr
