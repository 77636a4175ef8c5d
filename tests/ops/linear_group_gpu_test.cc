// GPU tests of the linear group op (tag gpu), BF16 on CUDA: the model's groups at the 0.8B
// sizes (GDN qkv / z / b / a, attention q / k / v, MLP gate / up on [1, 2048, 1024]) and
// small odd shapes. Forward outputs carry at::linear's bits and weight gradients the
// composite's; the input gradient, summed inside the GEMMs (Note [Linear group input
// gradient]), is compared with an FP64 reference from the same BF16 inputs; 20 backward
// replays under load on other streams give the same bits.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <iostream>
#include <string>
#include <vector>

#include "ops/linear_group/linear_group_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/gpu_contention.h"
#include "tests/ops/linear_group_run.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::LinearGroupResult;
using test_support::run_linear_group;

struct Case {
  std::string name;
  at::Tensor x;
  std::vector<at::Tensor> weights, dys;
};

// Weights scaled like the model's init (std ~ 1/sqrt(in)), so y and dX are O(1).
Case make_case(const std::string& name, std::vector<int64_t> x_shape,
               const std::vector<int64_t>& outs) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const int64_t in = x_shape.back();
  Case c{name, at::randn(x_shape, cuda).to(at::kBFloat16), {}, {}};
  for (int64_t out : outs) {
    c.weights.push_back((at::randn({out, in}, cuda) / std::sqrt(double(in))).to(at::kBFloat16));
    x_shape.back() = out;
    c.dys.push_back(at::randn(x_shape, cuda).to(at::kBFloat16));
  }
  return c;
}

std::vector<Case> cases() {
  at::manual_seed(21);
  std::vector<Case> out;
  out.push_back(make_case("GDN qkv/z/b/a", {1, 2048, 1024}, {6144, 2048, 16, 16}));
  out.push_back(make_case("attention q/k/v", {1, 2048, 1024}, {4096, 512, 512}));
  out.push_back(make_case("MLP gate/up", {1, 2048, 1024}, {3584, 3584}));
  out.push_back(make_case("odd 3-D", {3, 37, 200}, {129, 1, 77}));
  out.push_back(make_case("odd 2-D", {45, 96}, {13, 96, 5, 31}));
  Case unused = make_case("unused first and last outputs", {2, 65, 128}, {96, 40, 7, 24});
  unused.dys.front() = at::Tensor();
  unused.dys.back() = at::Tensor();
  out.push_back(unused);
  return out;
}

// sum over the used outputs of dY_i @ W_i in FP64 from the same BF16 operands.
at::Tensor reference_grad_x(const Case& c) {
  at::Tensor ref = at::zeros(c.x.sizes(), c.x.options().dtype(at::kDouble));
  for (size_t i = 0; i < c.weights.size(); ++i) {
    if (!c.dys[i].defined()) continue;
    ref += at::matmul(c.dys[i].to(at::kDouble), c.weights[i].to(at::kDouble));
  }
  return ref;
}

double relative_error(const at::Tensor& got, const at::Tensor& ref) {
  return (got.to(at::kDouble) - ref).norm().item<double>() / ref.norm().item<double>();
}

TEST(LinearGroupGpu, ForwardGivesTheBitsOfAtLinear) {
  for (const Case& c : cases()) {
    const std::vector<at::Tensor> ys = linear_group(c.x, c.weights);
    for (size_t i = 0; i < ys.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(ys[i], at::linear(c.x, c.weights[i]))) << c.name << " y" << i;
    }
  }
}

// dW: the composite's bits. dX: the BF16 inputs' exact sum rounded a few times; the
// Frobenius relative error against the FP64 reference is bounded by 1e-2 (BF16's unit
// roundoff is 2^-9 ~ 2e-3, and each rounding adds at most that much per element), and it
// is at most 1.1x the composite's (fused: one rounding per GEMM, narrow products first;
// composite: one per GEMM and one per add; on the CPU's BF16 GEMM the fused error measured
// 0.7-0.8x the composite's for these groups, Note [Linear group input gradient]; 1.1
// leaves room for chance on the small shapes).
TEST(LinearGroupGpu, WeightGradsAreTheCompositeBitsAndInputGradIsClose) {
  for (const Case& c : cases()) {
    const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys);
    const LinearGroupResult composite = run_linear_group(false, c.x, c.weights, c.dys);
    for (size_t i = 0; i < c.weights.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(fused.ys[i], composite.ys[i])) << c.name << " y" << i;
      EXPECT_TRUE(bitwise_equal(fused.grad_weights[i], composite.grad_weights[i]))
          << c.name << " dW" << i;
      EXPECT_EQ(fused.grad_weights[i].defined(), c.dys[i].defined()) << c.name << " dW" << i;
    }
    ASSERT_EQ(fused.grad_x.sizes(), c.x.sizes()) << c.name;
    ASSERT_EQ(fused.grad_x.scalar_type(), at::kBFloat16) << c.name;
    const at::Tensor ref = reference_grad_x(c);
    const double fused_error = relative_error(fused.grad_x, ref);
    const double composite_error = relative_error(composite.grad_x, ref);
    EXPECT_LE(fused_error, 1e-2) << c.name;
    EXPECT_LE(fused_error, 1.1 * composite_error) << c.name << ": composite " << composite_error;
    const double max_ref = ref.abs().max().item<double>();
    EXPECT_LE((fused.grad_x.to(at::kDouble) - ref).abs().max().item<double>(), 1e-2 * max_ref)
        << c.name;
    std::cout << c.name << ": dX relative error fused " << fused_error << ", composite "
              << composite_error << "\n";
  }
}

TEST(LinearGroupGpu, OneUsedOutputGivesTheCompositeBits) {
  Case c = cases().front();
  for (size_t i = 1; i < c.dys.size(); ++i) c.dys[i] = at::Tensor();
  const LinearGroupResult fused = run_linear_group(true, c.x, c.weights, c.dys);
  const LinearGroupResult composite = run_linear_group(false, c.x, c.weights, c.dys);
  EXPECT_TRUE(bitwise_equal(fused.grad_x, composite.grad_x));
  EXPECT_TRUE(bitwise_equal(fused.grad_weights[0], composite.grad_weights[0]));
}

// A fixed order of GEMMs on one stream: 20 replays of the backward, under load on two other
// streams, give the first run's bits.
TEST(LinearGroupGpu, BackwardIsBitwiseReproducible) {
  const std::vector<Case> all = cases();
  for (const Case* c : {&all[0], &all[3]}) {
    const LinearGroupResult first = run_linear_group(true, c->x, c->weights, c->dys);
    test_support::GpuContention contention;
    for (int rep = 0; rep < 20; ++rep) {
      const LinearGroupResult again = run_linear_group(true, c->x, c->weights, c->dys);
      ASSERT_TRUE(bitwise_equal(again.grad_x, first.grad_x)) << c->name << " dX, replay " << rep;
      for (size_t i = 0; i < c->weights.size(); ++i) {
        ASSERT_TRUE(bitwise_equal(again.grad_weights[i], first.grad_weights[i]))
            << c->name << " dW" << i << ", replay " << rep;
        ASSERT_TRUE(bitwise_equal(again.ys[i], first.ys[i])) << c->name << " y" << i;
      }
    }
  }
}

}  // namespace
}  // namespace gdr
