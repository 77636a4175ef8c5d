// GPU tests of the fused causal conv1d + SiLU op (tag gpu): forward and both gradients
// against the ATen composition (cuDNN / ATen depthwise conv + SiLU with autograd) in FP32,
// BF16 and FP16 at the 0.8B model's shape and at small shapes with tails (T not a multiple
// of any tile, T < K), K = 2, 3, 4 and channel counts that take the scalar path; strided
// and misaligned x and non-contiguous grad_y giving the contiguous bits; a side stream;
// 100 bit-identical replays of the backward under contention; the model's GDR_CAUSAL_CONV
// switch, and the GatedDeltaNet layer with the kernel against the composition.
//
// Tolerances (max |kernel - composite| <= rtol * |composite| + atol_rel * max|composite|):
//   FP32 (TF32 off for cuDNN, so both sides are plain FP32): the K-tap sums differ only in
//   order (a few FP32 ulps): y and dx rtol 1e-5, atol 1e-6; dw sums all B*T tokens in a
//   different order: atol 1e-4 of its largest magnitude.
//   BF16 / FP16: both sides accumulate the taps in FP32, round the conv result once to the
//   activation dtype, compute SiLU (and silu_backward) in FP32 from that rounded value and
//   round again; only the FP32 order of the taps (and of dw's token sum) differs. That can
//   flip a rounding only when the FP32 value sits within a few FP32 ulps of a rounding
//   boundary; a flipped conv result moves y by at most silu' (< 1.1) times one ulp (2^-8
//   BF16, 2^-11 FP16 relative) plus the output's own ulp: elementwise rtol 1e-2 (BF16) /
//   2e-3 (FP16) with atol 1e-3 / 2e-4 of the max for values near zero. To prove the
//   rounding points are the same (a missed or extra rounding would move most elements by
//   up to half an ulp), at most 1% of y and dx elements may differ by more than FP32 noise
//   (1e-5 relative). dw is one rounding of an FP32 sum on both sides: rtol 1e-2 / 2e-3,
//   atol 1e-3 / 2e-4 of the max.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "models/qwen/config.h"
#include "models/qwen/layers.h"
#include "ops/causal_conv1d/causal_conv1d_op.h"
#include "tests/ops/expect_close.h"
#include "tests/ops/gpu_contention.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

struct Inputs {
  at::Tensor x, w, g;
};

struct Outputs {
  at::Tensor y, dx, dw;
};

Inputs make_inputs(int64_t B, int64_t T, int64_t C, int64_t K, at::ScalarType dtype,
                   uint64_t seed) {
  at::manual_seed(seed);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  Inputs in;
  in.x = (at::randn({B, T, C}, cuda) * 1.5).to(dtype);
  // PyTorch's default Conv1d init for a depthwise filter is U(-1/sqrt(K), 1/sqrt(K)).
  in.w = ((at::rand({C, 1, K}, cuda) * 2 - 1) / std::sqrt(static_cast<double>(K))).to(dtype);
  in.g = at::randn({B, T, C}, cuda).to(dtype);
  return in;
}

// Forward + backward through autograd; `kernel` picks the op or the composition.
Outputs run(bool kernel, const Inputs& in) {
  at::Tensor x = in.x.detach().requires_grad_(true), w = in.w.detach().requires_grad_(true);
  const at::Tensor y = kernel ? causal_conv1d_silu(x, w) : causal_conv1d_silu_composite(x, w);
  auto grads = torch::autograd::grad({y}, {x, w}, {in.g});
  return {y.detach(), grads[0], grads[1]};
}

// The ops without autograd (inputs passed as they are, strided or not).
Outputs run_ops(const Inputs& in) {
  at::Tensor y = causal_conv1d_silu_forward(in.x, in.w);
  auto [dx, dw] = causal_conv1d_silu_backward(in.g, in.x, in.w);
  return {y, dx, dw};
}

using test_support::expect_close;
using test_support::Tolerance;

