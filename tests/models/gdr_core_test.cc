// The gated delta rule core: the chunked algorithm against the token-by-token reference
// (FP64, tight), its gradients against the reference's, dtypes and argument checks.
#include "ops/gdr_core/gdr_core_op.h"

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

// Raw q, k with Hk key heads and GdrQkNorm::kL2 (the model's call): the chunked form
// against the recurrence (both run gdr::chunk_prep_qk, then their own algorithm), outputs,
// final state and every gradient, FP64, H = 2 Hk and 4 Hk.
TEST(GatedDeltaRule, FusedNormAndHeadGroupsChunkedMatchesTheRecurrenceInFp64) {
  for (const int64_t group : {2, 4}) {
    at::manual_seed(40 + group);
    const int64_t B = 1, T = 70, Hk = 2, H = Hk * group, dk = 4, dv = 3;
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    std::vector<at::Tensor> leaves = {
        at::randn({B, T, Hk, dk}, f64) * 3.0,   at::randn({B, T, Hk, dk}, f64) * 0.2,
        at::randn({B, T, H, dv}, f64),          -3.0 * at::rand({B, T, H}, f64),
        at::sigmoid(at::randn({B, T, H}, f64)), 0.5 * at::randn({B, H, dk, dv}, f64)};
    for (at::Tensor& t : leaves) t.requires_grad_(true);
    const at::Tensor w_o = at::randn({B, T, H, dv}, f64), w_s = at::randn({B, H, dk, dv}, f64);
    auto run = [&](bool chunked) {
      const auto [o, s] =
          chunked ? gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                             0.5, leaves[5], true, 16, GdrQkNorm::kL2)
                  : gated_delta_rule_recurrent(leaves[0], leaves[1], leaves[2], leaves[3],
                                               leaves[4], 0.5, leaves[5], true, GdrQkNorm::kL2);
      std::vector<at::Tensor> out = {o.detach(), s.detach()};
      for (const at::Tensor& g :
           torch::autograd::grad({(o * w_o).sum() + (s * w_s).sum()}, leaves)) {
        out.push_back(g);
      }
      return out;
    };
    const auto chunked = run(true), recurrent = run(false);
    ASSERT_EQ(chunked[0].sizes(), (std::vector<int64_t>{B, T, H, dv}));
    ASSERT_EQ(chunked[2].sizes(), leaves[0].sizes());
    const char* names[] = {"o", "final_state", "q", "k", "v", "g", "beta", "initial_state"};
    for (size_t i = 0; i < chunked.size(); ++i) {
      EXPECT_LT(max_abs_diff(chunked[i], recurrent[i]), 1e-10) << "H = " << H << " " << names[i];
    }
  }
}

// Packed documents: the same bits as separate calls, no state crossing a boundary, and
// gradients that reach every document's tokens and initial state.
TEST(GatedDeltaRuleVarlen, PackedDocumentsEqualSeparateCallsBitForBit) {
  // Lengths 70 (two chunks, a tail), 0 (empty), 5, 64 (exactly one chunk).
  const std::vector<int64_t> cu = {0, 70, 70, 75, 139};
  const GdrInputs in = make_inputs(1, 139, 2, 8, 6, at::kFloat, 31);
  const at::Tensor s0 = 0.5 * at::randn({4, 2, 8, 6}, at::kFloat);
  const double scale = 1.0 / std::sqrt(8.0);
  const auto [o, s] = gated_delta_rule_varlen(in.q, in.k, in.v, in.g, in.beta, scale, cu, s0, true);
  ASSERT_EQ(o.sizes(), in.v.sizes());
  ASSERT_EQ(s.sizes(), (std::vector<int64_t>{4, 2, 8, 6}));
  for (int64_t i = 0; i < 4; ++i) {
    const int64_t start = cu[i], length = cu[i + 1] - cu[i];
    if (length == 0) {
      EXPECT_TRUE(at::equal(s[i], s0[i])) << "an empty document keeps its initial state";
      continue;
    }
    auto slice = [&](const at::Tensor& t) { return t.narrow(1, start, length); };
    const auto [o_i, s_i] = gated_delta_rule(slice(in.q), slice(in.k), slice(in.v), slice(in.g),
                                             slice(in.beta), scale, s0.narrow(0, i, 1), true);
    EXPECT_TRUE(at::equal(slice(o), o_i)) << "document " << i;
    EXPECT_TRUE(at::equal(s.narrow(0, i, 1), s_i)) << "document " << i;
  }
}

TEST(GatedDeltaRuleVarlen, FusedNormAndHeadGroupsEqualSeparateCallsBitForBit) {
  const std::vector<int64_t> cu = {0, 70, 75, 139};
  at::manual_seed(34);
  const int64_t Hk = 1, H = 2, dk = 8, dv = 6, T = 139;
  const at::Tensor q = at::randn({1, T, Hk, dk}) * 2.0, k = at::randn({1, T, Hk, dk});
  const GdrInputs in = make_inputs(1, T, H, dk, dv, at::kFloat, 35);
  const at::Tensor s0 = 0.5 * at::randn({3, H, dk, dv});
  const auto [o, s] = gated_delta_rule_varlen(q.to(at::kBFloat16), k.to(at::kBFloat16), in.v, in.g,
                                              in.beta, 0.3, cu, s0, true, GdrQkNorm::kL2);
  ASSERT_EQ(o.sizes(), in.v.sizes());
  ASSERT_EQ(s.sizes(), s0.sizes());
  for (int64_t i = 0; i < 3; ++i) {
    auto slice = [&](const at::Tensor& t) { return t.narrow(1, cu[i], cu[i + 1] - cu[i]); };
    const auto [o_i, s_i] = gated_delta_rule(slice(q.to(at::kBFloat16)), slice(k.to(at::kBFloat16)),
                                             slice(in.v), slice(in.g), slice(in.beta), 0.3,
                                             s0.narrow(0, i, 1), true, GdrQkNorm::kL2);
    EXPECT_TRUE(at::equal(slice(o), o_i)) << "document " << i;
    EXPECT_TRUE(at::equal(s.narrow(0, i, 1), s_i)) << "document " << i;
  }
}

