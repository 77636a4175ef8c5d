// GPU test of the segment-parallel reference (tag gpu): gated_delta_rule_segmented on CUDA in
// FP32 (pass 3 through the chunk prep and state kernels where the policy says so) at a long
// sequence and small B x H, with the plan of the device's SM count, against the chunked core
// on CUDA and an FP64 CPU reference; the same bits on a second run; gradients through the
// composite against the chunked path's.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "ops/gdr_core/gdr_core_op.h"
#include "ops/gdr_core/segment_parallel.h"

namespace gdr {
namespace {

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kCPU, at::kDouble) - b.to(at::kCPU, at::kDouble)).abs().max().item<double>();
}

struct Inputs {
  at::Tensor q, k, v, g, beta, s0;
};

// FP64 on the CPU (the reference's inputs); g in (-0.1, 0) so the state crosses segments.
Inputs make_inputs(int64_t B, int64_t T, int64_t H, int64_t d, uint64_t seed) {
  at::manual_seed(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  Inputs in;
  in.q = at::randn({B, T, H, d}, f64);
  in.q = in.q / in.q.norm(2, -1, true);
  in.k = at::randn({B, T, H, d}, f64);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = at::randn({B, T, H, d}, f64);
  in.g = -0.1 * at::rand({B, T, H}, f64);
  in.beta = at::sigmoid(at::randn({B, T, H}, f64));
  in.s0 = 0.5 * at::randn({B, H, d, d}, f64);
  return in;
}

Inputs to_cuda_fp32(const Inputs& in) {
  auto c = [](const at::Tensor& t) { return t.to(at::kCUDA, at::kFloat); };
  return {c(in.q), c(in.k), c(in.v), c(in.g), c(in.beta), c(in.s0)};
}

TEST(GdrSegmentParallelGpu, LongSequenceSmallBatchTimesHeadsMatchesTheChunkedCore) {
  if (!at::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 1, T = 8192, H = 16, d = 128;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const GdrSegmentPlan plan = plan_gdr_segments(B, T, H, kGdrChunkSize, sms);
  std::printf("SMs %lld: %lld segments of %lld tokens\n", static_cast<long long>(sms),
              static_cast<long long>(plan.num_segments), static_cast<long long>(plan.segment_len));
  ASSERT_GE(plan.num_segments, kGdrMinSegments);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const Inputs in64 = make_inputs(B, T, H, d, 31);
  const Inputs in = to_cuda_fp32(in64);
  const auto [o_ref, s_ref] =
      gated_delta_rule_chunked(in64.q, in64.k, in64.v, in64.g, in64.beta, scale, in64.s0, true);
  const auto [o_ch, s_ch] =
      gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, scale, in.s0, true);
  const auto [o, s] =
      gated_delta_rule_segmented(in.q, in.k, in.v, in.g, in.beta, scale, plan, in.s0, true);
  const auto [o2, s2] =
      gated_delta_rule_segmented(in.q, in.k, in.v, in.g, in.beta, scale, plan, in.s0, true);
  EXPECT_TRUE(at::equal(o, o2));
  EXPECT_TRUE(at::equal(s, s2));
  const double e_o = max_abs_diff(o, o_ref), e_s = max_abs_diff(s, s_ref);
  const double e_o_ch = max_abs_diff(o_ch, o_ref), e_s_ch = max_abs_diff(s_ch, s_ref);
  const double o_max = o_ref.abs().max().item<double>(), s_max = s_ref.abs().max().item<double>();
  std::printf(
      "FP32 CUDA: segmented |o - ref| %.3g |S - ref| %.3g; chunked |o - ref| %.3g "
      "|S - ref| %.3g; max |o| %.3g max |S| %.3g; |o_seg - o_chunked| %.3g\n",
      e_o, e_s, e_o_ch, e_s_ch, o_max, s_max, max_abs_diff(o, o_ch));
  // The CPU test's bound (tests/ops/gdr_segment_parallel_test.cc, SegmentedFp32).
  const double slack = plan.num_segments * d * std::ldexp(1.0, -24);
  EXPECT_LE(e_o, 2.0 * e_o_ch + slack * o_max);
  EXPECT_LE(e_s, 2.0 * e_s_ch + slack * s_max);

  // Eager wall times, for orientation only (the segmented form is an ATen reference here).
  auto time_ms = [&](auto&& f) {
    f();
    at::cuda::device_synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < 5; ++i) f();
    at::cuda::device_synchronize();
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
               .count() /
           5;
  };
  const double t_ch = time_ms(
      [&] { gated_delta_rule_chunked(in.q, in.k, in.v, in.g, in.beta, scale, in.s0, true); });
  const double t_seg = time_ms([&] {
    gated_delta_rule_segmented(in.q, in.k, in.v, in.g, in.beta, scale, plan, in.s0, true);
  });
  std::printf("eager forward ms: chunked %.3f, segmented reference %.3f\n", t_ch, t_seg);
}

TEST(GdrSegmentParallelGpu, GradientsMatchTheChunkedPath) {
  if (!at::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 1, T = 1000, H = 2, d = 64;
  const GdrSegmentPlan plan = gdr_segment_plan_of_length(T, 256, kGdrChunkSize);
  const Inputs in = to_cuda_fp32(make_inputs(B, T, H, d, 32));
  at::manual_seed(6);
  const at::Tensor w_o = at::randn({B, T, H, d}).to(at::kCUDA);
  const at::Tensor w_s = at::randn({B, H, d, d}).to(at::kCUDA);
  auto grads = [&](bool segmented) {
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& t : {in.q, in.k, in.v, in.g, in.beta, in.s0}) {
      leaves.push_back(t.detach().clone().requires_grad_(true));
    }
    at::Tensor o, s;
    if (segmented) {
      std::tie(o, s) = gated_delta_rule_segmented(leaves[0], leaves[1], leaves[2], leaves[3],
                                                  leaves[4], 0.125, plan, leaves[5], true);
    } else {
      std::tie(o, s) = gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3],
                                                leaves[4], 0.125, leaves[5], true);
    }
    return torch::autograd::grad({(o * w_o).sum() + (s * w_s).sum()}, leaves);
  };
  const auto g_seg = grads(true), g_ch = grads(false);
  const char* names[] = {"q", "k", "v", "g", "beta", "initial_state"};
  for (size_t i = 0; i < g_seg.size(); ++i) {
    const double e = max_abs_diff(g_seg[i], g_ch[i]);
    const double m = g_ch[i].abs().max().item<double>();
    std::printf("grad %s: |segmented - chunked| %.3g (max %.3g)\n", names[i], e, m);
    EXPECT_LE(e, 1e-4 * m) << names[i];
  }
}

}  // namespace
}  // namespace gdr
