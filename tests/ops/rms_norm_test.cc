// CPU tests of the RMSNorm ops (ops/rms_norm/rms_norm_op.h): an independent FP64 loop written from
// the spec checked against libtorch autograd of the compositions; the CPU op (forward
// and backward) against the compositions; the GDR_RMS_NORM switch; the argument checks'
// exact messages; the backward's launch rule (kernels/rms_norm/rms_norm.h).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/rms_norm/rms_norm.h"
#include "ops/policy/execution_policy.h"
#include "ops/rms_norm/rms_norm_op.h"
#include "tests/ops/error_of.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Independent check written from the spec (not the op's code): forward and backward of
// both flavours in plain FP64 loops over [rows, D].
struct LoopResult {
  std::vector<double> y, dx, dz, dw;
};

LoopResult loop_reference(bool gated, const at::Tensor& x_in, const at::Tensor& z_in,
                          const at::Tensor& w_in, const at::Tensor& g_in, double eps) {
  const int64_t D = x_in.size(-1), R = x_in.numel() / D;
  const at::Tensor x = x_in.to(at::kDouble).contiguous().view({R, D});
  const at::Tensor g = g_in.to(at::kDouble).contiguous().view({R, D});
  const at::Tensor w = w_in.to(at::kDouble).contiguous();
  const at::Tensor z = gated ? z_in.to(at::kDouble).contiguous().view({R, D}) : x;
  const double* xp = x.data_ptr<double>();
  const double* gp = g.data_ptr<double>();
  const double* wp = w.data_ptr<double>();
  const double* zp = z.data_ptr<double>();
  LoopResult out;
  out.y.resize(R * D);
  out.dx.resize(R * D);
  out.dz.resize(R * D);
  out.dw.assign(D, 0.0);
  for (int64_t r = 0; r < R; ++r) {
    double ss = 0.0;
    for (int64_t c = 0; c < D; ++c) ss += xp[r * D + c] * xp[r * D + c];
    const double rstd = 1.0 / std::sqrt(ss / D + eps);
    std::vector<double> n(D), dn(D);
    double dot = 0.0;
    for (int64_t c = 0; c < D; ++c) {
      const int64_t e = r * D + c;
      n[c] = xp[e] * rstd;
      const double sig = 1.0 / (1.0 + std::exp(-zp[e]));
      const double scale = gated ? wp[c] * zp[e] * sig : 1.0 + wp[c];
      out.y[e] = n[c] * scale;
      dn[c] = gp[e] * scale;
      dot += dn[c] * n[c];
      out.dw[c] += gp[e] * n[c] * (gated ? zp[e] * sig : 1.0);
      out.dz[e] = gated ? gp[e] * n[c] * wp[c] * sig * (1.0 + zp[e] * (1.0 - sig)) : 0.0;
    }
    for (int64_t c = 0; c < D; ++c) out.dx[r * D + c] = rstd * (dn[c] - n[c] * dot / D);
  }
  return out;
}

at::Tensor to_tensor(const std::vector<double>& v, at::IntArrayRef shape) {
  return at::tensor(v, at::TensorOptions().dtype(at::kDouble)).view(shape);
}

struct Grads {
  at::Tensor y, dx, dz, dw;
};

Grads composite_autograd(bool gated, const at::Tensor& x, const at::Tensor& z, const at::Tensor& w,
                         const at::Tensor& g, double eps) {
  at::Tensor xv = x.detach().requires_grad_(true), wv = w.detach().requires_grad_(true);
  at::Tensor zv = z.defined() ? z.detach().requires_grad_(true) : at::Tensor();
  Grads out;
  if (gated) {
    out.y = gated_rms_norm_composite(xv, zv, wv, eps, x.scalar_type());
    auto grads = torch::autograd::grad({out.y}, {xv, zv, wv}, {g});
    out.dx = grads[0];
    out.dz = grads[1];
    out.dw = grads[2];
  } else {
    out.y = zero_centered_rms_norm_composite(xv, wv, eps);
    auto grads = torch::autograd::grad({out.y}, {xv, wv}, {g});
    out.dx = grads[0];
    out.dw = grads[1];
  }
  out.y = out.y.detach();
  return out;
}

