// GPU tests of the fused causal-LM cross-entropy (tag gpu): loss and logits gradient
// against the ATen composite on CUDA (FP32 tight; BF16 / FP16 within one rounding of the
// gradient), the 0.8B model's V = 248320 at B = 1, T = 2048, small odd V (tails), strided
// logits, ignored rows, every row ignored, a side stream, CUDA graph capture, the
// out-of-range targets (NaN in their row only, no host sync) and the device mismatch
// error, 100 bit-exact replays of forward + backward under contention, and the model's
// GDR_CROSS_ENTROPY switch.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <utility>

#include "models/qwen/model.h"
#include "ops/cross_entropy/cross_entropy_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"
#include "tests/ops/gpu_contention.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

constexpr int64_t kIgnore = -100;

struct Problem {
  at::Tensor logits;  // [B, T, V] on CUDA
  at::Tensor labels;  // [B, T] int64 on CUDA
};

// Logits ~ 3 * N(0, 1) (a spread like a trained LM head's), every fifth position ignored.
// `strided`: the logits are a view of a wider [T, B, V + 24] buffer (transposed batch /
// token dims, narrowed vocab), read in place by the fused op.
Problem make_problem(int64_t B, int64_t T, int64_t V, at::ScalarType dtype, bool strided,
                     uint64_t seed) {
  at::manual_seed(seed);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  Problem p;
  if (strided) {
    p.logits = (at::randn({T, B, V + 24}, cuda) * 3).to(dtype).transpose(0, 1).narrow(2, 0, V);
  } else {
    p.logits = (at::randn({B, T, V}, cuda) * 3).to(dtype);
  }
  p.labels = at::randint(0, V, {B, T}, cuda.dtype(at::kLong));
  p.labels.index_put_({at::indexing::Slice(), at::indexing::Slice(0, at::indexing::None, 5)},
                      kIgnore);
  return p;
}

struct Result {
  at::Tensor loss, grad;
};

// Loss and logits gradient through autograd with upstream gradient `g`.
Result run(bool fused, const Problem& p, double g = 0.75) {
  at::Tensor logits = p.logits.detach().requires_grad_(true);
  const at::Tensor loss = fused ? causal_lm_cross_entropy(logits, p.labels, kIgnore)
                                : causal_lm_cross_entropy_composite(logits, p.labels, kIgnore);
  const at::Tensor grad = torch::autograd::grad(
      {loss}, {logits}, {at::full({}, g, loss.options().dtype(at::kFloat))})[0];
  return {loss.detach(), grad};
}

using test_support::bitwise_equal;

