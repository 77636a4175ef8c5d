// Proves the whole chain (built on a CPU machine, run on a GPU one): libtorch allocates
// CUDA tensors, one of our kernels runs on the current stream, and the result matches
// the same formulas computed on the CPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>

#include "kernels/pre_gdr_gate/pre_gdr_gate.h"
#include "kernels/pre_gdr_gate/pre_gdr_gate_math.h"

TEST(CudaSmoke, GateForwardKernelRunsOnTheCurrentStreamAndMatchesTheCpu) {
  ASSERT_TRUE(at::hasCUDA()) << "this test needs a CUDA GPU";
  const int64_t tokens = 1000, heads = 7;
  at::Tensor a = at::linspace(-30, 30, tokens * heads).reshape({tokens, heads});
  at::Tensor b = at::linspace(-8, 8, tokens * heads).reshape({tokens, heads});
  at::Tensor A_log = at::linspace(-1, 2, heads);
  at::Tensor dt_bias = at::linspace(0.5, 1.5, heads);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::Tensor a_d = a.to(at::kCUDA), b_d = b.to(at::kCUDA);
  at::Tensor A_d = A_log.to(at::kCUDA), dt_d = dt_bias.to(at::kCUDA);
  at::Tensor g = at::empty({tokens, heads}, cuda), beta = at::empty({tokens, heads}, cuda);

  gdr::kernels::GateForwardArgs args;
  args.shape = {1, tokens, heads};
  args.a = {a_d.data_ptr(), 0, a_d.stride(0), a_d.stride(1)};
  args.b = {b_d.data_ptr(), 0, b_d.stride(0), b_d.stride(1)};
  args.A_log = A_d.data_ptr();
  args.dt_bias = dt_d.data_ptr();
  args.g = g.data_ptr<float>();
  args.beta = beta.data_ptr<float>();
  ASSERT_EQ(
      gdr::kernels::launch_pre_gdr_gate_forward(args, c10::cuda::getCurrentCUDAStream().stream()),
      0);

  const at::Tensor g_host = g.cpu(), beta_host = beta.cpu();
  for (int64_t t = 0; t < tokens; t += 37) {
    for (int64_t h = 0; h < heads; ++h) {
      const float pre = a[t][h].item<float>() + dt_bias[h].item<float>();
      const float expect_g = -std::exp(A_log[h].item<float>()) * gdr::kernels::gate_softplus(pre);
      EXPECT_NEAR(g_host[t][h].item<float>(), expect_g, 2e-6f * std::max(1.0f, std::abs(expect_g)));
      EXPECT_NEAR(beta_host[t][h].item<float>(), gdr::kernels::gate_sigmoid(b[t][h].item<float>()),
                  1e-6f);
    }
  }
}
