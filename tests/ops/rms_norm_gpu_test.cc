// GPU tests of the fused RMSNorm (tag gpu): agreement with the libtorch compositions for
// outputs and gradients (FP32 tight, BF16/FP16 within stated tolerances), tails and odd
// row sizes, non-contiguous inputs, mixed dtypes, bit-exact replay of the backward under
// contention, the model's GDR_RMS_NORM switch, and the register-resident kernel variants
// against the streaming kernels, bit for bit (Note [RMSNorm register-resident rows]).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "kernels/rms_norm/rms_norm.h"
#include "models/qwen/layers.h"
#include "ops/rms_norm/rms_norm_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/gpu_contention.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

struct Inputs {
  at::Tensor x, z, w, g;
};

using Outputs = std::vector<at::Tensor>;  // y, dx, dz (gated), dw

Outputs run(bool gated, bool fused, const Inputs& in, at::ScalarType out_dtype) {
  at::Tensor x = in.x.detach().requires_grad_(true), w = in.w.detach().requires_grad_(true);
  at::Tensor z = gated ? in.z.detach().requires_grad_(true) : at::Tensor();
  if (gated) {
    const at::Tensor y = fused ? gated_rms_norm_fused(x, z, w, 1e-6, out_dtype)
                               : gated_rms_norm_composite(x, z, w, 1e-6, out_dtype);
    auto grads = torch::autograd::grad({y}, {x, z, w}, {in.g.to(out_dtype)});
    return {y.detach(), grads[0], grads[1], grads[2]};
  }
  const at::Tensor y = fused ? zero_centered_rms_norm_fused(x, w, 1e-6)
                             : zero_centered_rms_norm_composite(x, w, 1e-6);
  auto grads = torch::autograd::grad({y}, {x, w}, {in.g.to(y.scalar_type())});
  return {y.detach(), grads[0], at::Tensor(), grads[1]};
}

Inputs make_inputs(at::IntArrayRef shape, at::ScalarType dt, at::ScalarType wt, bool gated,
                   uint64_t seed) {
  at::manual_seed(seed);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  Inputs in;
  in.x = (at::randn(shape, cuda) * 2).to(dt);
  in.z = (at::randn(shape, cuda) * 2).to(dt);
  in.w = (at::randn({shape.back()}, cuda) * 0.5 + (gated ? 1.0 : 0.0)).to(wt);
  in.g = at::randn(shape, cuda).to(dt);
  return in;
}

// Max |fused - composite| relative to max |composite| (1 for an all-zero reference).
double relative_error(const at::Tensor& fused, const at::Tensor& ref) {
  const at::Tensor f = fused.to(at::kDouble), r = ref.to(at::kDouble);
  const double scale = std::max(r.abs().max().item<double>(), 1e-30);
  return (f - r).abs().max().item<double>() / scale;
}

void expect_close(const Outputs& fused, const Outputs& ref, double tol_y, double tol_grad,
                  const std::string& context) {
  const char* names[] = {"y", "dx", "dz", "dw"};
  for (size_t i = 0; i < fused.size(); ++i) {
    if (!ref[i].defined()) continue;
    ASSERT_EQ(fused[i].scalar_type(), ref[i].scalar_type()) << context << " " << names[i];
    ASSERT_EQ(fused[i].sizes(), ref[i].sizes()) << context << " " << names[i];
    EXPECT_LE(relative_error(fused[i], ref[i]), i == 0 ? tol_y : tol_grad)
        << context << " " << names[i];
  }
}

struct Case {
  bool gated;
  int64_t rows, D;
};

class RmsNormGpu : public ::testing::TestWithParam<Case> {};

