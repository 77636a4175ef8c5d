// The segment-parallel gated delta rule (ops/gdr_core/segment_parallel.h): the plan rule
// (pure, edge cases), pass 1's affine map, the three passes against the recurrence and the
// chunked form in FP64 (tight) and FP32 (a tolerance derived from the chunked form's own
// error), gradients through the composite against the chunked path, and a wrong combine
// order being caught.
#include "ops/gdr_core/segment_parallel.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <string>
#include <vector>

#include "ops/gdr_core/gdr_core_op.h"
#include "tests/ops/error_of.h"

namespace gdr {
namespace {

using test_support::error_of;

// ---- The plan ----

void expect_valid(const GdrSegmentPlan& p, int64_t T, int64_t chunk, const std::string& context) {
  EXPECT_EQ(p.chunk, chunk) << context;
  EXPECT_GT(p.segment_len, 0) << context;
  EXPECT_EQ(p.segment_len % chunk, 0) << context;
  EXPECT_GE(p.num_segments, 1) << context;
  EXPECT_LT((p.num_segments - 1) * p.segment_len, T) << context << ": an empty segment";
  EXPECT_GE(p.num_segments * p.segment_len, T) << context << ": tokens left over";
}

TEST(GdrSegmentPlan, LongSequenceAtSmallBatchTimesHeadsFillsOneWave) {
  // B * H = 16 on 132 SMs: floor(132 / 16) = 8 segments; N = 256 chunks -> 32 chunks each.
  const GdrSegmentPlan p = plan_gdr_segments(1, 16384, 16, 64, 132);
  expect_valid(p, 16384, 64, "16 x 16384");
  EXPECT_EQ(p.num_segments, 8);
  EXPECT_EQ(p.segment_len, 2048);
  // The same with T = 16383 (not a multiple of the chunk) and B = 2, H = 8.
  const GdrSegmentPlan p2 = plan_gdr_segments(2, 16383, 8, 64, 132);
  EXPECT_EQ(p2.num_segments, 8);
  EXPECT_EQ(p2.segment_len, 2048);
  // B * H = 1, T = 65536: 1024 chunks over 132 segments -> 8 chunks, 128 segments.
  const GdrSegmentPlan q = plan_gdr_segments(1, 65536, 1, 64, 132);
  expect_valid(q, 65536, 64, "1 x 65536");
  EXPECT_EQ(q.segment_len, 512);
  EXPECT_EQ(q.num_segments, 128);
  // The minimum segment: 1000 tokens = 16 chunks, B * H = 1 could use 132 segments but gets
  // 4 of 4 chunks (the last one 232 tokens).
  const GdrSegmentPlan r = plan_gdr_segments(1, 1000, 1, 64, 132);
  expect_valid(r, 1000, 64, "1 x 1000");
  EXPECT_EQ(r.segment_len, 4 * 64);
  EXPECT_EQ(r.num_segments, 4);
  // B * H = 44 = 132 / 3: the last shape cut, 3 segments.
  EXPECT_EQ(plan_gdr_segments(4, 16384, 11, 64, 132).num_segments, 3);
  // 9 chunks: 3 segments of 4, 4 and 1 chunks (the last one a single token).
  const GdrSegmentPlan t = plan_gdr_segments(1, 8 * 64 + 1, 1, 64, 132);
  expect_valid(t, 8 * 64 + 1, 64, "1 x 513");
  EXPECT_EQ(t.num_segments, 3);
  EXPECT_EQ(t.segment_len, 256);
}

TEST(GdrSegmentPlan, NoSegmentsWhenTheHeadsFillTheGpuOrTheSequenceIsShort) {
  // B * H >= 45 on 132 SMs (fewer than 3 segments per walk), T < chunk, T of <= 8 chunks
  // (two segments at most), huge shapes.
  for (const auto& [B, T, H] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {1, 65536, 132},
           {8, 65536, 16},
           {1, 65536, 45},
           {5, 65536, 9},
           {1 << 20, 1 << 20, 1 << 20},
           {int64_t{1} << 40, 65536, int64_t{1} << 40},
           {1, 1, 1},
           {1, 63, 1},
           {1, 64, 1},
           {2, 7 * 64 + 5, 4},
           {1, 8 * 64, 1}}) {
    const std::string context =
        "B " + std::to_string(B) + " T " + std::to_string(T) + " H " + std::to_string(H);
    const GdrSegmentPlan p = plan_gdr_segments(B, T, H, 64, 132);
    expect_valid(p, T, 64, context);
    EXPECT_EQ(p.num_segments, 1) << context;
    EXPECT_EQ(p.segment_len, (T + 63) / 64 * 64) << context;
  }
}

TEST(GdrSegmentPlan, IsAPureFunctionAndAlwaysValid) {
  for (int64_t sms : {1, 16, 78, 132}) {
    for (int64_t bh : {1, 2, 3, 16, 31, 44, 45, 64, 200}) {
      for (int64_t T : {1, 17, 64, 65, 511, 512, 513, 1000, 4096, 16383, 16384, 65536}) {
        for (int64_t chunk : {16, 64}) {
          const std::string context = "sms " + std::to_string(sms) + " BH " + std::to_string(bh) +
                                      " T " + std::to_string(T) + " C " + std::to_string(chunk);
          const GdrSegmentPlan p = plan_gdr_segments(1, T, bh, chunk, sms);
          const GdrSegmentPlan again = plan_gdr_segments(1, T, bh, chunk, sms);
          EXPECT_EQ(p.segment_len, again.segment_len) << context;
          EXPECT_EQ(p.num_segments, again.num_segments) << context;
          expect_valid(p, T, chunk, context);
          if (p.num_segments > 1) {
            EXPECT_GE(p.segment_len / chunk, kGdrMinSegmentChunks) << context;
            EXPECT_GE(p.num_segments, kGdrMinSegments) << context;
            EXPECT_LE(bh * p.num_segments, sms) << context << ": more than one wave";
          } else {
            EXPECT_EQ(p.segment_len, (T + chunk - 1) / chunk * chunk) << context;
          }
        }
      }
    }
  }
}

TEST(GdrSegmentPlan, RejectsBadArguments) {
  EXPECT_EQ(error_of([] { plan_gdr_segments(1, 0, 1, 64, 132); }),
            "plan_gdr_segments: expected positive B, T, H, chunk and num_sms but got B = 1, T = "
            "0, H = 1, chunk = 64, num_sms = 132");
  EXPECT_NE(error_of([] { plan_gdr_segments(1, 10, 1, 64, 0); }), "(no error)");
  EXPECT_EQ(error_of([] { gdr_segment_plan_of_length(100, 48, 32); }),
            "gdr_segment_plan_of_length: expected a segment length that is a positive multiple of "
            "the chunk size but got segment_len = 48, chunk = 32");
  const GdrSegmentPlan p = gdr_segment_plan_of_length(100, 32, 16);
  EXPECT_EQ(p.num_segments, 4);
}

// ---- The three passes ----

struct GdrInputs {
  at::Tensor q, k, v, g, beta, initial_state;
};

// As tests/models/gdr_core_test.cc: unit-norm q / k, beta in (0, 1), g in (-g_range, 0)
// (3: the state mostly forgotten within a chunk; 0.02: carried over whole sequences, so the
// combine matters); Hk key heads, H value heads.
GdrInputs make_inputs(int64_t B, int64_t T, int64_t Hk, int64_t H, int64_t dk, int64_t dv,
                      at::ScalarType dtype, uint64_t seed, double g_range = 3.0) {
  at::manual_seed(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  GdrInputs in;
  in.q = at::randn({B, T, Hk, dk}, f64);
  in.q = in.q / in.q.norm(2, -1, true);
  in.k = at::randn({B, T, Hk, dk}, f64);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = at::randn({B, T, H, dv}, f64);
  in.g = -g_range * at::rand({B, T, H}, f64);
  in.beta = at::sigmoid(at::randn({B, T, H}, f64));
  in.initial_state = 0.5 * at::randn({B, H, dk, dv}, f64);
  for (at::Tensor* t : {&in.q, &in.k, &in.v, &in.g, &in.beta, &in.initial_state}) {
    *t = t->to(dtype);
  }
  return in;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

TEST(GdrSegmentTransition, IsTheAffineMapOfTheSegment) {
  // final(S0) = A S0 + Bs for any S0, and Bs is the run from zeros.
  const GdrInputs in = make_inputs(2, 21, 1, 2, 5, 3, at::kDouble, 11);
  const auto [A, Bs] = gdr_segment_transition(in.k, in.v, in.g, in.beta, 4);
  ASSERT_EQ(A.sizes(), (std::vector<int64_t>{2, 2, 5, 5}));
  ASSERT_EQ(Bs.sizes(), (std::vector<int64_t>{2, 2, 5, 3}));
  for (int seed = 0; seed < 2; ++seed) {
    const at::Tensor S0 = seed == 0 ? at::zeros_like(in.initial_state) : in.initial_state;
    const auto [o, s] = gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, 0.5, S0, true);
    EXPECT_LT(max_abs_diff(A.matmul(S0) + Bs, s), 1e-12);
  }
  // A does not depend on v.
  const auto [A2, Bs2] = gdr_segment_transition(in.k, 3.0 * in.v, in.g, in.beta, 4);
  EXPECT_LT(max_abs_diff(A2, A), 1e-14);
  EXPECT_GT(max_abs_diff(Bs2, Bs), 1e-3);
}

struct Case {
  int64_t B, T, Hk, H, dk, dv, chunk, segment_len;
  bool initial_state;
  GdrQkNorm qk_norm;
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_Hk" + std::to_string(c.Hk) +
         "_H" + std::to_string(c.H) + "_C" + std::to_string(c.chunk) + "_seg" +
         std::to_string(c.segment_len) + (c.initial_state ? "_S0" : "_noS0") +
         (c.qk_norm == GdrQkNorm::kL2 ? "_l2" : "");
}

class SegmentedFp64 : public ::testing::TestWithParam<Case> {};

TEST_P(SegmentedFp64, OutputAndFinalStateMatchTheRecurrenceAndTheChunkedForm) {
  const Case c = GetParam();
  const GdrInputs in = make_inputs(c.B, c.T, c.Hk, c.H, c.dk, c.dv, at::kDouble, 100 + c.T, 0.3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  std::optional<at::Tensor> s0;
  if (c.initial_state) s0 = in.initial_state;
  const GdrSegmentPlan plan = gdr_segment_plan_of_length(c.T, c.segment_len, c.chunk);
  const auto [o, s] =
      gated_delta_rule_segmented(in.q, in.k, in.v, in.g, in.beta, scale, plan, s0, true, c.qk_norm);
  const auto [o_rec, s_rec] =
      gated_delta_rule_recurrent(in.q, in.k, in.v, in.g, in.beta, scale, s0, true, c.qk_norm);
  const auto [o_ch, s_ch] = gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, scale, s0,
                                                     true, c.chunk, c.qk_norm);
  ASSERT_EQ(o.sizes(), in.v.sizes());
  ASSERT_EQ(o.scalar_type(), at::kDouble);
  ASSERT_EQ(s.sizes(), (std::vector<int64_t>{c.B, c.H, c.dk, c.dv}));
  const double e_o_rec = max_abs_diff(o, o_rec), e_s_rec = max_abs_diff(s, s_rec);
  const double e_o_ch = max_abs_diff(o, o_ch), e_s_ch = max_abs_diff(s, s_ch);
  EXPECT_LT(e_o_rec, 1e-12);
  EXPECT_LT(e_s_rec, 1e-12);
  EXPECT_LT(e_o_ch, 1e-12);
  EXPECT_LT(e_s_ch, 1e-12);
  std::printf(
      "%s: %lld segments, |o - rec| %.3g |S - rec| %.3g |o - chunked| %.3g "
      "|S - chunked| %.3g\n",
      describe(c).c_str(), static_cast<long long>(plan.num_segments), e_o_rec, e_s_rec, e_o_ch,
      e_s_ch);
  // Without the final state: the same o.
  const auto [o2, s2] = gated_delta_rule_segmented(in.q, in.k, in.v, in.g, in.beta, scale, plan, s0,
                                                   false, c.qk_norm);
  EXPECT_FALSE(s2.defined());
  EXPECT_TRUE(at::equal(o2, o));
}

// T = 27 with chunk 4: segments of 28 (1), 16 (2), 12 (3) and 4 (7) tokens, the last one
// short; T = 24 in 3 full segments; Hv > Hk; with and without an initial state; the L2 norm.
// g in (-0.3, 0), so the state entering a segment still matters at its end.
INSTANTIATE_TEST_SUITE_P(Plans, SegmentedFp64,
                         ::testing::Values(Case{2, 27, 2, 2, 6, 5, 4, 28, true, GdrQkNorm::kNone},
                                           Case{2, 27, 2, 2, 6, 5, 4, 16, true, GdrQkNorm::kNone},
                                           Case{2, 27, 2, 2, 6, 5, 4, 12, false, GdrQkNorm::kNone},
                                           Case{2, 27, 2, 2, 6, 5, 4, 4, true, GdrQkNorm::kNone},
                                           Case{1, 24, 1, 3, 6, 4, 4, 8, false, GdrQkNorm::kNone},
                                           Case{1, 27, 1, 4, 5, 7, 4, 8, true, GdrQkNorm::kL2},
                                           Case{2, 50, 1, 2, 4, 4, 8, 16, true, GdrQkNorm::kNone},
                                           Case{1, 3, 1, 1, 4, 4, 4, 4, true, GdrQkNorm::kNone}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return describe(info.param);
                         });

TEST(SegmentedFp64Gradients, MatchTheChunkedPath) {
  const GdrInputs base = make_inputs(2, 27, 1, 2, 5, 4, at::kDouble, 77, 0.3);
  const GdrSegmentPlan plan = gdr_segment_plan_of_length(27, 8, 4);  // 4 segments
  ASSERT_EQ(plan.num_segments, 4);
  at::manual_seed(5);
  const at::Tensor w_o = at::randn({2, 27, 2, 4}, at::kDouble);
  const at::Tensor w_s = at::randn({2, 2, 5, 4}, at::kDouble);
  auto grads = [&](bool segmented) {
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& t : {base.q, base.k, base.v, base.g, base.beta, base.initial_state}) {
      leaves.push_back(t.detach().clone().requires_grad_(true));
    }
    at::Tensor o, s;
    if (segmented) {
      std::tie(o, s) = gated_delta_rule_segmented(leaves[0], leaves[1], leaves[2], leaves[3],
                                                  leaves[4], 0.5, plan, leaves[5], true);
    } else {
      std::tie(o, s) = gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3],
                                                leaves[4], 0.5, leaves[5], true, 4);
    }
    const at::Tensor loss = (o * w_o).sum() + (s * w_s).sum();
    return torch::autograd::grad({loss}, leaves);
  };
  const auto g_seg = grads(true), g_ch = grads(false);
  const char* names[] = {"q", "k", "v", "g", "beta", "initial_state"};
  for (size_t i = 0; i < g_seg.size(); ++i) {
    const double e = max_abs_diff(g_seg[i], g_ch[i]);
    std::printf("grad %s: |segmented - chunked| %.3g (max |grad| %.3g)\n", names[i], e,
                g_ch[i].abs().max().item<double>());
    EXPECT_LT(e, 1e-11) << names[i];
  }
}