void expect_matches_composite(const Outputs& kernel, const Outputs& ref, at::ScalarType dtype,
                              const std::string& context) {
  Tolerance elementwise{1e-5, 1e-6, 1.0}, dw{0.0, 1e-4, 1.0};
  if (dtype == at::kBFloat16) {
    elementwise = {1e-2, 1e-3, 0.01};
    dw = {1e-2, 1e-3, 1.0};
  } else if (dtype == at::kHalf) {
    elementwise = {2e-3, 2e-4, 0.01};
    dw = {2e-3, 2e-4, 1.0};
  }
  expect_close(kernel.y, ref.y, elementwise, context + " y");
  expect_close(kernel.dx, ref.dx, elementwise, context + " dx");
  expect_close(kernel.dw, ref.dw, dw, context + " dw");
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

void expect_same_bits(const Outputs& a, const Outputs& b, const std::string& context) {
  EXPECT_TRUE(same_bits(a.y, b.y)) << context << " y";
  EXPECT_TRUE(same_bits(a.dx, b.dx)) << context << " dx";
  EXPECT_TRUE(same_bits(a.dw, b.dw)) << context << " dw";
}

// FP32 comparisons need cuDNN's convolutions in plain FP32 (PyTorch's default lets them
// use TF32, which alone is off by ~1e-3).
class Tf32Off {
 public:
  Tf32Off() : saved_(at::globalContext().allowTF32CuDNN()) {
    at::globalContext().setAllowTF32CuDNN(false);
  }
  ~Tf32Off() { at::globalContext().setAllowTF32CuDNN(saved_); }

 private:
  bool saved_;
};

class CausalConvGpuTest : public ::testing::Test {
 protected:
  Tf32Off tf32_off_;
};

struct Case {
  int64_t B, T, C, K;
};

class CausalConvGpuShapes : public CausalConvGpuTest, public ::testing::WithParamInterface<Case> {};

TEST_P(CausalConvGpuShapes, KernelMatchesTheCompositionForOutputAndGradients) {
  const Case c = GetParam();
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const Inputs in = make_inputs(c.B, c.T, c.C, c.K, dtype, c.T * 31 + c.C);
    const Outputs kernel = run(true, in);
    EXPECT_TRUE(kernel.y.is_contiguous());
    expect_matches_composite(kernel, run(false, in), dtype, c10::toString(dtype));
    // The ops alone give autograd's bits.
    expect_same_bits(run_ops(in), kernel, std::string(c10::toString(dtype)) + " ops vs autograd");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CausalConvGpuShapes,
                         ::testing::Values(Case{2, 2048, 6144, 4},  // the 0.8B model's microbatch
                                           Case{1, 37, 96, 4}, Case{2, 100, 40, 3},
                                           Case{3, 5, 24, 2}, Case{1, 2, 16, 4},  // T < K
                                           Case{2, 1000, 136, 4},
                                           Case{2, 77, 100, 4},  // scalar forward (C % 8)
                                           Case{1, 333, 7, 3}, Case{4, 4099, 256, 4}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           const Case& c = info.param;
                           return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_C" +
                                  std::to_string(c.C) + "_K" + std::to_string(c.K);
                         });

// Strided x (a channel slice of a wider projection, aligned or misaligned for the vector
// loads; batch-transposed) and grad_y (token-strided, or with a non-unit channel stride,
// which the op copies) give exactly the contiguous inputs' bits: the summation order does
// not depend on the layout (Note [Causal conv determinism]).
TEST_F(CausalConvGpuTest, StridedInputsGiveTheContiguousBits) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const int64_t B = 2, T = 203, C = 512;
    const Inputs dense = make_inputs(B, T, C, 4, dtype, 7);
    const Outputs ref = run_ops(dense);
    auto check = [&](const at::Tensor& x, const at::Tensor& g, const std::string& what) {
      ASSERT_TRUE(at::equal(x, dense.x)) << what;
      ASSERT_TRUE(at::equal(g, dense.g)) << what;
      expect_same_bits(run_ops({x, dense.w, g}), ref,
                       std::string(c10::toString(dtype)) + " " + what);
    };
    at::Tensor wide = at::zeros({B, T, C + 16}, cuda.dtype(dtype));
    wide.narrow(2, 0, C).copy_(dense.x);
    check(wide.narrow(2, 0, C), dense.g, "x narrow (aligned)");
    at::Tensor shifted = at::zeros({B, T, C + 16}, cuda.dtype(dtype));
    shifted.narrow(2, 1, C).copy_(dense.x);
    check(shifted.narrow(2, 1, C), dense.g, "x narrow (misaligned: scalar path)");
    at::Tensor transposed = at::zeros({T, B, C}, cuda.dtype(dtype));
    transposed.copy_(dense.x.transpose(0, 1));
    check(transposed.transpose(0, 1), dense.g, "x batch-transposed");
    at::Tensor g_wide = at::zeros({B, T, C + 8}, cuda.dtype(dtype));
    g_wide.narrow(2, 8, C).copy_(dense.g);
    check(dense.x, g_wide.narrow(2, 8, C), "grad_y token-strided");
    check(dense.x, dense.g.transpose(1, 2).contiguous().transpose(1, 2), "grad_y channel-strided");
  }
}

TEST_F(CausalConvGpuTest, SideStreamGivesTheDefaultStreamBits) {
  const Inputs in = make_inputs(2, 513, 768, 4, at::kBFloat16, 9);
  const Outputs ref = run(true, in);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  c10::cuda::getCurrentCUDAStream().synchronize();  // the inputs were made on the default stream
  Outputs out;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    out = run(true, in);
  }
  side.synchronize();
  expect_same_bits(out, ref, "side stream");
}

