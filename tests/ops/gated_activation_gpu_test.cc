// GPU tests of the fused gated activations (tag gpu): forward outputs and both gradients
// carry the bits of the unfused ATen ops and their autograd (Note [Gated activation
// rounding]) for BF16, FP16 and FP32, both activations, on the vectorised and the
// element paths: contiguous, odd sizes, a gate split off a wider projection (read in
// place), a misaligned view, a layout that needs a copy, and large |gate|.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <string>
#include <vector>

#include "ops/gated_activation/gated_activation_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/gated_activation_run.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;

using Result = test_support::GatedActivationResult;

Result run(bool fused, const at::Tensor& gate, const at::Tensor& x, const at::Tensor& dy,
           GatedActivationKind kind) {
  return test_support::run_gated_activation(fused, gate, x, dy, kind);
}

struct Layout {
  std::string name;
  at::Tensor gate, x, dy;
};

std::vector<Layout> layouts(at::ScalarType dtype, double gate_scale) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  auto randn = [&](at::IntArrayRef shape, double scale) {
    return (at::randn(shape, cuda) * scale).to(dtype);
  };
  std::vector<Layout> out;
  out.push_back({"contiguous", randn({3, 129, 512}, gate_scale), randn({3, 129, 512}, 2),
                 randn({3, 129, 512}, 1)});
  out.push_back({"odd size", randn({7, 13}, gate_scale), randn({7, 13}, 2), randn({7, 13}, 1)});
  {
    const at::Tensor projection = randn({2, 64, 4, 2 * 64}, gate_scale);
    out.push_back({"split gate", at::split(projection, 64, -1)[1], randn({2, 64, 4 * 64}, 2),
                   randn({2, 64, 4 * 64}, 1)});
  }
  {
    const at::Tensor big = randn({4097}, 2);
    out.push_back({"misaligned x", randn({16, 256}, gate_scale),
                   big.narrow(0, 1, 4096).view({16, 256}), randn({16, 256}, 1)});
  }
  out.push_back(
      {"transposed gate", randn({40, 24}, gate_scale).t(), randn({24, 40}, 2), randn({24, 40}, 1)});
  return out;
}

TEST(GatedActivationGpu, FusedGivesTheCompositeBits) {
  at::manual_seed(11);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (double gate_scale : {3.0, 40.0}) {  // 40: exp(-gate) overflows and underflows
      for (const Layout& l : layouts(dtype, gate_scale)) {
        for (GatedActivationKind kind :
             {GatedActivationKind::kSilu, GatedActivationKind::kSigmoid}) {
          const std::string what = l.name + ", " + std::string(c10::toString(dtype)) +
                                   ", gate scale " + std::to_string(gate_scale) +
                                   (kind == GatedActivationKind::kSilu ? ", silu" : ", sigmoid");
          const Result fused = run(true, l.gate, l.x, l.dy, kind);
          const Result composite = run(false, l.gate, l.x, l.dy, kind);
          EXPECT_TRUE(bitwise_equal(fused.y, composite.y)) << what;
          EXPECT_TRUE(bitwise_equal(fused.grad_x, composite.grad_x)) << what;
          EXPECT_TRUE(bitwise_equal(fused.grad_gate, composite.grad_gate)) << what;
          EXPECT_EQ(fused.grad_gate.sizes(), l.gate.sizes()) << what;
        }
      }
    }
  }
}

TEST(GatedActivationGpu, ModelEntryTakesTheFusedOpOnCuda) {
  at::manual_seed(12);
  const auto cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor gate = at::randn({64, 256}, cuda), x = at::randn({64, 256}, cuda);
  at::Tensor g = gate.detach().requires_grad_(true);
  const at::Tensor y = gated_activation(g, x, GatedActivationKind::kSilu);
  ASSERT_TRUE(y.grad_fn() != nullptr);
  EXPECT_NE(y.grad_fn()->name().find("GatedActivationFunction"), std::string::npos)
      << y.grad_fn()->name();
}

}  // namespace
}  // namespace gdr