// The state entering each segment by a wrong combine: the right map, the wrong order
// (last segment first) or the wrong side (S A^T, the [dv, dk] orientation's formula).
TEST(SegmentedFp64, AWrongCombineIsCaught) {
  const GdrInputs in = make_inputs(1, 27, 1, 2, 5, 5, at::kDouble, 3, 0.02);
  const GdrSegmentPlan plan = gdr_segment_plan_of_length(27, 4, 4);  // 7 segments
  const auto [o_ch, s_ch] =
      gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, 0.5, in.initial_state, true, 4);
  const int64_t n = plan.num_segments;
  std::vector<at::Tensor> As, Bss;
  for (int64_t i = 0; i < n - 1; ++i) {
    const auto [A, Bs] =
        gdr_segment_transition(in.k.narrow(1, 4 * i, 4), in.v.narrow(1, 4 * i, 4),
                               in.g.narrow(1, 4 * i, 4), in.beta.narrow(1, 4 * i, 4), 4);
    As.push_back(A);
    Bss.push_back(Bs);
  }
  const at::Tensor A = at::stack(As, 1), Bs = at::stack(Bss, 1);  // [1, n - 1, H, d, d]
  const at::Tensor right = gdr_combine_segment_states(A, Bs, in.initial_state);
  // The right combine's last state, one more step, is the chunked final state.
  const auto [A_last, B_last] =
      gdr_segment_transition(in.k.narrow(1, 24, 3), in.v.narrow(1, 24, 3), in.g.narrow(1, 24, 3),
                             in.beta.narrow(1, 24, 3), 4);
  EXPECT_LT(max_abs_diff(A_last.matmul(right.select(1, n - 1)) + B_last, s_ch), 1e-12);
  const at::Tensor reversed = gdr_combine_segment_states(A.flip(1), Bs.flip(1), in.initial_state);
  EXPECT_GT(max_abs_diff(A_last.matmul(reversed.select(1, n - 1)) + B_last, s_ch), 1e-3);
  at::Tensor S = in.initial_state;
  for (int64_t i = 0; i < n - 1; ++i) {
    S = S.matmul(A.select(1, i).transpose(-1, -2)) + Bs.select(1, i);
  }
  EXPECT_GT(max_abs_diff(A_last.matmul(S) + B_last, s_ch), 1e-3);
}

