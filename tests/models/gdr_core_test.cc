// The gated delta rule core: the chunked algorithm against the token-by-token reference
// (FP64, tight), its gradients against the reference's, dtypes and argument checks.
#include "ops/gdr_core.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <tuple>
#include <vector>

namespace gdr {
namespace {

struct GdrInputs {
  at::Tensor q, k, v, g, beta, initial_state;
};

// Realistic ranges: unit-norm q/k (the model L2-normalises them), beta in (0, 1), and
// log decays g in (-3, 0) so some chunks decay strongly and some barely.
GdrInputs make_inputs(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, at::ScalarType dtype,
                      uint64_t seed) {
  at::manual_seed(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  GdrInputs in;
  in.q = at::randn({B, T, H, dk}, f64);
  in.q = in.q / in.q.norm(2, -1, true);
  in.k = at::randn({B, T, H, dk}, f64);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = at::randn({B, T, H, dv}, f64);
  in.g = -3.0 * at::rand({B, T, H}, f64);
  in.beta = at::sigmoid(at::randn({B, T, H}, f64));
  in.initial_state = 0.5 * at::randn({B, H, dk, dv}, f64);
  in.q = in.q.to(dtype);
  in.k = in.k.to(dtype);
  in.v = in.v.to(dtype);
  if (dtype != at::kDouble) {
    in.g = in.g.to(at::kFloat);
    in.beta = in.beta.to(at::kFloat);
  }
  return in;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

class ChunkedVsRecurrent : public ::testing::TestWithParam<int64_t> {};

TEST_P(ChunkedVsRecurrent, ChunkedOutputAndFinalStateMatchTheRecurrenceInFp64) {
  const int64_t T = GetParam();
  const GdrInputs in = make_inputs(2, T, 3, 8, 6, at::kDouble, 1234 + T);
  const double scale = 1.0 / std::sqrt(8.0);
  const auto [o_ref, s_ref] =
      gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, scale, in.initial_state, true);
  const auto [o, s] =
      gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, scale, in.initial_state, true);
  ASSERT_EQ(o.sizes(), in.v.sizes());
  ASSERT_EQ(o.scalar_type(), at::kDouble);
  ASSERT_EQ(s.sizes(), (std::vector<int64_t>{2, 3, 8, 6}));
  EXPECT_LT(max_abs_diff(o, o_ref), 1e-11);
  EXPECT_LT(max_abs_diff(s, s_ref), 1e-11);
}

// 64: exactly one chunk; 70 and 130: padded last chunk; 1: almost all padding.
INSTANTIATE_TEST_SUITE_P(Lengths, ChunkedVsRecurrent, ::testing::Values(1, 64, 70, 130));

TEST(GatedDeltaRule, DispatchEntryPointMatchesTheChunkedForm) {
  const GdrInputs in = make_inputs(1, 70, 2, 4, 4, at::kDouble, 7);
  const auto [o, s] =
      gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, 0.5, in.initial_state, true);
  const auto [o_c, s_c] =
      gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, 0.5, in.initial_state, true);
  EXPECT_TRUE(at::equal(o, o_c));
  EXPECT_TRUE(at::equal(s, s_c));
}

TEST(GatedDeltaRule, SmallChunksGiveTheSameResultAsTheDefaultChunk) {
  const GdrInputs in = make_inputs(1, 50, 2, 4, 3, at::kDouble, 8);
  const auto [o64, s64] = gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, 0.5, {}, true);
  const auto [o8, s8] = gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, 0.5, {}, true, 8);
  EXPECT_LT(max_abs_diff(o64, o8), 1e-11);
  EXPECT_LT(max_abs_diff(s64, s8), 1e-11);
}

TEST(GatedDeltaRule, FinalStateIsUndefinedUnlessRequested) {
  const GdrInputs in = make_inputs(1, 3, 1, 2, 2, at::kDouble, 9);
  EXPECT_FALSE(
      std::get<1>(gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, 1.0)).defined());
  EXPECT_FALSE(
      std::get<1>(gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, 1.0)).defined());
}

TEST(GatedDeltaRule, ChunkedGradientsMatchTheRecurrenceGradientsInFp64) {
  GdrInputs in = make_inputs(1, 70, 2, 4, 3, at::kDouble, 10);
  std::vector<at::Tensor> leaves = {in.q, in.k, in.v, in.g, in.beta, in.initial_state};
  for (at::Tensor& t : leaves) t.requires_grad_(true);
  const at::Tensor w_o = at::randn({1, 70, 2, 3}, at::kDouble);
  const at::Tensor w_s = at::randn({1, 2, 4, 3}, at::kDouble);
  auto loss_of = [&](bool chunked) {
    const auto [o, s] = chunked
                            ? gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3],
                                                       leaves[4], 0.5, leaves[5], true)
                            : gated_delta_rule_recurrent(leaves[0], leaves[1], leaves[2], leaves[3],
                                                         leaves[4], 0.5, leaves[5], true);
    return (o * w_o).sum() + (s * w_s).sum();
  };
  const auto grads_chunked = torch::autograd::grad({loss_of(true)}, leaves);
  const auto grads_recurrent = torch::autograd::grad({loss_of(false)}, leaves);
  const char* names[] = {"q", "k", "v", "g", "beta", "initial_state"};
  for (size_t i = 0; i < leaves.size(); ++i) {
    EXPECT_LT(max_abs_diff(grads_chunked[i], grads_recurrent[i]), 1e-10)
        << "gradient of " << names[i];
  }
}

TEST(GatedDeltaRule, Fp32AndBf16InputsRunInFp32AndReturnVsDtype) {
  const GdrInputs ref = make_inputs(2, 70, 2, 8, 8, at::kDouble, 11);
  const at::Tensor o_ref =
      std::get<0>(gated_delta_rule_recurrent(ref.q, ref.k, ref.v, ref.g, ref.beta, 0.35));
  for (const auto& [dtype, tol] : {std::pair{at::kFloat, 1e-4}, std::pair{at::kBFloat16, 0.1}}) {
    const at::Tensor o =
        std::get<0>(gated_delta_rule(ref.q.to(dtype), ref.k.to(dtype), ref.v.to(dtype),
                                     ref.g.to(at::kFloat), ref.beta.to(at::kFloat), 0.35));
    EXPECT_EQ(o.scalar_type(), dtype);
    EXPECT_LT(max_abs_diff(o, o_ref), tol) << dtype;
  }
}

TEST(GatedDeltaRule, RejectsAGateOfTheWrongShapeNamingIt) {
  const GdrInputs in = make_inputs(1, 5, 2, 4, 3, at::kDouble, 12);
  try {
    gated_delta_rule(in.q, in.k, in.v, in.g.narrow(2, 0, 1), in.beta, 1.0);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(
        std::string(e.what_without_backtrace())
            .find("gated_delta_rule_chunked: expected g of shape [1, 5, 2] but got [1, 5, 1]"),
        std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace
}  // namespace gdr
