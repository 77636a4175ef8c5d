// The chunk prep op on CPU: its reference forward and hand-derived backward (Note [Chunk
// prep backward]) against libtorch autograd of the ATen steps 1-6 (chunk_prep_composite)
// in FP64, tight, plain and with the fused q / k L2 norm and head groups (H = 2, 3, 4 Hk);
// the op wired into gated_delta_rule_chunked through the CPU test hook against the ATen
// path (outputs and all gradients, also with raw q / k, GdrQkNorm::kL2 and head groups);
// the core with kL2 giving the bits of the model's former explicit normalise + repeat;
// argument checks with their messages; the prep choice (the policy's gdr_core_prep: its
// values and error messages) and the CPU path staying ATen.
#include "ops/gdr_core/chunk_prep_op.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/gdr_core/gdr_core_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/error_of.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

struct Case {
  int64_t B, T, H, dk, dv, C;
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" + std::to_string(c.H) +
         "_dk" + std::to_string(c.dk) + "_dv" + std::to_string(c.dv) + "_C" + std::to_string(c.C);
}

struct Inputs {
  at::Tensor q, k, v, g, beta;
};

// As the model feeds the core: unit-norm q and k, beta in (0, 1), g in (-2, 0).
Inputs make_inputs(const Case& c, uint64_t seed, at::ScalarType dtype = at::kDouble) {
  at::manual_seed(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  Inputs x;
  x.q = at::randn({c.B, c.T, c.H, c.dk}, f64);
  x.q = (x.q / x.q.norm(2, -1, true)).to(dtype);
  x.k = at::randn({c.B, c.T, c.H, c.dk}, f64);
  x.k = (x.k / x.k.norm(2, -1, true)).to(dtype);
  x.v = at::randn({c.B, c.T, c.H, c.dv}, f64).to(dtype);
  x.g = -2.0 * at::rand({c.B, c.T, c.H}, f64);
  x.beta = at::sigmoid(at::randn({c.B, c.T, c.H}, f64));
  return x;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor bb = b.defined() ? b : at::zeros_like(a);
  return (a.to(at::kDouble) - bb.to(at::kDouble)).abs().max().item<double>();
}

const char* kOutputNames[] = {"u", "w", "qd", "p", "kend", "g_last"};
const char* kGradNames[] = {"dq", "dk", "dv", "dg", "dbeta"};

class ChunkPrepCpu : public ::testing::TestWithParam<Case> {};

TEST_P(ChunkPrepCpu, ForwardAndBackwardMatchAutogradOfTheAtenStepsInFp64) {
  const Case c = GetParam();
  const Inputs x = make_inputs(c, 7 + c.T + c.dk);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  std::vector<at::Tensor> leaves = {x.q, x.k, x.v, x.g, x.beta};
  for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);

  auto ref =
      chunk_prep_composite(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale, c.C);
  auto got = chunk_prep(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale, c.C);
  const std::vector<at::Tensor> ref_out = {std::get<0>(ref), std::get<1>(ref), std::get<2>(ref),
                                           std::get<3>(ref), std::get<4>(ref), std::get<5>(ref)};
  const std::vector<at::Tensor> got_out = {std::get<0>(got), std::get<1>(got), std::get<2>(got),
                                           std::get<3>(got), std::get<4>(got), std::get<5>(got)};
  // Upstream gradients on every output (p's upper triangle too: the state pass hands
  // over a full dP).
  std::vector<at::Tensor> upstream;
  for (size_t i = 0; i < ref_out.size(); ++i) {
    ASSERT_EQ(got_out[i].sizes(), ref_out[i].sizes()) << kOutputNames[i];
    EXPECT_EQ(got_out[i].scalar_type(), at::kDouble) << kOutputNames[i];
    EXPECT_TRUE(got_out[i].is_contiguous()) << kOutputNames[i];
    EXPECT_LT(max_abs_diff(got_out[i], ref_out[i]), 1e-12) << kOutputNames[i];
    upstream.push_back(at::randn(ref_out[i].sizes(), at::kDouble));
  }
  auto loss_of = [&](const std::vector<at::Tensor>& outs) {
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (size_t i = 0; i < outs.size(); ++i) loss = loss + (outs[i] * upstream[i]).sum();
    return loss;
  };
  const auto grads_ref =
      torch::autograd::grad({loss_of(ref_out)}, leaves, {}, /*retain_graph=*/true);
  const auto grads = torch::autograd::grad({loss_of(got_out)}, leaves);
  for (size_t i = 0; i < leaves.size(); ++i) {
    ASSERT_EQ(grads[i].sizes(), leaves[i].sizes()) << kGradNames[i];
    EXPECT_LT(max_abs_diff(grads[i], grads_ref[i]), 1e-10) << "gradient " << kGradNames[i];
  }

  // Each output's gradient alone (the others absent), through the backward op directly.
  for (size_t only = 0; only < upstream.size(); ++only) {
    std::optional<at::Tensor> gr[6];
    gr[only] = upstream[only];
    const auto direct =
        chunk_prep_backward(gr[0], gr[1], gr[2], gr[3], gr[4], gr[5], x.q, x.k, x.v, x.g, x.beta,
                            got_out[0].detach(), got_out[1].detach(), scale, c.C);
    const auto expected = torch::autograd::grad({(ref_out[only] * upstream[only]).sum()}, leaves,
                                                {}, true, false, /*allow_unused=*/true);
    const std::vector<at::Tensor> d = {std::get<0>(direct), std::get<1>(direct),
                                       std::get<2>(direct), std::get<3>(direct),
                                       std::get<4>(direct)};
    for (size_t i = 0; i < d.size(); ++i) {
      EXPECT_LT(max_abs_diff(d[i], expected[i]), 1e-10)
          << "only d" << kOutputNames[only] << ": " << kGradNames[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ChunkPrepCpu,
                         ::testing::Values(Case{1, 16, 1, 3, 2, 16}, Case{2, 45, 3, 5, 4, 8},
                                           Case{1, 100, 2, 64, 32, 64}, Case{1, 64, 1, 64, 48, 64},
                                           Case{1, 130, 2, 128, 64, 64},
                                           Case{2, 70, 1, 16, 24, 64}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return describe(info.param);
                         });

// ---------------------------------------------------------------------------
// The fused q / k L2 norm and head groups

struct FusedCase {
  int64_t B, T, Hk, group, dk, dv, C;
  bool l2;
};

std::string describe(const FusedCase& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_Hk" + std::to_string(c.Hk) +
         "_H" + std::to_string(c.Hk * c.group) + "_dk" + std::to_string(c.dk) + "_dv" +
         std::to_string(c.dv) + "_C" + std::to_string(c.C) + (c.l2 ? "_l2" : "");
}

// Raw q, k [B, T, Hk, dk] (row norms ~0.1 .. 30, one zero row; unit rows when the case has
// no L2 norm, as the delta rule needs) and v, g, beta over H = group Hk value heads, FP64.
Inputs make_raw_inputs(const FusedCase& c, uint64_t seed) {
  at::manual_seed(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const int64_t H = c.Hk * c.group;
  Inputs x;
  x.q = at::randn({c.B, c.T, c.Hk, c.dk}, f64) * (0.01 + 3.0 * at::rand({c.B, c.T, c.Hk, 1}, f64));
  x.k = at::randn({c.B, c.T, c.Hk, c.dk}, f64) * (0.01 + 3.0 * at::rand({c.B, c.T, c.Hk, 1}, f64));
  x.q.select(1, c.T / 2).zero_();
  if (!c.l2) {
    x.q = x.q / (x.q.norm(2, -1, true) + 1e-30);
    x.k = x.k / x.k.norm(2, -1, true);
  }
  x.v = at::randn({c.B, c.T, H, c.dv}, f64);
  x.g = -2.0 * at::rand({c.B, c.T, H}, f64);
  x.beta = at::sigmoid(at::randn({c.B, c.T, H}, f64));
  return x;
}

class ChunkPrepCpuFusedQk : public ::testing::TestWithParam<FusedCase> {};

TEST_P(ChunkPrepCpuFusedQk, ForwardAndBackwardMatchAutogradThroughNormRepeatAndStepsInFp64) {
  const FusedCase c = GetParam();
  const Inputs x = make_raw_inputs(c, 3 + c.T + c.group);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  std::vector<at::Tensor> leaves = {x.q, x.k, x.v, x.g, x.beta};
  for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
  const GdrQkNorm norm = c.l2 ? GdrQkNorm::kL2 : GdrQkNorm::kNone;
  auto ref =
      chunk_prep_composite(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale, c.C, norm);
  auto got = chunk_prep(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale, c.C, c.l2);
  const std::vector<at::Tensor> ref_out = {std::get<0>(ref), std::get<1>(ref), std::get<2>(ref),
                                           std::get<3>(ref), std::get<4>(ref), std::get<5>(ref)};
  const std::vector<at::Tensor> got_out = {std::get<0>(got), std::get<1>(got), std::get<2>(got),
                                           std::get<3>(got), std::get<4>(got), std::get<5>(got)};
  std::vector<at::Tensor> upstream;
  for (size_t i = 0; i < ref_out.size(); ++i) {
    ASSERT_EQ(got_out[i].sizes(), ref_out[i].sizes()) << kOutputNames[i];
    EXPECT_EQ(got_out[i].size(1), c.Hk * c.group) << kOutputNames[i];
    EXPECT_LT(max_abs_diff(got_out[i], ref_out[i]), 1e-12) << describe(c) << " " << kOutputNames[i];
    upstream.push_back(at::randn(ref_out[i].sizes(), at::kDouble));
  }
  auto loss_of = [&](const std::vector<at::Tensor>& outs) {
    at::Tensor loss = at::zeros({}, at::kDouble);
    for (size_t i = 0; i < outs.size(); ++i) loss = loss + (outs[i] * upstream[i]).sum();
    return loss;
  };
  const auto grads_ref =
      torch::autograd::grad({loss_of(ref_out)}, leaves, {}, /*retain_graph=*/true);
  const auto grads = torch::autograd::grad({loss_of(got_out)}, leaves);
  for (size_t i = 0; i < leaves.size(); ++i) {
    ASSERT_EQ(grads[i].sizes(), leaves[i].sizes()) << kGradNames[i];
    EXPECT_TRUE(grads[i].isfinite().all().item<bool>()) << describe(c) << " " << kGradNames[i];
    EXPECT_LT(max_abs_diff(grads[i], grads_ref[i]), 1e-10)
        << describe(c) << " gradient " << kGradNames[i];
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ChunkPrepCpuFusedQk,
                         ::testing::Values(FusedCase{1, 16, 1, 2, 3, 2, 16, true},
                                           FusedCase{2, 45, 2, 3, 5, 4, 8, true},
                                           FusedCase{1, 100, 1, 4, 64, 32, 64, true},
                                           FusedCase{1, 70, 2, 1, 16, 24, 64, true},
                                           FusedCase{2, 30, 1, 2, 8, 8, 16, false}),
                         [](const ::testing::TestParamInfo<FusedCase>& info) {
                           return describe(info.param);
                         });

TEST(ChunkPrepCpu, Bf16RawQkWithFp32VComeBackInTheirOwnDtypes) {
  const FusedCase c{1, 70, 1, 2, 16, 8, 64, true};
  const Inputs x = make_raw_inputs(c, 9);
  const at::Tensor q = x.q.to(at::kBFloat16), k = x.k.to(at::kBFloat16), v = x.v.to(at::kFloat);
  const at::Tensor g = x.g.to(at::kFloat), beta = x.beta.to(at::kFloat);
  const auto out = chunk_prep(q, k, v, g, beta, 0.25, c.C, true);
  EXPECT_EQ(std::get<0>(out).scalar_type(), at::kFloat);
  const auto ref = chunk_prep(q.to(at::kDouble), k.to(at::kDouble), v.to(at::kDouble),
                              g.to(at::kDouble), beta.to(at::kDouble), 0.25, c.C, true);
  EXPECT_LT(max_abs_diff(std::get<0>(out), std::get<0>(ref)), 1e-5);
  const auto grads = chunk_prep_backward(std::get<0>(out), std::get<1>(out), std::nullopt,
                                         std::nullopt, std::nullopt, std::nullopt, q, k, v, g, beta,
                                         std::get<0>(out), std::get<1>(out), 0.25, c.C, true);
  EXPECT_EQ(std::get<0>(grads).scalar_type(), at::kBFloat16);
  EXPECT_EQ(std::get<0>(grads).sizes(), q.sizes());
  EXPECT_EQ(std::get<1>(grads).scalar_type(), at::kBFloat16);
  EXPECT_EQ(std::get<2>(grads).scalar_type(), at::kFloat);
  EXPECT_EQ(std::get<2>(grads).sizes(), v.sizes());
}

TEST(ChunkPrepCpu, Fp32InputsComputeInFp32AndBf16GradientsComeBackInBf16) {
  const Case c{1, 70, 2, 16, 8, 64};
  const Inputs x64 = make_inputs(c, 3);
  const Inputs x = make_inputs(c, 3, at::kBFloat16);
  const at::Tensor g = x.g.to(at::kFloat), beta = x.beta.to(at::kFloat);
  auto out = chunk_prep(x.q, x.k, x.v, g, beta, 0.25, c.C);
  EXPECT_EQ(std::get<0>(out).scalar_type(), at::kFloat);
  auto ref = chunk_prep(x.q.to(at::kDouble), x.k.to(at::kDouble), x.v.to(at::kDouble),
                        g.to(at::kDouble), beta.to(at::kDouble), 0.25, c.C);
  EXPECT_LT(max_abs_diff(std::get<0>(out), std::get<0>(ref)), 1e-5);
  auto grads = chunk_prep_backward(std::get<0>(out), std::get<1>(out), std::nullopt, std::nullopt,
                                   std::nullopt, std::nullopt, x.q, x.k, x.v, g, beta,
                                   std::get<0>(out), std::get<1>(out), 0.25, c.C);
  EXPECT_EQ(std::get<0>(grads).scalar_type(), at::kBFloat16);
  EXPECT_EQ(std::get<2>(grads).scalar_type(), at::kBFloat16);
  EXPECT_EQ(std::get<3>(grads).scalar_type(), at::kFloat);
  (void)x64;
}

using test_support::error_of;

TEST(ChunkPrepChecks, ReportsTheArgumentAndExpectedVersusActual) {
  const Inputs x = make_inputs(Case{1, 10, 2, 4, 3, 8}, 1);
  EXPECT_EQ(error_of([&] { chunk_prep(x.q, x.k, x.v, x.g.narrow(1, 0, 9), x.beta, 1.0, 8); }),
            "chunk_prep: expected g of shape [1, 10, 2] but got [1, 9, 2]");
  EXPECT_EQ(error_of([&] { chunk_prep(x.q, x.k.to(at::kFloat), x.v, x.g, x.beta, 1.0, 8); }),
            "chunk_prep: expected q and k of one floating dtype but got Double and Float");
  EXPECT_EQ(error_of([&] { chunk_prep(x.q, x.k, x.v.to(at::kLong), x.g, x.beta, 1.0, 8); }),
            "chunk_prep: expected v of a floating dtype (Float, BFloat16, Half, Double) but got "
            "Long");
  // Head groups: H = 2 value heads over 4 key heads, and a k whose dk differs from q's.
  const at::Tensor q4 = at::randn({1, 10, 4, 4}, at::kDouble);
  EXPECT_EQ(error_of([&] { chunk_prep(q4, q4, x.v, x.g, x.beta, 1.0, 8, true); }),
            "chunk_prep: expected v's head count H to be a multiple of q and k's head count Hk "
            "but got H = 2, Hk = 4");
  EXPECT_EQ(error_of([&] { chunk_prep(x.q, x.k.narrow(3, 0, 3), x.v, x.g, x.beta, 1.0, 8); }),
            "chunk_prep: expected k of shape [1, 10, 2, 4] (same as q) but got [1, 10, 2, 3]");
  EXPECT_EQ(error_of([&] { chunk_prep(x.q, x.k, x.v, x.g, x.beta, 1.0, 0); }),
            "chunk_prep: expected chunk_size > 0 but got 0");
}

// ---------------------------------------------------------------------------
// The prep switch and the op wired into the core

class GdrCorePrepSwitch : public ::testing::Test {
 protected:
  void SetUp() override { set_gdr_core_prep_op_on_cpu_for_testing(false); }
  void TearDown() override { SetUp(); }
};

// A policy that differs from the defaults in the GDR core's chunk preparation only.
ExecutionPolicy with_prep(GdrCorePrep prep) {
  ExecutionPolicy policy;
  policy.gdr_core_prep = prep;
  return policy;
}

TEST_F(GdrCorePrepSwitch, DefaultsToKernelAndParsesBothNames) {
  EXPECT_EQ(current_execution_policy().gdr_core_prep, GdrCorePrep::kKernel);
  test_support::PolicyForTest policy("gdr_core_prep", "kernel");
  EXPECT_EQ(current_execution_policy().gdr_core_prep, GdrCorePrep::kKernel);
  policy.set("gdr_core_prep", "aten");
  EXPECT_EQ(current_execution_policy().gdr_core_prep, GdrCorePrep::kAten);
  EXPECT_EQ(execution_policy_value(with_prep(GdrCorePrep::kKernel), "gdr_core_prep"), "kernel");
  EXPECT_EQ(execution_policy_value(with_prep(GdrCorePrep::kAten), "gdr_core_prep"), "aten");
}

TEST_F(GdrCorePrepSwitch, InvalidValuesAreRefusedNamingTheSource) {
  ExecutionPolicy refused;
  EXPECT_EQ(set_execution_policy_value(refused, "gdr_core_prep", "composite", "--gdr_core_prep")
                .message(),
            "--gdr_core_prep: expected kernel or aten, but got 'composite'");
  EXPECT_EQ(test_support::policy_error("GDR_CORE_PREP", "Kernel"),
            "GDR_CORE_PREP: expected kernel or aten, but got 'Kernel'");
  const ExecutionPolicyGuard guard(with_prep(GdrCorePrep::kAten));
  EXPECT_EQ(current_execution_policy().gdr_core_prep, GdrCorePrep::kAten);
}

TEST_F(GdrCorePrepSwitch, CpuKeepsTheAtenStepsWhateverTheSwitchSays) {
  const Inputs x = make_inputs(Case{1, 70, 2, 64, 64, 64}, 5, at::kFloat);
  const at::Tensor g = x.g.to(at::kFloat), beta = x.beta.to(at::kFloat);
  std::vector<std::tuple<at::Tensor, at::Tensor>> results;
  for (GdrCorePrep prep : {GdrCorePrep::kKernel, GdrCorePrep::kAten}) {
    const ExecutionPolicyGuard guard(with_prep(prep));
    results.push_back(gated_delta_rule_chunked(x.q, x.k, x.v, g, beta, 0.125, std::nullopt, true));
    EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kAten)
        << execution_policy_value(current_execution_policy(), "gdr_core_prep");
  }
  EXPECT_TRUE(at::equal(std::get<0>(results[0]), std::get<0>(results[1])));
  EXPECT_TRUE(at::equal(std::get<1>(results[0]), std::get<1>(results[1])));
}

TEST_F(GdrCorePrepSwitch, TheFusedNormAndHeadGroupsThroughTheOpMatchTheAtenStepsInFp64) {
  for (const FusedCase& c :
       {FusedCase{2, 45, 1, 3, 5, 4, 8, true}, FusedCase{1, 150, 2, 2, 64, 32, 64, true},
        FusedCase{1, 100, 1, 4, 16, 8, 64, false}}) {
    const Inputs x = make_raw_inputs(c, 17 + c.T);
    const int64_t H = c.Hk * c.group;
    const at::Tensor s0 = at::randn({c.B, H, c.dk, c.dv}, at::kDouble);
    const at::Tensor w_o = at::randn({c.B, c.T, H, c.dv}, at::kDouble);
    const at::Tensor w_s = at::randn({c.B, H, c.dk, c.dv}, at::kDouble);
    const GdrQkNorm norm = c.l2 ? GdrQkNorm::kL2 : GdrQkNorm::kNone;
    auto run = [&](bool through_op) {
      const ExecutionPolicyGuard guard(
          with_prep(through_op ? GdrCorePrep::kKernel : GdrCorePrep::kAten));
      set_gdr_core_prep_op_on_cpu_for_testing(through_op);
      std::vector<at::Tensor> leaves = {x.q, x.k, x.v, x.g, x.beta, s0};
      for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
      auto [o, s] = gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                             0.4, leaves[5], true, c.C, norm);
      EXPECT_EQ(gdr_core_last_prep(), through_op ? GdrCorePrep::kKernel : GdrCorePrep::kAten);
      EXPECT_EQ(o.sizes(), x.v.sizes());
      std::vector<at::Tensor> out = {o.detach(), s.detach()};
      for (const at::Tensor& gr :
           torch::autograd::grad({(o * w_o).sum() + (s * w_s).sum()}, leaves)) {
        out.push_back(gr);
      }
      return out;
    };
    const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
    const std::vector<at::Tensor> aten = run(false), op = run(true);
    for (size_t i = 0; i < op.size(); ++i) {
      EXPECT_LT(max_abs_diff(op[i], aten[i]), 1e-10) << describe(c) << " " << names[i];
    }
  }
}

// What the model did before the core took the norm in (models/qwen/layers.cc): FP32 L2 norm
// of the BF16 conv outputs, repeat_interleave, then the core. The core with raw q / k and
// GdrQkNorm::kL2 runs the same ATen ops on the CPU, so the bits must not move.
TEST_F(GdrCorePrepSwitch, KL2OnCpuGivesTheBitsOfTheModelsFormerNormaliseAndRepeat) {
  const FusedCase c{2, 100, 2, 2, 16, 8, 64, true};
  const Inputs x = make_raw_inputs(c, 23);
  const at::Tensor q_raw = x.q.to(at::kBFloat16), k_raw = x.k.to(at::kBFloat16);
  const at::Tensor v = x.v.to(at::kFloat), g = x.g.to(at::kFloat), beta = x.beta.to(at::kFloat);
  const at::Tensor w_o = at::randn(v.sizes());
  auto run = [&](bool fused) {
    std::vector<at::Tensor> leaves = {q_raw, k_raw, v, g, beta};
    for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
    at::Tensor o;
    if (fused) {
      o = std::get<0>(gated_delta_rule(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], 0.25,
                                       std::nullopt, false, GdrQkNorm::kL2));
    } else {
      auto l2_normalize = [](const at::Tensor& t) {
        const at::Tensor xf = t.to(at::kFloat);
        return xf * (xf.pow(2).sum(-1, /*keepdim=*/true) + 1e-6).rsqrt();
      };
      const at::Tensor q = l2_normalize(leaves[0]).repeat_interleave(c.group, 2);
      const at::Tensor k = l2_normalize(leaves[1]).repeat_interleave(c.group, 2);
      o = std::get<0>(gated_delta_rule(q, k, leaves[2], leaves[3], leaves[4], 0.25));
    }
    std::vector<at::Tensor> out = {o.detach()};
    for (const at::Tensor& gr : torch::autograd::grad({(o * w_o).sum()}, leaves)) out.push_back(gr);
    return out;
  };
  const std::vector<at::Tensor> fused = run(true), explicit_ops = run(false);
  const char* names[] = {"o", "dq", "dk", "dv", "dg", "dbeta"};
  for (size_t i = 0; i < fused.size(); ++i) {
    EXPECT_EQ(fused[i].scalar_type(), explicit_ops[i].scalar_type()) << names[i];
    EXPECT_TRUE(at::equal(fused[i], explicit_ops[i])) << names[i];
  }
  EXPECT_EQ(fused[1].scalar_type(), at::kBFloat16);
  EXPECT_EQ(fused[1].sizes(), q_raw.sizes());
}

TEST(GdrCoreChecks, HeadGroupsDtypesAndShapesAreRefusedNamingThem) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor q = at::randn({1, 10, 4, 8}, f32), v = at::randn({1, 10, 6, 4}, f32);
  const at::Tensor g6 = at::zeros({1, 10, 6}, f32);
  EXPECT_EQ(error_of([&] { gated_delta_rule(q, q, v, g6, g6, 1.0); }),
            "gated_delta_rule_chunked: expected v's head count H to be a multiple of q and k's "
            "head count Hk but got H = 6, Hk = 4");
  const at::Tensor v8 = at::randn({1, 10, 8, 4}, f32), g8 = at::zeros({1, 10, 8}, f32);
  EXPECT_EQ(error_of([&] { gated_delta_rule(q, q.narrow(3, 0, 7), v8, g8, g8, 1.0); }),
            "gated_delta_rule_chunked: expected k of shape [1, 10, 4, 8] (same as q) but got [1, "
            "10, 4, 7]");
  EXPECT_EQ(error_of([&] { gated_delta_rule(q, q, v8, g8.narrow(2, 0, 4), g8, 1.0); }),
            "gated_delta_rule_chunked: expected g of shape [1, 10, 8] but got [1, 10, 4]");
  EXPECT_EQ(
      error_of([&] {
        gated_delta_rule(q, q, v8, g8, g8, 1.0, at::zeros({1, 4, 8, 4}, f32), true, GdrQkNorm::kL2);
      }),
      "gated_delta_rule_chunked: expected initial_state of shape [1, 8, 8, 4] ([B, H, dk, "
      "dv]) but got [1, 4, 8, 4]");
  EXPECT_EQ(error_of([&] { gated_delta_rule(q, q.to(at::kBFloat16), v8, g8, g8, 1.0); }),
            "gated_delta_rule_chunked: expected q and k of one dtype but got Float and BFloat16");
  EXPECT_EQ(error_of([&] {
              gated_delta_rule(q.to(at::kInt), q.to(at::kInt), v8, g8, g8, 1.0, std::nullopt, false,
                               GdrQkNorm::kL2);
            }),
            "gated_delta_rule_chunked: expected floating-point inputs (Float, BFloat16, Half, "
            "Double) but got Int");
  EXPECT_EQ(error_of([&] {
              gated_delta_rule_recurrent(q, q, v, g6, g6, 1.0, std::nullopt, false, GdrQkNorm::kL2);
            }),
            "gated_delta_rule_recurrent: expected v's head count H to be a multiple of q and k's "
            "head count Hk but got H = 6, Hk = 4");
}

TEST_F(GdrCorePrepSwitch, TheOpWiredIntoTheCoreMatchesTheAtenStepsWithGradientsInFp64) {
  for (const Case& c : {Case{2, 45, 3, 5, 4, 8}, Case{1, 150, 2, 64, 32, 64}}) {
    const Inputs x = make_inputs(c, 11 + c.T);
    const at::Tensor s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kDouble);
    const at::Tensor w_o = at::randn({c.B, c.T, c.H, c.dv}, at::kDouble);
    const at::Tensor w_s = at::randn({c.B, c.H, c.dk, c.dv}, at::kDouble);
    auto run = [&](bool through_op, bool step7_op) {
      const ExecutionPolicyGuard guard(
          with_prep(through_op ? GdrCorePrep::kKernel : GdrCorePrep::kAten));
      set_gdr_core_prep_op_on_cpu_for_testing(through_op);
      set_gdr_core_op_on_cpu_for_testing(step7_op);
      std::vector<at::Tensor> leaves = {x.q, x.k, x.v, x.g, x.beta, s0};
      for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
      auto [o, s] = gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                             0.4, leaves[5], true, c.C);
      EXPECT_EQ(gdr_core_last_prep(), through_op ? GdrCorePrep::kKernel : GdrCorePrep::kAten);
      std::vector<at::Tensor> out = {o.detach(), s.detach()};
      for (const at::Tensor& gr :
           torch::autograd::grad({(o * w_o).sum() + (s * w_s).sum()}, leaves)) {
        out.push_back(gr);
      }
      set_gdr_core_op_on_cpu_for_testing(false);
      return out;
    };
    const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
    for (bool step7_op : {false, true}) {
      const std::vector<at::Tensor> aten = run(false, step7_op), op = run(true, step7_op);
      for (size_t i = 0; i < op.size(); ++i) {
        EXPECT_LT(max_abs_diff(op[i], aten[i]), 1e-10)
            << describe(c) << (step7_op ? " step 7 op " : " step 7 loop ") << names[i];
      }
    }
  }
}

}  // namespace
}  // namespace gdr