TEST_F(CausalConvGpuTest, NoTokensGiveEmptyOutputsAndZeroWeightGradient) {
  for (const std::vector<int64_t>& shape :
       {std::vector<int64_t>{0, 16, 64}, std::vector<int64_t>{2, 0, 64}}) {
    Inputs in = make_inputs(1, 1, 64, 4, at::kBFloat16, 3);
    in.x = at::randn(shape, in.w.options());
    in.g = at::randn(shape, in.w.options());
    const Outputs out = run_ops(in);
    EXPECT_EQ(out.y.sizes(), in.x.sizes());
    EXPECT_EQ(out.dx.sizes(), in.x.sizes());
    EXPECT_EQ(out.dw.to(at::kFloat).abs().max().item<float>(), 0.0f);
  }
}

// See Note [Causal conv determinism]: 100 backward replays under load on other streams, bit
// for bit, at the model's shape.
TEST_F(CausalConvGpuTest, BackwardIsBitwiseReproducibleUnderContention) {
  const Inputs in = make_inputs(2, 2048, 6144, 4, at::kBFloat16, 21);
  auto [dx0, dw0] = causal_conv1d_silu_backward(in.g, in.x, in.w);
  test_support::GpuContention contention;
  for (int rep = 0; rep < 100; ++rep) {
    auto [dx, dw] = causal_conv1d_silu_backward(in.g, in.x, in.w);
    ASSERT_TRUE(same_bits(dx, dx0)) << "dx, replay " << rep;
    ASSERT_TRUE(same_bits(dw, dw0)) << "dw, replay " << rep;
  }
}

TEST_F(CausalConvGpuTest, ModelConvFollowsGdrCausalConv) {
  const Inputs in = make_inputs(2, 64, 256, 4, at::kBFloat16, 31);
  EXPECT_TRUE(same_bits(gdn_causal_conv1d_silu(in.x, in.w), causal_conv1d_silu(in.x, in.w)));
  {
    test_support::PolicyForTest policy("GDR_CAUSAL_CONV", "kernel");
    EXPECT_TRUE(gdn_causal_conv1d_silu(in.x, in.w).is_contiguous());
    policy.set("GDR_CAUSAL_CONV", "aten");
    const at::Tensor aten = gdn_causal_conv1d_silu(in.x, in.w);
    EXPECT_TRUE(same_bits(aten, causal_conv1d_silu_composite(in.x, in.w)));
    EXPECT_FALSE(aten.is_contiguous());  // the composition's transposed view
  }
  EXPECT_EQ(test_support::policy_error("GDR_CAUSAL_CONV", "bogus"),
            "GDR_CAUSAL_CONV: expected kernel or aten, but got 'bogus'");
  // FP64 and K = 5 keep the composition whatever the switch says.
  const at::Tensor xd = in.x.to(at::kDouble), wd = in.w.to(at::kDouble);
  EXPECT_TRUE(same_bits(gdn_causal_conv1d_silu(xd, wd), causal_conv1d_silu_composite(xd, wd)));
  const at::Tensor w5 = at::randn({256, 1, 5}, in.w.options());
  EXPECT_TRUE(same_bits(gdn_causal_conv1d_silu(in.x, w5), causal_conv1d_silu_composite(in.x, w5)));
}

// The model's mixer (pre_gdr_fusion gate) with the kernel against the composition, same
// weights: its output and every parameter gradient, at the BF16 bar of the full-fusion
// test (the core and the projections see inputs that differ by rare BF16 rounding ties).
TEST_F(CausalConvGpuTest, GatedDeltaNetWithTheKernelMatchesTheComposition) {
  QwenConfig config;
  config.hidden_size = 256;
  config.linear_num_key_heads = 2;
  config.linear_num_value_heads = 4;
  config.linear_key_head_dim = 64;
  config.linear_value_head_dim = 64;
  at::manual_seed(3);
  GatedDeltaNet layer(config);
  layer->to(at::kCUDA, at::kBFloat16);
  layer->set_pre_gdr_fusion(PreGdrFusion::kGate);
  const at::Tensor x =
      at::randn({2, 333, config.hidden_size}, at::TensorOptions().device(at::kCUDA))
          .to(at::kBFloat16);
  const at::Tensor grad_out = at::randn_like(x);
  auto forward_backward = [&](const char* impl) {
    const test_support::PolicyForTest policy("GDR_CAUSAL_CONV", impl);
    layer->zero_grad();
    const at::Tensor y = layer->forward(x);
    y.backward(grad_out);
    std::vector<at::Tensor> result = {y.detach()};
    for (const auto& p : layer->parameters()) result.push_back(p.grad().detach().clone());
    return result;
  };
  const std::vector<at::Tensor> kernel = forward_backward("kernel");
  const std::vector<at::Tensor> aten = forward_backward("aten");
  expect_close(kernel[0], aten[0], {2e-2, 2e-3, 1.0}, "layer output");
  const auto named = layer->named_parameters();
  for (size_t i = 0; i < named.size(); ++i) {
    expect_close(kernel[i + 1], aten[i + 1], {0.0, 3e-2, 1.0}, "gradient of " + named[i].key());
  }
}

}  // namespace
}  // namespace gdr