Grads cpu_op(bool gated, const at::Tensor& x, const at::Tensor& z, const at::Tensor& w,
             const at::Tensor& g, double eps) {
  Grads out;
  if (gated) {
    auto [y, rstd] = gated_rms_norm_forward(x, z, w, eps, x.scalar_type());
    auto [dx, dz, dw] = gated_rms_norm_backward(g, x, z, w, rstd);
    out = {y, dx, dz, dw};
  } else {
    auto [y, rstd] = zero_centered_rms_norm_forward(x, w, eps);
    auto [dx, dw] = zero_centered_rms_norm_backward(g, x, w, rstd);
    out = {y, dx, at::Tensor(), dw};
  }
  return out;
}

struct Case {
  bool gated;
  int64_t rows, D;
};

class RmsNormCpu : public ::testing::TestWithParam<Case> {};

// The spec loop against autograd of the composition: FP64 for the gated norm (its
// composition keeps FP64), FP32 for the zero-centred one (its composition is FP32 always).
TEST_P(RmsNormCpu, SpecLoopMatchesAutogradOfTheComposition) {
  const Case c = GetParam();
  at::manual_seed(c.D + c.rows);
  const at::ScalarType dt = c.gated ? at::kDouble : at::kFloat;
  const auto opt = at::TensorOptions().dtype(dt);
  const at::Tensor x = at::randn({c.rows, 3, c.D}, opt) * 2;
  const at::Tensor z = c.gated ? at::randn({c.rows, 3, c.D}, opt) * 2 : at::Tensor();
  const at::Tensor w = at::randn({c.D}, opt) * 0.5 + (c.gated ? 1.0 : 0.0);
  const at::Tensor g = at::randn({c.rows, 3, c.D}, opt);
  const double eps = 1e-6;
  const LoopResult ref = loop_reference(c.gated, x, z, w, g, eps);
  const Grads comp = composite_autograd(c.gated, x, z, w, g, eps);
  const double tol = c.gated ? 1e-12 : 2e-5;
  const auto shape = x.sizes();
  EXPECT_LT(max_abs_diff(comp.y, to_tensor(ref.y, shape)), tol);
  EXPECT_LT(max_abs_diff(comp.dx, to_tensor(ref.dx, shape)), tol);
  if (c.gated) {
    EXPECT_LT(max_abs_diff(comp.dz, to_tensor(ref.dz, shape)), tol);
  }
  EXPECT_LT(max_abs_diff(comp.dw, to_tensor(ref.dw, {c.D})), tol * std::sqrt(3.0 * c.rows));
}

// The CPU op: forward bit for bit the composition, backward its analytic gradient.
TEST_P(RmsNormCpu, CpuOpEqualsTheComposition) {
  const Case c = GetParam();
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16, at::kDouble}) {
    if (dt == at::kDouble && !c.gated) continue;  // the zero-centred composite is FP32 math
    at::manual_seed(c.D * 7 + c.rows);
    const at::Tensor x = (at::randn({c.rows, c.D}) * 2).to(dt);
    const at::Tensor z = c.gated ? (at::randn({c.rows, c.D}) * 2).to(dt) : at::Tensor();
    const at::Tensor w = (at::randn({c.D}) * 0.5).to(dt);
    const at::Tensor g = at::randn({c.rows, c.D}).to(dt);
    const Grads comp = composite_autograd(c.gated, x, z, w, g, 1e-6);
    const Grads op = cpu_op(c.gated, x, z, w, g, 1e-6);
    EXPECT_TRUE(at::equal(op.y, comp.y)) << "forward differs from the composition";
    const double tol = dt == at::kDouble ? 1e-12 : dt == at::kFloat ? 1e-5 : 2e-2;
    const double scale = dt == at::kBFloat16 ? 1.0 + comp.dx.abs().max().item<double>() : 1.0;
    EXPECT_EQ(op.dx.scalar_type(), dt);
    EXPECT_LT(max_abs_diff(op.dx, comp.dx), tol * scale) << c10::toString(dt);
    if (c.gated) {
      EXPECT_LT(max_abs_diff(op.dz, comp.dz), tol * scale) << c10::toString(dt);
    }
    const double dw_scale = 1.0 + comp.dw.abs().max().item<double>();
    EXPECT_LT(max_abs_diff(op.dw, comp.dw), tol * dw_scale) << c10::toString(dt);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormCpu,
                         ::testing::Values(Case{false, 5, 1024}, Case{false, 3, 256},
                                           Case{false, 4, 100}, Case{true, 5, 128},
                                           Case{true, 2, 1000}, Case{true, 3, 100}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.gated ? "gated" : "zero_centred") + "_" +
                                  std::to_string(info.param.rows) + "x" +
                                  std::to_string(info.param.D);
                         });