// FP32: both sides compute in FP32 with different summation orders (tight). BF16/FP16:
// each side rounds its outputs once to 8 (11) mantissa bits, so they may differ by one
// unit in the last place of the largest value: 2^-7 (2^-10) relative, plus FP32 noise.
TEST_P(RmsNormGpu, FusedMatchesTheCompositionForOutputsAndGradients) {
  const Case c = GetParam();
  struct Dtypes {
    at::ScalarType act, weight;
    double tol_y, tol_grad;
  };
  for (const Dtypes d : {Dtypes{at::kFloat, at::kFloat, 1e-5, 1e-4},
                         Dtypes{at::kBFloat16, at::kBFloat16, 1.6e-2, 1.6e-2},
                         Dtypes{at::kBFloat16, at::kFloat, 1.6e-2, 1.6e-2},
                         Dtypes{at::kHalf, at::kHalf, 2e-3, 2e-3}}) {
    const Inputs in = make_inputs({c.rows, c.D}, d.act, d.weight, c.gated, c.rows + c.D);
    const std::string context = std::string(c10::toString(d.act)) + "/" + c10::toString(d.weight);
    expect_close(run(c.gated, true, in, d.act), run(c.gated, false, in, d.act), d.tol_y, d.tol_grad,
                 context);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormGpu,
                         ::testing::Values(Case{false, 4099, 1024}, Case{false, 8190, 256},
                                           Case{false, 37, 100}, Case{false, 300, 1000},
                                           Case{true, 4097, 128}, Case{true, 5, 100},
                                           Case{true, 1000, 1000}, Case{false, 1, 128},
                                           Case{true, 70000, 128}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.gated ? "gated" : "zero_centred") + "_" +
                                  std::to_string(info.param.rows) + "x" +
                                  std::to_string(info.param.D);
                         });

TEST(RmsNormGpuLayouts, NonContiguousInputsMatchTheComposition) {
  // q_norm's input: a narrow() of the [B, T, H, 2 * hd] projection (row stride 2 * hd).
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(11);
  const at::Tensor wide = at::randn({2, 33, 8, 512}, cuda).to(at::kBFloat16);
  Inputs in;
  in.x = wide.narrow(-1, 0, 256);
  in.w = (at::randn({256}, cuda) * 0.5).to(at::kBFloat16);
  in.g = at::randn({2, 8, 33, 256}, cuda).to(at::kBFloat16).transpose(1, 2);  // strided grad
  expect_close(run(false, true, in, at::kBFloat16), run(false, false, in, at::kBFloat16), 1.6e-2,
               1.6e-2, "narrow BF16");
  // Gated with transposed leading dims and an odd row (scalar path), FP32.
  Inputs gin;
  gin.x = at::randn({3, 9, 5, 100}, cuda).transpose(1, 2);
  gin.z = at::randn({3, 9, 5, 100}, cuda).transpose(1, 2);
  gin.w = at::randn({100}, cuda);
  gin.g = at::randn({3, 5, 9, 100}, cuda);
  expect_close(run(true, true, gin, at::kFloat), run(true, false, gin, at::kFloat), 1e-5, 1e-4,
               "transposed FP32");
  // Five leading dims (flattened by the op) and a 1-D input.
  Inputs fin = make_inputs({2, 2, 3, 2, 2, 64}, at::kFloat, at::kFloat, false, 5);
  expect_close(run(false, true, fin, at::kFloat), run(false, false, fin, at::kFloat), 1e-5, 1e-4,
               "6-D");
  Inputs one = make_inputs({64}, at::kFloat, at::kFloat, false, 6);
  expect_close(run(false, true, one, at::kFloat), run(false, false, one, at::kFloat), 1e-5, 1e-4,
               "1-D");
}

TEST(RmsNormGpuLayouts, MixedDtypesOfTheGdnNormMatchTheComposition) {
  // o in FP32 (a core output), z and the result in BF16, weight FP32.
  Inputs in = make_inputs({2, 40, 16, 128}, at::kFloat, at::kFloat, true, 9);
  in.z = in.z.to(at::kBFloat16);
  expect_close(run(true, true, in, at::kBFloat16), run(true, false, in, at::kBFloat16), 1.6e-2,
               1e-4, "o FP32, z BF16");
}

TEST(RmsNormGpuLayouts, ZeroRowsGiveEmptyOutputsAndZeroWeightGradient) {
  const Inputs in = make_inputs({0, 256}, at::kBFloat16, at::kBFloat16, false, 1);
  const Outputs out = run(false, true, in, at::kBFloat16);
  EXPECT_EQ(out[0].sizes(), in.x.sizes());
  EXPECT_EQ(out[3].to(at::kFloat).abs().max().item<float>(), 0.0f);
}

using test_support::bitwise_equal;