// Largest excess of |fused - ref| over rel * |ref| + abs (<= 0 means within tolerance).
double excess(const at::Tensor& fused, const at::Tensor& ref, double rel, double abs) {
  const at::Tensor f = fused.to(at::kFloat), r = ref.to(at::kFloat);
  return ((f - r).abs() - (r.abs() * rel + abs)).max().item<double>();
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

class CrossEntropyGpu : public ::testing::TestWithParam<Case> {};

// Tolerances. Loss: both sides compute in FP32 from the same values (the composite's cast
// is exact) with different summation orders and exp implementations (the fused kernel's
// exp2 of x * log2(e) is within about 2e-6 relative per term): 1e-5 relative. Gradient:
// FP32 elementwise within 2e-5 relative plus 1e-6 of g / count (p = exp(x - lse) differs by
// the lse difference and the exp error); BF16 / FP16: each side rounds its FP32 value once,
// so they may differ by one unit in the last place: 2^-7 (BF16) / 2^-10 (FP16) relative,
// plus FP16's subnormal spacing (6e-8) in absolute terms.
TEST_P(CrossEntropyGpu, FusedMatchesTheCompositeForLossAndGradient) {
  const Case c = GetParam();
  const Problem p = make_problem(c.B, c.T, c.V, c.dtype, c.strided, c.V + c.T);
  const Result fused = run(true, p), ref = run(false, p);
  ASSERT_EQ(fused.loss.scalar_type(), at::kFloat);
  ASSERT_EQ(fused.loss.dim(), 0);
  const double l = fused.loss.item<double>(), r = ref.loss.item<double>();
  EXPECT_NEAR(l, r, 1e-5 * std::fabs(r)) << name_of(c);
  ASSERT_EQ(fused.grad.scalar_type(), c.dtype);
  ASSERT_EQ(fused.grad.sizes(), p.logits.sizes());
  ASSERT_TRUE(fused.grad.is_contiguous());
  const double count = (p.labels.narrow(1, 1, c.T - 1) != kIgnore).sum().item<double>();
  const double scale = 0.75 / count;
  double rel = 2e-5, abs = 1e-6 * scale;
  if (c.dtype == at::kBFloat16) rel = 1.0 / 128;
  if (c.dtype == at::kHalf) {
    rel = 1.0 / 1024;
    abs += 6e-8;
  }
  EXPECT_LE(excess(fused.grad, ref.grad, rel, abs), 0.0) << name_of(c);
  // The last position of every sequence and the ignored rows get exact zeros.
  EXPECT_EQ(fused.grad.select(1, c.T - 1).abs().max().item<double>(), 0.0);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CrossEntropyGpu,
    ::testing::Values(Case{1, 2048, 248320, at::kBFloat16, false},
                      Case{1, 2048, 248320, at::kFloat, false},
                      Case{2, 300, 248320, at::kBFloat16, true}, Case{2, 37, 7, at::kFloat, false},
                      Case{2, 37, 7, at::kBFloat16, true}, Case{3, 65, 1000, at::kBFloat16, true},
                      Case{2, 33, 4099, at::kFloat, true}, Case{2, 33, 4099, at::kBFloat16, false},
                      Case{4, 17, 4099, at::kHalf, false}, Case{1, 2, 1, at::kFloat, false},
                      Case{3, 5, 1, at::kBFloat16, true}),
    [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

TEST(CrossEntropyGpuEdges, EveryRowIgnoredGivesAtensNanAndAZeroGradient) {
  Problem p = make_problem(2, 9, 100, at::kBFloat16, false, 3);
  p.labels.fill_(kIgnore);
  const Result fused = run(true, p), ref = run(false, p);
  EXPECT_TRUE(std::isnan(ref.loss.item<float>())) << "ATen's Mean reduction of 0 rows is 0 / 0";
  EXPECT_TRUE(std::isnan(fused.loss.item<float>()));
  EXPECT_EQ(fused.grad.abs().max().item<float>(), 0.0f);
}

TEST(CrossEntropyGpuEdges, LseIsTheRowLogsumexpAndCountTheCountedRows) {
  const Problem p = make_problem(2, 50, 3000, at::kFloat, false, 4);
  auto [loss, lse, count] = causal_lm_cross_entropy_forward(p.logits, p.labels, kIgnore);
  const at::Tensor ref = at::logsumexp(p.logits.narrow(1, 0, 49), {2});
  const at::Tensor counted = p.labels.narrow(1, 1, 49) != kIgnore;
  EXPECT_TRUE(at::allclose(lse.masked_select(counted), ref.masked_select(counted), 1e-6, 1e-5));
  EXPECT_EQ(count.item<float>(), counted.sum().item<float>());
}

TEST(CrossEntropyGpuStreams, ASideStreamGivesTheSameBitsAsTheDefaultStream) {
  const Problem p = make_problem(2, 129, 50000, at::kBFloat16, false, 5);
  const Result on_default = run(true, p);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  c10::cuda::getCurrentCUDAStream().synchronize();  // the inputs were made on the default stream
  Result on_side;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    on_side = run(true, p);
  }
  side.synchronize();
  EXPECT_TRUE(bitwise_equal(on_side.loss, on_default.loss));
  EXPECT_TRUE(bitwise_equal(on_side.grad, on_default.grad));
}

// The op skips its host target check while capturing (Note [Cross-entropy target check]);
// the captured forward + backward replays to the eager bits.
TEST(CrossEntropyGpuStreams, ForwardAndBackwardReplayFromACudaGraph) {
  const Problem p = make_problem(2, 65, 4099, at::kBFloat16, false, 6);
  const at::Tensor g = at::full({}, 0.5, p.logits.options().dtype(at::kFloat));
  auto step = [&] {
    auto [loss, lse, count] = causal_lm_cross_entropy_forward(p.logits, p.labels, kIgnore);
    return std::make_pair(
        loss, causal_lm_cross_entropy_backward(g, p.logits, p.labels, lse, count, kIgnore));
  };
  const auto eager = step();
  c10::cuda::CUDAStream capture_stream = c10::cuda::getStreamFromPool();
  c10::cuda::getCurrentCUDAStream().synchronize();
  std::pair<at::Tensor, at::Tensor> captured;
  at::cuda::CUDAGraph graph;
  {
    c10::cuda::CUDAStreamGuard guard(capture_stream);
    graph.capture_begin();
    captured = step();
    graph.capture_end();
    graph.replay();
  }
  capture_stream.synchronize();
  EXPECT_TRUE(bitwise_equal(captured.first, eager.first));
  EXPECT_TRUE(bitwise_equal(captured.second, eager.second));
}

using test_support::error_of;

TEST(CrossEntropyGpuErrors, OutOfRangeTargetsPoisonOnlyTheirRowAndDeviceMismatchIsNamed) {
  // See Note [Cross-entropy target check]: no host sync on CUDA; a bad target (too large or
  // negative and not ignore_index) is never read: the mean loss is NaN, that row's
  // gradient is NaN, and every other row keeps the bits of the run with good labels.
  const Problem p = make_problem(2, 40, 1000, at::kBFloat16, false, 7);
  const Result good = run(true, p);
  for (int64_t bad_value : {int64_t{1000}, int64_t{-3}}) {
    Problem q = p;
    q.labels = p.labels.clone();
    q.labels[1][17] = bad_value;  // scored by row (b = 1, t = 16)
    const Result r = run(true, q);
    EXPECT_TRUE(std::isnan(r.loss.item<float>())) << bad_value;
    const at::Tensor bad_row = r.grad[1][16].to(at::kFloat);
    EXPECT_TRUE(at::isnan(bad_row).all().item<bool>()) << bad_value;
    at::Tensor others = r.grad.clone(), good_others = good.grad.clone();
    others[1][16].zero_();
    good_others[1][16].zero_();
    EXPECT_TRUE(bitwise_equal(others, good_others)) << bad_value;
  }
  EXPECT_EQ(error_of([&] { causal_lm_cross_entropy(p.logits, p.labels.cpu(), kIgnore); }),
            "causal_lm_cross_entropy: labels is on cpu but logits is on cuda:0; expected both on "
            "one device");
  EXPECT_EQ(error_of([&] { causal_lm_cross_entropy(p.logits.to(at::kDouble), p.labels, kIgnore); }),
            "causal_lm_cross_entropy: expected logits of dtype Float, Half or BFloat16 (or Double "
            "on the CPU), but got Double on cuda:0");
}

// See Note [Cross-entropy determinism]: 100 forward + backward replays under load on other
// streams, bit for bit, at the 0.8B model's shape.
TEST(CrossEntropyGpuReplay, ForwardAndBackwardAreBitwiseReproducibleUnderContention) {
  const Problem p = make_problem(1, 2048, 248320, at::kBFloat16, false, 8);
  const Result first = run(true, p);
  test_support::GpuContention contention;
  for (int rep = 0; rep < 100; ++rep) {
    const Result again = run(true, p);
    ASSERT_TRUE(bitwise_equal(again.loss, first.loss)) << "loss, replay " << rep;
    ASSERT_TRUE(bitwise_equal(again.grad, first.grad)) << "grad, replay " << rep;
  }
}

// The autograd node of the loss names the path: the fused op's custom function or ATen's
// NllLossBackward0.
std::string loss_node(const Problem& p) {
  const at::Tensor logits = p.logits.detach().requires_grad_(true);
  return causal_lm_loss(logits, p.labels).grad_fn()->name();
}

TEST(CrossEntropyGpuSwitch, CausalLmLossFollowsGdrCrossEntropy) {
  const Problem p = make_problem(2, 33, 5000, at::kBFloat16, false, 9);
  EXPECT_NE(loss_node(p).find("CausalLmCrossEntropyFunction"), std::string::npos) << loss_node(p);
  EXPECT_TRUE(bitwise_equal(causal_lm_loss(p.logits, p.labels),
                            causal_lm_cross_entropy(p.logits, p.labels, kIgnore)));
  {
    test_support::PolicyForTest policy("GDR_CROSS_ENTROPY", "composite");
    EXPECT_NE(loss_node(p).find("NllLoss"), std::string::npos) << loss_node(p);
    EXPECT_TRUE(bitwise_equal(causal_lm_loss(p.logits, p.labels),
                              causal_lm_cross_entropy_composite(p.logits, p.labels, kIgnore)));
    policy.set("GDR_CROSS_ENTROPY", "fused");
    EXPECT_NE(loss_node(p).find("CausalLmCrossEntropyFunction"), std::string::npos) << loss_node(p);
  }
  EXPECT_EQ(test_support::policy_error("GDR_CROSS_ENTROPY", "bogus"),
            "GDR_CROSS_ENTROPY: expected fused or composite, but got 'bogus'");
  // FP64 logits keep the composite whatever the switch says.
  Problem fp64 = p;
  fp64.logits = p.logits.to(at::kDouble);
  EXPECT_NE(loss_node(fp64).find("NllLoss"), std::string::npos) << loss_node(fp64);
  // The fused path's gradient comes back in the logits' dtype and full shape.
  at::Tensor logits = p.logits.detach().requires_grad_(true);
  causal_lm_loss(logits, p.labels).backward();
  EXPECT_EQ(logits.grad().scalar_type(), at::kBFloat16);
  EXPECT_EQ(logits.grad().sizes(), p.logits.sizes());
}

}  // namespace
}  // namespace gdr