TEST(RmsNormCpu, AutogradThroughTheFusedOpEqualsTheCpuOp) {
  at::manual_seed(3);
  const at::Tensor x = at::randn({4, 6, 64}).requires_grad_(true);
  const at::Tensor z = at::randn({4, 6, 64}).requires_grad_(true);
  const at::Tensor w = at::randn({64}).requires_grad_(true);
  const at::Tensor g = at::randn({4, 6, 64});
  const at::Tensor y = gated_rms_norm_fused(x, z, w, 1e-6, at::kFloat);
  auto grads = torch::autograd::grad({y}, {x, z, w}, {g});
  auto [y_ref, rstd] = gated_rms_norm_forward(x.detach(), z.detach(), w.detach(), 1e-6, at::kFloat);
  auto [dx, dz, dw] = gated_rms_norm_backward(g, x.detach(), z.detach(), w.detach(), rstd);
  EXPECT_TRUE(at::equal(y.detach(), y_ref));
  EXPECT_TRUE(at::equal(grads[0], dx));
  EXPECT_TRUE(at::equal(grads[1], dz));
  EXPECT_TRUE(at::equal(grads[2], dw));

  const at::Tensor y2 = zero_centered_rms_norm_fused(x, w, 1e-6);
  auto grads2 = torch::autograd::grad({y2}, {x, w}, {g});
  auto [y2_ref, rstd2] = zero_centered_rms_norm_forward(x.detach(), w.detach(), 1e-6);
  auto [dx2, dw2] = zero_centered_rms_norm_backward(g, x.detach(), w.detach(), rstd2);
  EXPECT_TRUE(at::equal(y2.detach(), y2_ref));
  EXPECT_TRUE(at::equal(grads2[0], dx2));
  EXPECT_TRUE(at::equal(grads2[1], dw2));
}

TEST(RmsNormCpu, ZeroRowsGiveEmptyOutputsAndZeroWeightGradient) {
  const at::Tensor x = at::randn({0, 3, 32});
  const at::Tensor w = at::randn({32});
  auto [y, rstd] = zero_centered_rms_norm_forward(x, w, 1e-6);
  EXPECT_EQ(y.sizes(), x.sizes());
  EXPECT_EQ(rstd.sizes(), (std::vector<int64_t>{0, 3}));
  auto [dx, dw] = zero_centered_rms_norm_backward(at::randn({0, 3, 32}), x, w, rstd);
  EXPECT_EQ(dx.sizes(), x.sizes());
  EXPECT_TRUE(at::equal(dw, at::zeros({32})));
}

// ---------------------------------------------------------------------------
// Switch and errors

using test_support::error_of;

TEST(RmsNormSwitch, DefaultsToFusedReadsEveryCallAndNamesTheVariableOnABadValue) {
  EXPECT_EQ(current_execution_policy().rms_norm, RmsNormImpl::kFused);
  test_support::PolicyForTest policy("GDR_RMS_NORM", "composite");
  EXPECT_EQ(current_execution_policy().rms_norm, RmsNormImpl::kComposite);
  policy.set("GDR_RMS_NORM", "fused");
  EXPECT_EQ(current_execution_policy().rms_norm, RmsNormImpl::kFused);
  EXPECT_EQ(test_support::policy_error("GDR_RMS_NORM", "fast"),
            "GDR_RMS_NORM: expected fused or composite, but got 'fast'");
}

TEST(RmsNormSwitch, CpuTensorsAreNotTakenByTheFusedCudaPath) {
  EXPECT_FALSE(rms_norm_fused_supports(at::randn({2, 8})));
}