// See Note [RMSNorm determinism]: 100 backward replays under load on other streams, bit for
// bit, at the model's shapes (hidden 1024 over 8192 tokens; GDN norm over dv = 128).
TEST(RmsNormGpuReplay, BackwardIsBitwiseReproducibleUnderContention) {
  const Inputs zc = make_inputs({8192, 1024}, at::kBFloat16, at::kBFloat16, false, 21);
  const Inputs gated = make_inputs({1, 4096, 16, 128}, at::kBFloat16, at::kBFloat16, true, 22);
  auto [zy, zrstd] = zero_centered_rms_norm_forward(zc.x, zc.w, 1e-6);
  auto [gy, grstd] = gated_rms_norm_forward(gated.x, gated.z, gated.w, 1e-6, at::kBFloat16);
  auto [dx0, dw0] = zero_centered_rms_norm_backward(zc.g, zc.x, zc.w, zrstd);
  auto [do0, dz0, gdw0] = gated_rms_norm_backward(gated.g, gated.x, gated.z, gated.w, grstd);
  test_support::GpuContention contention;
  for (int rep = 0; rep < 100; ++rep) {
    auto [dx, dw] = zero_centered_rms_norm_backward(zc.g, zc.x, zc.w, zrstd);
    auto [d_o, dz, gdw] = gated_rms_norm_backward(gated.g, gated.x, gated.z, gated.w, grstd);
    ASSERT_TRUE(bitwise_equal(dx, dx0)) << "zero-centred dx, replay " << rep;
    ASSERT_TRUE(bitwise_equal(dw, dw0)) << "zero-centred dw, replay " << rep;
    ASSERT_TRUE(bitwise_equal(d_o, do0)) << "gated do, replay " << rep;
    ASSERT_TRUE(bitwise_equal(dz, dz0)) << "gated dz, replay " << rep;
    ASSERT_TRUE(bitwise_equal(gdw, gdw0)) << "gated dw, replay " << rep;
  }
}

TEST(RmsNormGpuSwitch, ModelNormsFollowGdrRmsNorm) {
  const Inputs in = make_inputs({64, 1024}, at::kBFloat16, at::kBFloat16, true, 31);
  EXPECT_TRUE(bitwise_equal(zero_centered_rms_norm(in.x, in.w, 1e-6),
                            zero_centered_rms_norm_fused(in.x, in.w, 1e-6)));
  EXPECT_TRUE(bitwise_equal(gated_rms_norm(in.x, in.z, in.w, 1e-6, at::kBFloat16),
                            gated_rms_norm_fused(in.x, in.z, in.w, 1e-6, at::kBFloat16)));
  {
    const test_support::PolicyForTest policy("GDR_RMS_NORM", "composite");
    EXPECT_TRUE(bitwise_equal(zero_centered_rms_norm(in.x, in.w, 1e-6),
                              zero_centered_rms_norm_composite(in.x, in.w, 1e-6)));
    EXPECT_TRUE(bitwise_equal(gated_rms_norm(in.x, in.z, in.w, 1e-6, at::kBFloat16),
                              gated_rms_norm_composite(in.x, in.z, in.w, 1e-6, at::kBFloat16)));
  }
  EXPECT_EQ(test_support::policy_error("GDR_RMS_NORM", "bogus"),
            "GDR_RMS_NORM: expected fused or composite, but got 'bogus'");
  // FP64 keeps the composite whatever the switch says.
  const at::Tensor xd = in.x.to(at::kDouble), zd = in.z.to(at::kDouble), wd = in.w.to(at::kDouble);
  EXPECT_TRUE(bitwise_equal(gated_rms_norm(xd, zd, wd, 1e-6, at::kDouble),
                            gated_rms_norm_composite(xd, zd, wd, 1e-6, at::kDouble)));
}

// The kernels straight from their launchers (contiguous [rows, cols] operands), with the
// launcher's choice of variant or the streaming kernels forced.
struct KernelOutputs {
  at::Tensor y, rstd, dx, dz, partials, dw;
};

kernels::NormDtype norm_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::NormDtype::kFloat32;
    case at::kHalf: return kernels::NormDtype::kFloat16;
    default: return kernels::NormDtype::kBFloat16;
  }
}

