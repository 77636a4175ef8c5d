// CPU tests of the causal conv1d + SiLU op (ops/causal_conv1d/causal_conv1d_op.h): an independent
// FP64 loop written from the formula checked against the ATen composition and its autograd; the CPU
// op (forward and backward) bit for bit against the composition's forward and autograd;
// autograd through the op; empty inputs; strided views; the GDR_CAUSAL_CONV switch; the
// argument checks' exact messages; the backward's launch rule
// (kernels/causal_conv1d/causal_conv1d.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "kernels/causal_conv1d/causal_conv1d.h"
#include "ops/causal_conv1d/causal_conv1d_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/error_of.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Independent check written from the formula (not the op's code): forward and backward of
// y[b, t, c] = silu(sum_j w[c, j] * x[b, t + j - K + 1, c]) in plain FP64 loops.
struct LoopResult {
  at::Tensor y, dx, dw;
};

LoopResult loop_reference(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& g_in) {
  const int64_t B = x_in.size(0), T = x_in.size(1), C = x_in.size(2), K = w_in.size(2);
  const at::Tensor x = x_in.to(at::kDouble).contiguous();
  const at::Tensor g = g_in.to(at::kDouble).contiguous();
  const at::Tensor w = w_in.to(at::kDouble).contiguous();
  auto X = x.accessor<double, 3>();
  auto G = g.accessor<double, 3>();
  auto W = w.accessor<double, 3>();
  auto in = [&](int64_t b, int64_t s, int64_t c) { return s < 0 ? 0.0 : X[b][s][c]; };
  LoopResult out{at::zeros({B, T, C}, at::kDouble), at::zeros({B, T, C}, at::kDouble),
                 at::zeros({C, 1, K}, at::kDouble)};
  auto Y = out.y.accessor<double, 3>();
  auto DX = out.dx.accessor<double, 3>();
  auto DW = out.dw.accessor<double, 3>();
  std::vector<double> dpre(B * T * C);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        double pre = 0.0;
        for (int64_t j = 0; j < K; ++j) pre += W[c][0][j] * in(b, t + j - K + 1, c);
        const double sig = 1.0 / (1.0 + std::exp(-pre));
        Y[b][t][c] = pre * sig;
        const double d = G[b][t][c] * sig * (1.0 + pre * (1.0 - sig));  // d silu / d pre
        dpre[(b * T + t) * C + c] = d;
        for (int64_t j = 0; j < K; ++j) {
          const int64_t s = t + j - K + 1;  // x[s] feeds pre[t] through tap j
          if (s >= 0) DX[b][s][c] += W[c][0][j] * d;
          DW[c][0][j] += d * in(b, s, c);
        }
      }
    }
  }
  return out;
}

struct Grads {
  at::Tensor y, dx, dw;
};

Grads composite_autograd(const at::Tensor& x, const at::Tensor& w, const at::Tensor& g) {
  at::Tensor xv = x.detach().requires_grad_(true), wv = w.detach().requires_grad_(true);
  const at::Tensor y = causal_conv1d_silu_composite(xv, wv);
  auto grads = torch::autograd::grad({y}, {xv, wv}, {g});
  return {y.detach(), grads[0], grads[1]};
}

Grads cpu_op(const at::Tensor& x, const at::Tensor& w, const at::Tensor& g) {
  at::Tensor y = causal_conv1d_silu_forward(x, w);
  auto [dx, dw] = causal_conv1d_silu_backward(g, x, w);
  return {y, dx, dw};
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

struct Case {
  int64_t B, T, C, K;
};

std::string name_of(const Case& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_C" + std::to_string(c.C) +
         "_K" + std::to_string(c.K);
}

class CausalConvCpu : public ::testing::TestWithParam<Case> {};

TEST_P(CausalConvCpu, SpecLoopMatchesTheCompositionAndItsAutogradInFp64) {
  const Case c = GetParam();
  at::manual_seed(c.T * 7 + c.C);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor x = at::randn({c.B, c.T, c.C}, f64) * 1.5;
  const at::Tensor w = at::randn({c.C, 1, c.K}, f64) * 0.5;
  const at::Tensor g = at::randn({c.B, c.T, c.C}, f64);
  const LoopResult ref = loop_reference(x, w, g);
  const Grads comp = composite_autograd(x, w, g);
  EXPECT_LT(max_abs_diff(comp.y, ref.y), 1e-12);
  EXPECT_LT(max_abs_diff(comp.dx, ref.dx), 1e-12);
  EXPECT_LT(max_abs_diff(comp.dw, ref.dw), 1e-12 * c.B * c.T);
}

// The CPU op is the composition: forward bit for bit, backward bit for bit ATen's autograd
// of it (the same silu_backward and convolution_backward calls), in every CPU dtype.
TEST_P(CausalConvCpu, CpuOpEqualsTheCompositionBitForBit) {
  const Case c = GetParam();
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kDouble}) {
    at::manual_seed(c.T * 11 + c.C + static_cast<int>(dt));
    const at::Tensor x = (at::randn({c.B, c.T, c.C}) * 1.5).to(dt);
    const at::Tensor w = (at::randn({c.C, 1, c.K}) * 0.5).to(dt);
    const at::Tensor g = at::randn({c.B, c.T, c.C}).to(dt);
    const Grads comp = composite_autograd(x, w, g);
    const Grads op = cpu_op(x, w, g);
    const std::string context = c10::toString(dt);
    EXPECT_TRUE(op.y.is_contiguous()) << context;
    EXPECT_TRUE(same_bits(op.y, comp.y.contiguous())) << context << " y";
    EXPECT_TRUE(same_bits(op.dx, comp.dx.contiguous())) << context << " dx";
    EXPECT_TRUE(same_bits(op.dw, comp.dw)) << context << " dw";
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CausalConvCpu,
                         ::testing::Values(Case{2, 37, 24, 4}, Case{1, 3, 16, 4}, Case{2, 2, 8, 3},
                                           Case{3, 50, 10, 2}, Case{1, 1, 5, 4},
                                           Case{2, 64, 48, 4}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return name_of(info.param);
                         });