TEST(RmsNormErrors, MessagesNameTheArgumentWithExpectedAndActual) {
  const at::Tensor x = at::randn({2, 3, 16});
  const at::Tensor w = at::randn({16});
  EXPECT_EQ(error_of([&] { zero_centered_rms_norm_forward(x, at::randn({8}), 1e-6); }),
            "zero_centered_rms_norm: expected weight of shape [16] (D = x.size(-1)), but got [8]");
  EXPECT_EQ(error_of([&] { zero_centered_rms_norm_forward(x.to(at::kLong), w, 1e-6); }),
            "zero_centered_rms_norm: expected x of dtype Float, Half, BFloat16 or Double, but got "
            "Long");
  EXPECT_EQ(error_of([&] { zero_centered_rms_norm_forward(at::randn({}), w, 1e-6); }),
            "zero_centered_rms_norm: expected x of shape [..., D] with at least one dimension, but "
            "got a 0-dim tensor");
  EXPECT_EQ(error_of([&] { zero_centered_rms_norm_forward(x, w.to(at::kInt), 1e-6); }),
            "zero_centered_rms_norm: expected weight of dtype Float, Half, BFloat16 or Double, but "
            "got Int");
  EXPECT_EQ(error_of([&] {
              gated_rms_norm_forward(x, at::randn({2, 3, 8}), w, 1e-6, at::kFloat);
            }),
            "gated_rms_norm: expected z of shape [2, 3, 16] (same as o), but got [2, 3, 8]");
  auto [y, rstd] = zero_centered_rms_norm_forward(x, w, 1e-6);
  EXPECT_EQ(error_of([&] {
              zero_centered_rms_norm_backward(at::randn({2, 16}), x, w, rstd);
            }),
            "zero_centered_rms_norm_backward: expected grad_y of shape [2, 3, 16] (same as x), but "
            "got [2, 16]");
  EXPECT_EQ(error_of([&] { zero_centered_rms_norm_backward(y, x, w, at::randn({2})); }),
            "zero_centered_rms_norm_backward: expected rstd of shape [2, 3] (x's shape without the "
            "last dim), but got [2]");
  EXPECT_EQ(
      error_of([&] { zero_centered_rms_norm_backward(y, x, w, rstd.to(at::kHalf)); }),
      "zero_centered_rms_norm_backward: expected rstd of dtype Float (from the forward), but got "
      "Half");
}

// ---------------------------------------------------------------------------
// The residual add (Note [RMSNorm with the residual add]): the CPU op gives the bits of
// ATen's add followed by the norm, the gradient of x and of residual being the norm's dx
// plus the sum's own gradient (autograd's accumulation), in FP32 and BF16.

TEST(AddRmsNormCpu, FusedOpEqualsTheAddThenTheNormBitForBit) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    at::manual_seed(8);
    const at::Tensor x0 = at::randn({3, 5, 64}).to(dtype);
    const at::Tensor r0 = (at::randn({3, 5, 64}) * 3).to(dtype);
    const at::Tensor w0 = at::randn({64}).to(dtype);
    const at::Tensor gy = at::randn({3, 5, 64}).to(dtype);
    const at::Tensor gs = at::randn({3, 5, 64}).to(dtype);
    for (const bool with_grad_sum : {true, false}) {
      auto run = [&](bool fused) {
        const at::Tensor x = x0.clone().requires_grad_(true);
        const at::Tensor r = r0.clone().requires_grad_(true);
        const at::Tensor w = w0.clone().requires_grad_(true);
        at::Tensor y, sum;
        if (fused) {
          std::tie(y, sum) = add_zero_centered_rms_norm_fused(x, r, w, 1e-6);
        } else {
          sum = x + r;
          y = zero_centered_rms_norm_fused(sum, w, 1e-6);
        }
        std::vector<at::Tensor> outputs{y}, grads{gy};
        if (with_grad_sum) {
          outputs.push_back(sum);
          grads.push_back(gs);
        }
        auto g = torch::autograd::grad(outputs, {x, r, w}, grads);
        return std::vector<at::Tensor>{y.detach(), sum.detach(), g[0], g[1], g[2]};
      };
      const auto fused = run(true), composed = run(false);
      for (size_t i = 0; i < fused.size(); ++i) {
        EXPECT_EQ(fused[i].scalar_type(), dtype);
        EXPECT_TRUE(at::equal(fused[i], composed[i]))
            << c10::toString(dtype) << (with_grad_sum ? " with" : " without")
            << " grad_sum, output " << i;
      }
    }
  }
}