KernelOutputs run_kernels(bool gated, const Inputs& in, bool streaming_only) {
  const int64_t cols = in.x.size(-1), rows = in.x.numel() / cols;
  kernels::RmsNormShape shape;
  shape.rows = rows;
  shape.cols = cols;
  shape.row_dims = 1;
  shape.row_sizes[0] = rows;
  auto operand = [&](const at::Tensor& t) {
    kernels::RowOperand op;
    op.data = t.data_ptr();
    op.row_strides[0] = cols;
    return op;
  };
  const auto dt = in.x.scalar_type();
  KernelOutputs out;
  out.y = at::empty({rows, cols}, in.x.options());
  out.rstd = at::empty({rows}, in.x.options().dtype(at::kFloat));
  kernels::RmsNormForwardArgs fa;
  fa.flavour = gated ? kernels::RmsNormFlavour::kGated : kernels::RmsNormFlavour::kZeroCentred;
  fa.dtype = norm_dtype(dt);
  fa.weight_fp32 = in.w.scalar_type() == at::kFloat;
  fa.shape = shape;
  fa.x = operand(in.x);
  if (gated) fa.z = operand(in.z);
  fa.weight = in.w.data_ptr();
  fa.eps = 1e-6f;
  fa.y = out.y.data_ptr();
  fa.rstd = out.rstd.data_ptr<float>();
  fa.streaming_only = streaming_only;
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  EXPECT_EQ(kernels::launch_rms_norm_forward(fa, stream), 0);

  const kernels::RmsNormBackwardLaunch launch =
      kernels::derive_rms_norm_backward_launch(rows, cols);
  out.dx = at::empty({rows, cols}, in.x.options());
  out.dz = gated ? at::empty({rows, cols}, in.x.options()) : at::Tensor();
  out.partials =
      at::empty({std::max<int64_t>(launch.scratch_floats, 1)}, in.x.options().dtype(at::kFloat));
  out.dw = at::empty({cols}, in.w.options());
  kernels::RmsNormBackwardArgs ba;
  ba.flavour = fa.flavour;
  ba.dtype = fa.dtype;
  ba.weight_fp32 = fa.weight_fp32;
  ba.shape = shape;
  ba.grad_y = operand(in.g);
  ba.x = fa.x;
  ba.z = fa.z;
  ba.weight = fa.weight;
  ba.rstd = out.rstd.data_ptr<float>();
  ba.dx = out.dx.data_ptr();
  ba.dz = gated ? out.dz.data_ptr() : nullptr;
  ba.partials = out.partials.data_ptr<float>();
  ba.streaming_only = streaming_only;
  EXPECT_EQ(kernels::launch_rms_norm_backward(ba, stream), 0);
  EXPECT_EQ(kernels::launch_rms_norm_reduce_partials(ba.partials, launch.programs, cols,
                                                     norm_dtype(in.w.scalar_type()),
                                                     out.dw.data_ptr(), stream),
            0);
  return out;
}

// The training step's shapes (GDN norm: 2048 tokens x 16 heads of 128; hidden 1024) and
// others that reach every (chunks, stages, accumulator) plan, several rows per warp,
// tails, partial last chunks and rows per program that the warps do not divide.
TEST(RmsNormGpuVariants, ResidentKernelsMatchTheStreamingKernelsBitForBit) {
  struct VariantCase {
    bool gated;
    int64_t rows, cols;
    at::ScalarType act, weight;
  };
  const VariantCase cases[] = {
      {true, 32768, 128, at::kFloat, at::kFloat},
      {true, 32768, 128, at::kBFloat16, at::kBFloat16},
      {true, 32768, 128, at::kBFloat16, at::kFloat},
      {false, 2048, 1024, at::kBFloat16, at::kBFloat16},
      {false, 8192, 1024, at::kBFloat16, at::kFloat},
      {false, 20001, 512, at::kFloat, at::kFloat},
      {true, 4097, 256, at::kFloat, at::kFloat},
      {true, 3001, 256, at::kHalf, at::kHalf},
      {true, 999, 512, at::kBFloat16, at::kBFloat16},
      {false, 5000, 512, at::kBFloat16, at::kBFloat16},
      {false, 6007, 512, at::kFloat, at::kFloat},
      {false, 777, 1000, at::kHalf, at::kHalf},
      {false, 40000, 128, at::kBFloat16, at::kBFloat16},
      {true, 1000, 96, at::kFloat, at::kFloat},
      {false, 3, 256, at::kFloat, at::kFloat},
  };
  for (const VariantCase& c : cases) {
    const Inputs in = make_inputs({c.rows, c.cols}, c.act, c.weight, c.gated, c.rows * 7 + c.cols);
    const KernelOutputs fast = run_kernels(c.gated, in, false);
    const KernelOutputs ref = run_kernels(c.gated, in, true);
    const std::string context = std::string(c.gated ? "gated " : "zero-centred ") +
                                std::to_string(c.rows) + "x" + std::to_string(c.cols) + " " +
                                c10::toString(c.act) + "/" + c10::toString(c.weight);
    EXPECT_TRUE(bitwise_equal(fast.y, ref.y)) << context << " y";
    EXPECT_TRUE(bitwise_equal(fast.rstd, ref.rstd)) << context << " rstd";
    EXPECT_TRUE(bitwise_equal(fast.dx, ref.dx)) << context << " dx";
    if (c.gated) {
      EXPECT_TRUE(bitwise_equal(fast.dz, ref.dz)) << context << " dz";
    }
    EXPECT_TRUE(bitwise_equal(fast.partials, ref.partials)) << context << " partials";
    EXPECT_TRUE(bitwise_equal(fast.dw, ref.dw)) << context << " dw";
  }
}

