// GPU tests of the fused partial RoPE (tag gpu): output and input gradient carry the ATen
// composite's bits (Note [Rope rounding]) for BF16, FP16 and FP32, the model's transposed
// layout (kept in the output) and a contiguous one, partial and full rotation, on the
// vectorised and the element kernel.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <string>

#include "ops/rope/rope_op.h"
#include "tests/ops/bitwise_equal.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;

struct Result {
  at::Tensor y, dx;
};

Result run(bool fused, const at::Tensor& x_in, const at::Tensor& dy, int64_t rotary) {
  at::Tensor x = x_in.detach().requires_grad_(true);
  const at::Tensor y =
      fused ? partial_rope_fused(x, rotary, 1e7) : partial_rope_composite(x, rotary, 1e7);
  return {y.detach(), torch::autograd::grad({y}, {x}, {dy})[0]};
}

TEST(RopeGpu, FusedGivesTheCompositeBits) {
  at::manual_seed(21);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
    for (int64_t head_dim : {256, 64}) {
      // rotary 4: half 2 is not a whole vector, so the element kernel; the others the
      // vectorised one.
      for (int64_t rotary : {int64_t{4}, int64_t{64}, head_dim}) {
        for (bool transposed : {true, false}) {
          const std::string what = std::string(c10::toString(dtype)) + " hd " +
                                   std::to_string(head_dim) + " rotary " + std::to_string(rotary) +
                                   (transposed ? " transposed" : " contiguous");
          const at::Tensor x =
              transposed ? (at::randn({2, 300, 3, head_dim}, cuda) * 2).to(dtype).transpose(1, 2)
                         : (at::randn({2, 3, 300, head_dim}, cuda) * 2).to(dtype);
          const at::Tensor dy = at::randn({2, 3, 300, head_dim}, cuda).to(dtype);
          const Result fused = run(true, x, dy, rotary), composite = run(false, x, dy, rotary);
          EXPECT_TRUE(bitwise_equal(fused.y, composite.y)) << what;
          EXPECT_TRUE(bitwise_equal(fused.dx, composite.dx)) << what;
          EXPECT_EQ(fused.y.strides(), x.strides()) << what;  // x's layout kept
        }
      }
    }
  }
}

}  // namespace
}  // namespace gdr