TEST(AddRmsNormCpu, OnlyTheSumUsedPassesItsGradientThrough) {
  const at::Tensor x = at::randn({4, 32}).requires_grad_(true);
  const at::Tensor r = at::randn({4, 32}).requires_grad_(true);
  const at::Tensor w = at::randn({32}).requires_grad_(true);
  auto [y, sum] = add_zero_centered_rms_norm_fused(x, r, w, 1e-6);
  const at::Tensor gs = at::randn({4, 32});
  auto g = torch::autograd::grad({sum}, {x, r}, {gs});
  EXPECT_TRUE(at::equal(g[0], gs));
  EXPECT_TRUE(at::equal(g[1], gs));
}

TEST(AddRmsNormSwitch, DefaultsToFusedAndNamesTheVariableOnABadValue) {
  EXPECT_EQ(current_execution_policy().add_rms_norm, AddRmsNormImpl::kFused);
  test_support::PolicyForTest policy("GDR_ADD_RMS_NORM", "composite");
  EXPECT_EQ(current_execution_policy().add_rms_norm, AddRmsNormImpl::kComposite);
  EXPECT_EQ(test_support::policy_error("GDR_ADD_RMS_NORM", "yes"),
            "GDR_ADD_RMS_NORM: expected fused or composite, but got 'yes'");
}

TEST(AddRmsNormErrors, MessagesNameTheArgumentWithExpectedAndActual) {
  const at::Tensor x = at::randn({2, 3, 16});
  const at::Tensor w = at::randn({16});
  EXPECT_EQ(error_of([&] {
              add_zero_centered_rms_norm_forward(x, at::randn({2, 16}), w, 1e-6);
            }),
            "add_zero_centered_rms_norm: expected residual of shape [2, 3, 16] (same as x), but "
            "got [2, 16]");
  EXPECT_EQ(error_of([&] { add_zero_centered_rms_norm_forward(x, x.to(at::kDouble), w, 1e-6); }),
            "add_zero_centered_rms_norm: expected residual of dtype Float (same as x), but got "
            "Double");
  auto [y, sum, rstd] = add_zero_centered_rms_norm_forward(x, x, w, 1e-6);
  EXPECT_EQ(error_of([&] {
              add_zero_centered_rms_norm_backward(y, at::randn({3, 16}), sum, w, rstd);
            }),
            "add_zero_centered_rms_norm_backward: expected grad_sum of shape [2, 3, 16] (same as "
            "sum), but got [3, 16]");
}

// ---------------------------------------------------------------------------
// The backward's launch rule: a pure function of the shape.

TEST(RmsNormLaunch, GridIsAPureFunctionOfTheShape) {
  using kernels::derive_rms_norm_backward_launch;
  const auto small = derive_rms_norm_backward_launch(13, 1024);
  EXPECT_EQ(small.warps, 4);
  EXPECT_EQ(small.rows_per_program, 4);
  EXPECT_EQ(small.programs, 4);
  EXPECT_EQ(small.scratch_floats, 4 * 1024);
  EXPECT_EQ(small.shared_bytes, 4 * 1024 * 4);
  const auto big = derive_rms_norm_backward_launch(65536, 256);
  EXPECT_EQ(big.rows_per_program, 128);
  EXPECT_EQ(big.programs, 512);
  const auto wide = derive_rms_norm_backward_launch(10, 8192);
  EXPECT_EQ(wide.warps, 1);
  EXPECT_EQ(wide.programs, 10);
  EXPECT_EQ(derive_rms_norm_backward_launch(0, 128).programs, 0);
  EXPECT_FALSE(kernels::rms_norm_supports_cols(0));
  EXPECT_FALSE(kernels::rms_norm_supports_cols(kernels::kRmsNormMaxCols + 1));
}

}  // namespace
}  // namespace gdr