TEST(CausalConvCpuOp, AutogradThroughTheOpEqualsTheForwardAndBackwardOps) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({2, 19, 12}).requires_grad_(true);
  const at::Tensor w = at::randn({12, 1, 4}).requires_grad_(true);
  const at::Tensor g = at::randn({2, 19, 12});
  const at::Tensor y = causal_conv1d_silu(x, w);
  auto grads = torch::autograd::grad({y}, {x, w}, {g});
  const Grads op = cpu_op(x.detach(), w.detach(), g);
  EXPECT_TRUE(same_bits(y.detach(), op.y));
  EXPECT_TRUE(same_bits(grads[0], op.dx));
  EXPECT_TRUE(same_bits(grads[1], op.dw));
}

// Strided views are taken as they are: the op gives the bits of the composition's autograd
// on the same views (on the CPU, ATen's bits may depend on the layout, so this is the
// contract, not equality with contiguous copies), and agrees with the copies to FP32
// rounding.
TEST(CausalConvCpuOp, StridedInputsMatchTheCompositionOnTheSameViews) {
  at::manual_seed(4);
  // x as a channel slice of a wider projection with transposed batch / token dims, and a
  // grad_y with a non-unit channel stride.
  const at::Tensor wide = at::randn({21, 2, 40});
  const at::Tensor x = wide.transpose(0, 1).narrow(2, 4, 32);
  const at::Tensor w = at::randn({32, 1, 4});
  const at::Tensor g = at::randn({2, 32, 21}).transpose(1, 2);
  const Grads strided = cpu_op(x, w, g);
  const Grads comp = composite_autograd(x, w, g);
  EXPECT_TRUE(same_bits(strided.y, comp.y.contiguous()));
  EXPECT_TRUE(same_bits(strided.dx, comp.dx.contiguous()));
  EXPECT_TRUE(same_bits(strided.dw, comp.dw));
  const Grads dense = cpu_op(x.contiguous(), w, g.contiguous());
  EXPECT_TRUE(same_bits(strided.y, dense.y));
  EXPECT_LT(max_abs_diff(strided.dx, dense.dx), 1e-5);
  EXPECT_LT(max_abs_diff(strided.dw, dense.dw), 1e-4);
}

TEST(CausalConvCpuOp, NoTokensGiveEmptyOutputsAndZeroWeightGradient) {
  const at::Tensor w = at::randn({8, 1, 4});
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{0, 5, 8}, std::vector<int64_t>{2, 0, 8}}) {
    const at::Tensor x = at::randn(shape);
    const Grads op = cpu_op(x, w, at::randn(shape));
    EXPECT_EQ(op.y.sizes(), x.sizes());
    EXPECT_EQ(op.dx.sizes(), x.sizes());
    EXPECT_TRUE(same_bits(op.dw, at::zeros({8, 1, 4})));
  }
}

// ---------------------------------------------------------------------------
// Launch rule, switch and errors

TEST(CausalConvLaunch, BackwardGridIsAPureFunctionOfTheShapeWithFewPrograms) {
  using kernels::CausalConvBackwardLaunch;
  using kernels::CausalConvShape;
  using kernels::derive_causal_conv_backward_launch;
  // The 0.8B model's microbatch: B*T = 4096 and 16384 tokens, C = 6144, K = 4.
  const CausalConvBackwardLaunch model = derive_causal_conv_backward_launch({2, 2048, 6144, 4});
  EXPECT_EQ(model.tile_tokens, 32);
  EXPECT_EQ(model.tiles_per_seq, 64);
  EXPECT_EQ(model.programs, 16);
  EXPECT_EQ(model.scratch_floats, 16 * 6144 * 4);
  EXPECT_EQ(derive_causal_conv_backward_launch({8, 2048, 6144, 4}).programs, 64);
  // Long sequences double the tile until the programs fit the target.
  const CausalConvBackwardLaunch long_seq = derive_causal_conv_backward_launch({1, 65536, 64, 4});
  EXPECT_EQ(long_seq.tile_tokens, 64);
  EXPECT_EQ(long_seq.programs, kernels::kCausalConvTargetPrograms);
  // Short sequences keep the minimum tile; many of them may exceed the target.
  const CausalConvBackwardLaunch many = derive_causal_conv_backward_launch({4096, 3, 16, 2});
  EXPECT_EQ(many.tile_tokens, kernels::kCausalConvBackwardMinTileTokens);
  EXPECT_EQ(many.programs, 4096 / kernels::kCausalConvTileRows);
  EXPECT_EQ(derive_causal_conv_backward_launch({0, 100, 16, 4}).programs, 0);
  EXPECT_EQ(derive_causal_conv_backward_launch({2, 0, 16, 4}).programs, 0);
  EXPECT_TRUE(kernels::causal_conv_supports({2, 10, 16, 2}));
  EXPECT_FALSE(kernels::causal_conv_supports({2, 10, 16, 5}));
  EXPECT_FALSE(kernels::causal_conv_supports({2, 10, 0, 4}));
}