// FP32: the segmented form reassociates the chunk products (A_i S_i instead of the chunk
// walk), so it is not bitwise equal to the chunked form; both are compared with the FP64
// recurrence. Each combine step is a length-dk dot product per element (relative rounding
// ~dk * 2^-24) and every map is a contraction (decays <= 1, (I - beta k k^T) with |k| = 1,
// beta in (0, 1)), so combine errors do not grow along the segments: the segmented error
// is the chunked error plus about n * dk * 2^-24 * max|S| at worst. The bound asserted:
// at most 2x the chunked form's own FP32 error plus n dk 2^-24 max|ref|.
TEST(SegmentedFp32, ErrorIsThatOfTheChunkedForm) {
  const int64_t T = 1000, dk = 32, dv = 32;
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  const double eps = std::ldexp(1.0, -24);
  for (double g_range : {3.0, 0.02}) {
    const GdrInputs in64 = make_inputs(2, T, 2, 4, dk, dv, at::kDouble, 9, g_range);
    const GdrInputs in = make_inputs(2, T, 2, 4, dk, dv, at::kFloat, 9, g_range);
    const auto [o_ref, s_ref] = gated_delta_rule_recurrent(
        in64.q, in64.k, in64.v, in64.g, in64.beta, scale, in64.initial_state, true);
    const auto [o_ch, s_ch] =
        gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, scale, in.initial_state, true);
    const double e_o_ch = max_abs_diff(o_ch, o_ref), e_s_ch = max_abs_diff(s_ch, s_ref);
    const double o_max = o_ref.abs().max().item<double>(), s_max = s_ref.abs().max().item<double>();
    for (int64_t segment_len : {64, 128, 384}) {
      const GdrSegmentPlan plan = gdr_segment_plan_of_length(T, segment_len, 64);
      const auto [o, s] = gated_delta_rule_segmented(in.q, in.k, in.v, in.g, in.beta, scale, plan,
                                                     in.initial_state, true);
      ASSERT_EQ(o.scalar_type(), at::kFloat);
      ASSERT_EQ(s.scalar_type(), at::kFloat);
      const double e_o = max_abs_diff(o, o_ref), e_s = max_abs_diff(s, s_ref);
      const double slack = plan.num_segments * dk * eps;
      std::printf(
          "FP32 g in (-%g, 0), %lld segments: |o - ref| %.3g (chunked %.3g, max %.3g) "
          "|S - ref| %.3g (chunked %.3g, max %.3g), |o - chunked| %.3g\n",
          g_range, static_cast<long long>(plan.num_segments), e_o, e_o_ch, o_max, e_s, e_s_ch,
          s_max, max_abs_diff(o, o_ch));
      EXPECT_LE(e_o, 2.0 * e_o_ch + slack * o_max) << g_range << " " << segment_len;
      EXPECT_LE(e_s, 2.0 * e_s_ch + slack * s_max) << g_range << " " << segment_len;
    }
  }
}

