// GPU tests of the pairwise tree sum (tag gpu): the one-pass kernel gives the bits of the
// CPU reference evaluation for many tree shapes, all input dtypes, vectorised and scalar
// paths (aligned / misaligned pointers, numel % 4 != 0), out aliasing an input, and the
// fallbacks (non-contiguous operands, more inputs than the kernel takes); replays give the
// same bits while other streams load the GPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ops/tree_sum/tree_sum_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/gpu_contention.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;

std::vector<at::Tensor> make_inputs(const std::vector<int64_t>& counts, int64_t numel,
                                    int64_t offset, uint64_t seed) {
  at::manual_seed(seed);
  const at::ScalarType dtypes[] = {at::kBFloat16, at::kFloat, at::kHalf};
  std::vector<at::Tensor> inputs;
  for (size_t i = 0; i < counts.size(); ++i) {
    const at::Tensor x =
        at::randn({numel + offset}) * at::pow(10.0, at::randint(-3, 4, {numel + offset}));
    // Half keeps |x| < 65504; the offset slices make misaligned pointers.
    const at::ScalarType t = dtypes[i % 3];
    const at::Tensor v = (t == at::kHalf ? x.clamp(-6e4, 6e4) : x).to(t);
    inputs.push_back(v.narrow(0, offset, numel).cuda());
  }
  return inputs;
}

at::Tensor cpu_sum(const std::vector<at::Tensor>& inputs, const std::vector<int64_t>& counts) {
  std::vector<at::Tensor> cpu;
  for (const at::Tensor& t : inputs) cpu.push_back(t.cpu());
  const at::Tensor out = at::empty(inputs[0].sizes());
  pairwise_tree_sum_out(cpu, counts, out);
  return out;
}

TEST(TreeSumGpu, KernelGivesTheReferenceBits) {
  const std::vector<std::vector<int64_t>> patterns = {
      {1},          {1, 1},       {1, 1, 1},          {1, 1, 1, 1},
      {4, 1, 1, 1}, {8, 4, 2, 1}, {8, 4, 1, 1, 1, 1}, std::vector<int64_t>(16, 1)};
  const int64_t sizes[] = {1, 7, 4096, 1000003};
  const int64_t offsets[] = {0, 1};
  uint64_t seed = 1;
  for (const auto& counts : patterns) {
    for (int64_t numel : sizes) {
      for (int64_t offset : offsets) {
        const std::vector<at::Tensor> inputs = make_inputs(counts, numel, offset, ++seed);
        const at::Tensor out = at::empty({numel}, at::TensorOptions().device(at::kCUDA));
        pairwise_tree_sum_out(inputs, counts, out);
        EXPECT_TRUE(bitwise_equal(out.cpu(), cpu_sum(inputs, counts)))
            << counts.size() << " inputs, numel " << numel << ", offset " << offset;
      }
    }
  }
}

TEST(TreeSumGpu, OutMayBeAnInputAndFallbacksGiveTheSameBits) {
  const std::vector<int64_t> counts = {2, 1, 1};
  std::vector<at::Tensor> inputs = make_inputs(counts, 4096, 0, 99);
  inputs[0] = inputs[0].to(at::kFloat);
  const at::Tensor want = cpu_sum(inputs, counts);
  pairwise_tree_sum_out(inputs, counts, inputs[0]);
  EXPECT_TRUE(bitwise_equal(inputs[0].cpu(), want)) << "out aliasing inputs[0]";

  // Non-contiguous operands and 17 inputs take the reference path on the GPU.
  const at::Tensor wide = at::randn({64, 32}, at::TensorOptions().device(at::kCUDA));
  const std::vector<at::Tensor> strided = {wide.t(), (wide * 3).t()};
  const at::Tensor out = at::empty({32, 64}, at::TensorOptions().device(at::kCUDA));
  pairwise_tree_sum_out(strided, {1, 1}, out);
  EXPECT_TRUE(bitwise_equal(out.cpu(), cpu_sum(strided, {1, 1}))) << "non-contiguous";
  const std::vector<int64_t> many(17, 1);
  const std::vector<at::Tensor> seventeen = make_inputs(many, 999, 0, 5);
  const at::Tensor out17 = at::empty({999}, at::TensorOptions().device(at::kCUDA));
  pairwise_tree_sum_out(seventeen, many, out17);
  EXPECT_TRUE(bitwise_equal(out17.cpu(), cpu_sum(seventeen, many))) << "17 inputs";
}

TEST(TreeSumGpu, ReplaysAreBitIdenticalUnderContention) {
  const std::vector<int64_t> counts = {4, 1, 1, 1, 1};
  const std::vector<at::Tensor> inputs = make_inputs(counts, (1 << 22) + 3, 0, 11);
  const at::Tensor first = at::empty({(1 << 22) + 3}, at::TensorOptions().device(at::kCUDA));
  pairwise_tree_sum_out(inputs, counts, first);
  test_support::GpuContention contention;
  int mismatches = 0;
  for (int r = 0; r < 100; ++r) {
    const at::Tensor again = at::empty_like(first);
    pairwise_tree_sum_out(inputs, counts, again);
    mismatches += bitwise_equal(again, first) ? 0 : 1;
  }
  EXPECT_EQ(mismatches, 0);
}

}  // namespace
}  // namespace gdr