using test_support::error_of;

TEST(CausalConvSwitch, DefaultsToKernelReadsEveryCallAndNamesTheVariableOnABadValue) {
  EXPECT_EQ(current_execution_policy().causal_conv, CausalConvImpl::kKernel);
  test_support::PolicyForTest policy("GDR_CAUSAL_CONV", "aten");
  EXPECT_EQ(current_execution_policy().causal_conv, CausalConvImpl::kAten);
  policy.set("GDR_CAUSAL_CONV", "kernel");
  EXPECT_EQ(current_execution_policy().causal_conv, CausalConvImpl::kKernel);
  policy.set("GDR_CAUSAL_CONV", "");
  EXPECT_EQ(current_execution_policy().causal_conv, CausalConvImpl::kKernel);
  EXPECT_EQ(test_support::policy_error("GDR_CAUSAL_CONV", "cudnn"),
            "GDR_CAUSAL_CONV: expected kernel or aten, but got 'cudnn'");
}

TEST(CausalConvSwitch, CpuTensorsAreNotTakenByTheCudaKernels) {
  EXPECT_FALSE(causal_conv1d_kernel_supports(at::randn({2, 8, 16}), at::randn({16, 1, 4})));
}

TEST(CausalConvErrors, MessagesNameTheArgumentWithExpectedAndActual) {
  const at::Tensor x = at::randn({2, 5, 16});
  const at::Tensor w = at::randn({16, 1, 4});
  const at::Tensor g = at::randn({2, 5, 16});
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_forward(at::randn({5, 16}), w);
            }),
            "causal_conv1d_silu: expected x of shape [B, T, C], but got 2 dimensions [5, 16]");
  EXPECT_EQ(error_of([&] { causal_conv1d_silu_forward(x.to(at::kLong), w); }),
            "causal_conv1d_silu: expected x of dtype Float, Half, BFloat16 or Double, but got "
            "Long");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_forward(at::randn({2, 5, 0}), w);
            }),
            "causal_conv1d_silu: expected at least one channel (C = x.size(2) >= 1), but got x of "
            "shape [2, 5, 0]");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_forward(x, at::randn({8, 1, 4}));
            }),
            "causal_conv1d_silu: expected weight of shape [C, 1, K] with C = x.size(2) = 16, but "
            "got [8, 1, 4]");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_forward(x, at::randn({16, 4}));
            }),
            "causal_conv1d_silu: expected weight of shape [C, 1, K] with C = x.size(2) = 16, but "
            "got [16, 4]");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_forward(x, at::randn({16, 2, 4}));
            }),
            "causal_conv1d_silu: expected weight of shape [C, 1, K] with C = x.size(2) = 16, but "
            "got [16, 2, 4]");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_forward(x, at::randn({16, 1, 5}));
            }),
            "causal_conv1d_silu: expected a kernel size K = weight.size(2) in [2, 4], but got 5");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_forward(x, at::randn({16, 1, 1}));
            }),
            "causal_conv1d_silu: expected a kernel size K = weight.size(2) in [2, 4], but got 1");
  EXPECT_EQ(error_of([&] { causal_conv1d_silu_forward(x, w.to(at::kBFloat16)); }),
            "causal_conv1d_silu: expected weight of dtype Float (x's dtype), but got BFloat16");
  EXPECT_EQ(error_of([&] { causal_conv1d_silu_forward(x, at::Tensor()); }),
            "causal_conv1d_silu: weight is undefined");
  EXPECT_EQ(error_of([&] { causal_conv1d_silu_forward(at::Tensor(), w); }),
            "causal_conv1d_silu: x is undefined");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_backward(at::randn({2, 6, 16}), x, w);
            }),
            "causal_conv1d_silu_backward: expected grad_y of shape [2, 5, 16] (same as x), but "
            "got [2, 6, 16]");
  EXPECT_EQ(error_of([&] { causal_conv1d_silu_backward(g.to(at::kDouble), x, w); }),
            "causal_conv1d_silu_backward: expected grad_y of dtype Float (x's dtype), but got "
            "Double");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_backward(g, x, at::randn({16, 1, 5}));
            }),
            "causal_conv1d_silu_backward: expected a kernel size K = weight.size(2) in [2, 4], "
            "but got 5");
}

}  // namespace
}  // namespace gdr