TEST(GatedDeltaRuleVarlen, NoStateLeaksAcrossADocumentBoundary) {
  const GdrInputs in = make_inputs(1, 40, 2, 4, 4, at::kDouble, 32);
  const double scale = 0.5;
  const auto [packed, unused] =
      gated_delta_rule_varlen(in.q, in.k, in.v, in.g, in.beta, scale, {0, 25, 40});
  // The second document alone, from zeros, is the recurrence over its tokens only.
  auto tail = [&](const at::Tensor& t) { return t.narrow(1, 25, 15); };
  const auto [alone, unused2] = gated_delta_rule_recurrent(tail(in.q), tail(in.k), tail(in.v),
                                                           tail(in.g), tail(in.beta), scale);
  EXPECT_LT(max_abs_diff(packed.narrow(1, 25, 15), alone), 1e-12);
  // Without the boundary the second document's outputs change.
  const auto [joined, unused3] = gated_delta_rule(in.q, in.k, in.v, in.g, in.beta, scale);
  EXPECT_GT(max_abs_diff(joined.narrow(1, 25, 15), alone), 1e-3);
}

TEST(GatedDeltaRuleVarlen, GradientsMatchSeparateCalls) {
  const std::vector<int64_t> cu = {0, 9, 30};
  GdrInputs in = make_inputs(1, 30, 2, 4, 3, at::kDouble, 33);
  const at::Tensor s0 = 0.5 * at::randn({2, 2, 4, 3}, at::kDouble);
  auto run = [&](bool packed) {
    std::vector<at::Tensor> leaves = {
        in.q.clone().requires_grad_(),    in.k.clone().requires_grad_(),
        in.v.clone().requires_grad_(),    in.g.clone().requires_grad_(),
        in.beta.clone().requires_grad_(), s0.clone().requires_grad_()};
    at::Tensor loss;
    if (packed) {
      const auto [o, s] = gated_delta_rule_varlen(leaves[0], leaves[1], leaves[2], leaves[3],
                                                  leaves[4], 0.5, cu, leaves[5], true);
      loss = (o * o).sum() + (s * s).sum();
    } else {
      loss = at::zeros({}, at::kDouble);
      for (int64_t i = 0; i < 2; ++i) {
        auto slice = [&](const at::Tensor& t) { return t.narrow(1, cu[i], cu[i + 1] - cu[i]); };
        const auto [o, s] =
            gated_delta_rule(slice(leaves[0]), slice(leaves[1]), slice(leaves[2]), slice(leaves[3]),
                             slice(leaves[4]), 0.5, leaves[5].narrow(0, i, 1), true);
        loss = loss + (o * o).sum() + (s * s).sum();
      }
    }
    return torch::autograd::grad({loss}, leaves);
  };
  const auto packed = run(true), separate = run(false);
  const char* names[] = {"q", "k", "v", "g", "beta", "initial_state"};
  for (size_t i = 0; i < packed.size(); ++i) {
    EXPECT_LT(max_abs_diff(packed[i], separate[i]), 1e-12) << names[i];
    EXPECT_GT(packed[i].abs().max().item<double>(), 0.0) << names[i];
  }
}

TEST(GatedDeltaRuleVarlen, RejectsBadOffsetsNamingThem) {
  const GdrInputs in = make_inputs(1, 10, 2, 4, 3, at::kDouble, 34);
  auto message = [&](const std::vector<int64_t>& cu) -> std::string {
    try {
      gated_delta_rule_varlen(in.q, in.k, in.v, in.g, in.beta, 1.0, cu);
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(message({0, 4, 9}).find("gated_delta_rule_varlen: expected cu_seqlens to run from 0 "
                                    "to T = 10 but got 0 .. 9"),
            std::string::npos)
      << message({0, 4, 9});
  EXPECT_NE(message({0, 6, 4, 10})
                .find("gated_delta_rule_varlen: expected non-decreasing "
                      "cu_seqlens but offset 2 (4) < offset 1 (6)"),
            std::string::npos)
      << message({0, 6, 4, 10});
  EXPECT_NE(message({10}).find("gated_delta_rule_varlen: expected cu_seqlens with at least 2 "
                               "offsets (one document) but got 1"),
            std::string::npos);
  try {
    gated_delta_rule_varlen(in.q.expand({2, 10, 2, 4}), in.k, in.v, in.g, in.beta, 1.0, {0, 10});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("gated_delta_rule_varlen: expected packed q of shape [1, T, Hk, dk] but "
                        "got [2, 10, 2, 4]"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace
}  // namespace gdr