// See Note [RMSNorm with the residual add]: the fused add + norm against the add followed by
// the fused norm (autograd adding the sum's two gradients), bit for bit: outputs, the sum,
// and the gradients of x, residual and weight, with and without a gradient on the sum,
// for the register-resident kernels (16-byte rows: model shape, 4-chunk and partial-chunk
// rows), the scalar kernels (rows not a multiple of the vector), a strided residual, FP32
// weights, a strided sum gradient, and the streaming kernels.
TEST(AddRmsNormGpu, FusedGivesTheBitsOfTheAddThenTheFusedNorm) {
  struct AddCase {
    std::vector<int64_t> shape;
    at::ScalarType act, weight;
    bool transposed_residual, streaming;
  };
  const AddCase cases[] = {
      {{1, 2048, 1024}, at::kBFloat16, at::kBFloat16, false, false},
      {{1, 2048, 1024}, at::kBFloat16, at::kBFloat16, false, true},
      {{4, 100, 1024}, at::kBFloat16, at::kFloat, true, false},
      {{777, 1000}, at::kHalf, at::kHalf, false, false},
      {{300, 512}, at::kFloat, at::kFloat, false, false},
      {{33, 100}, at::kBFloat16, at::kBFloat16, false, false},
      {{5, 96}, at::kFloat, at::kFloat, true, true},
  };
  for (const AddCase& c : cases) {
    const std::string context =
        c10::str(at::IntArrayRef(c.shape), " ", c10::toString(c.act), "/", c10::toString(c.weight),
                 c.transposed_residual ? " strided residual" : "", c.streaming ? " streaming" : "");
    test_support::PolicyForTest policy;
    if (c.streaming) policy.set("GDR_RMS_NORM_KERNEL", "streaming");
    const Inputs in =
        make_inputs(c.shape, c.act, c.weight, false, c.shape[0] * 13 + c.shape.back());
    at::Tensor residual = at::randn(c.shape, in.x.options());
    if (c.transposed_residual) {
      // The same values read through swapped leading strides.
      std::vector<int64_t> swapped(c.shape);
      std::swap(swapped[0], swapped[1]);
      residual = residual.reshape(swapped).transpose(0, 1);
      ASSERT_FALSE(residual.is_contiguous()) << context;
    }
    at::Tensor grad_sum = at::randn(c.shape, in.x.options());
    if (c.transposed_residual) {  // the sum's gradient strided too
      std::vector<int64_t> swapped(c.shape);
      std::swap(swapped[0], swapped[1]);
      grad_sum = grad_sum.reshape(swapped).transpose(0, 1);
    }
    for (const bool with_grad_sum : {true, false}) {
      auto run_both = [&](bool fused) {
        const at::Tensor x = in.x.detach().requires_grad_(true);
        const at::Tensor r = residual.detach().requires_grad_(true);
        const at::Tensor w = in.w.detach().requires_grad_(true);
        at::Tensor y, sum;
        if (fused) {
          std::tie(y, sum) = add_zero_centered_rms_norm_fused(x, r, w, 1e-6);
        } else {
          sum = x + r;
          y = zero_centered_rms_norm_fused(sum, w, 1e-6);
        }
        std::vector<at::Tensor> outputs{y}, grads{in.g};
        if (with_grad_sum) {
          outputs.push_back(sum);
          grads.push_back(grad_sum);
        }
        auto g = torch::autograd::grad(outputs, {x, r, w}, grads);
        return std::vector<at::Tensor>{y.detach(), sum.detach(), g[0], g[1], g[2]};
      };
      const auto fused = run_both(true);
      const auto composed = run_both(false);
      const char* names[] = {"y", "sum", "dx", "dresidual", "dw"};
      for (int i = 0; i < 5; ++i) {
        EXPECT_TRUE(bitwise_equal(fused[i], composed[i]))
            << context << (with_grad_sum ? " with" : " without") << " grad_sum: " << names[i];
      }
    }
  }
}

}  // namespace
}  // namespace gdr
