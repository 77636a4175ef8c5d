#include <ATen/ATen.h>
#include <gtest/gtest.h>

TEST(LibtorchCpuSmoke, AddsTwoTensors) {
  at::Tensor x = at::arange(4, at::kFloat);
  at::Tensor y = x + x;
  EXPECT_EQ(y[3].item<float>(), 6.0f);
}