TEST(GatedDeltaRuleSegmented, OneSegmentIsTheChunkedFormBitForBit) {
  const GdrInputs in = make_inputs(1, 70, 1, 2, 4, 4, at::kFloat, 4);
  const GdrSegmentPlan plan = plan_gdr_segments(1, 70, 2, 64, 132);
  ASSERT_EQ(plan.num_segments, 1);
  const auto [o, s] = gated_delta_rule_segmented(in.q, in.k, in.v, in.g, in.beta, 0.5, plan,
                                                 in.initial_state, true);
  const auto [o_c, s_c] =
      gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, 0.5, in.initial_state, true);
  EXPECT_TRUE(at::equal(o, o_c));
  EXPECT_TRUE(at::equal(s, s_c));
}

TEST(GatedDeltaRuleSegmented, RejectsAPlanForAnotherLength) {
  const GdrInputs in = make_inputs(1, 27, 1, 1, 4, 4, at::kDouble, 4);
  const GdrSegmentPlan plan = gdr_segment_plan_of_length(40, 8, 4);
  EXPECT_EQ(
      error_of([&] { gated_delta_rule_segmented(in.q, in.k, in.v, in.g, in.beta, 0.5, plan); }),
      "gated_delta_rule_segmented: the plan has 5 segments of 8 tokens but T = 27 needs 4");
}

}  // namespace
}  // namespace gdr
