// Packed documents on CUDA (tag gpu; Note [Packed documents] in
// ops/packed/packed_documents.h): the checks of packed_documents_test with the CUDA
// implementations the model runs in BF16 training (the fused causal conv kernels, cuDNN
// attention, the fused RoPE, the GDR core's chunk kernels), in deterministic mode: each op's
// *_varlen entry point gives bit for bit the outputs and input gradients of the op on each
// document alone, and without the bounds the outputs change. The varlen entry points run the
// op per document, so this holds by construction; the test proves the kernels' bits do not
// depend on where a document's slice sits in memory.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "ops/attention/attention_op.h"
#include "ops/causal_conv1d/causal_conv1d_op.h"
#include "ops/gdr_core/gdr_core_op.h"
#include "ops/rope/rope_op.h"
#include "tests/ops/packed_documents_checks.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

using test_support::boundaries_change_the_output;
using test_support::expect_packed_equals_alone;
using test_support::PackedInput;
using test_support::PolicyForTest;

// Lengths 100, 0, 257, 1, 666: chunk and tile tails of every kind, T = 1024.
const std::vector<int64_t> kCu = {0, 100, 100, 357, 358, 1024};
constexpr int64_t kT = 1024;

at::TensorOptions cuda(at::ScalarType dtype) {
  return at::TensorOptions().device(at::kCUDA).dtype(dtype);
}

TEST(PackedDocumentsGpu, CausalConvKernelEqualsEachDocumentAlone) {
  const PolicyForTest policy("GDR_DETERMINISTIC", "1");
  at::manual_seed(1);
  const at::Tensor x = at::randn({1, kT, 384}, cuda(at::kBFloat16)),
                   w = (at::randn({384, 1, 4}, cuda(at::kFloat)) * 0.5).to(at::kBFloat16);
  ASSERT_TRUE(causal_conv1d_kernel_supports(x, w));
  const std::vector<PackedInput> inputs = {{"x", x, 1}, {"weight", w, -1}};
  auto alone = [](const std::vector<at::Tensor>& in) { return causal_conv1d_silu(in[0], in[1]); };
  auto packed = [](const std::vector<at::Tensor>& in) {
    return causal_conv1d_silu_varlen(in[0], in[1], kCu, CausalConvImpl::kKernel);
  };
  expect_packed_equals_alone(inputs, 1, kCu, packed, alone, /*shared_rtol=*/2e-2);
  EXPECT_TRUE(boundaries_change_the_output(inputs, packed, alone));
}

TEST(PackedDocumentsGpu, CudnnAttentionEqualsEachDocumentAlone) {
  const PolicyForTest policy("GDR_DETERMINISTIC", "1");
  at::manual_seed(2);
  const at::Tensor q = at::randn({1, 8, kT, 64}, cuda(at::kBFloat16)),
                   k = at::randn({1, 2, kT, 64}, cuda(at::kBFloat16)),
                   v = at::randn({1, 2, kT, 64}, cuda(at::kBFloat16));
  ASSERT_EQ(attention_backend(q, k, v, 0.125), AttentionBackend::kCudnn);
  const std::vector<PackedInput> inputs = {{"q", q, 2}, {"k", k, 2}, {"v", v, 2}};
  auto alone = [](const std::vector<at::Tensor>& in) {
    return causal_attention(in[0], in[1], in[2], 0.125);
  };
  auto packed = [](const std::vector<at::Tensor>& in) {
    return causal_attention_varlen(in[0], in[1], in[2], 0.125, kCu);
  };
  expect_packed_equals_alone(inputs, 2, kCu, packed, alone);
  EXPECT_TRUE(boundaries_change_the_output(inputs, packed, alone));
}

TEST(PackedDocumentsGpu, FusedRopeRestartsPositionsAtEachDocument) {
  const PolicyForTest policy("GDR_DETERMINISTIC", "1");
  at::manual_seed(3);
  const at::Tensor x = at::randn({1, kT, 8, 64}, cuda(at::kBFloat16)).transpose(1, 2);
  const std::vector<PackedInput> inputs = {{"x", x, 2}};
  auto alone = [](const std::vector<at::Tensor>& in) { return partial_rope(in[0], 16, 1e7); };
  auto packed = [](const std::vector<at::Tensor>& in) {
    return partial_rope_varlen(in[0], 16, 1e7, kCu);
  };
  expect_packed_equals_alone(inputs, 2, kCu, packed, alone);
  EXPECT_TRUE(boundaries_change_the_output(inputs, packed, alone));
}

TEST(PackedDocumentsGpu, GdrCoreKernelsEqualEachDocumentAlone) {
  const PolicyForTest policy("GDR_DETERMINISTIC", "1");
  at::manual_seed(4);
  const int64_t Hk = 2, H = 4, dk = 64, dv = 64;
  const at::Tensor q = at::randn({1, kT, Hk, dk}, cuda(at::kBFloat16)),
                   k = at::randn({1, kT, Hk, dk}, cuda(at::kBFloat16)),
                   v = at::randn({1, kT, H, dv}, cuda(at::kBFloat16)),
                   g = at::log_sigmoid(at::randn({1, kT, H}, cuda(at::kFloat))),
                   beta = at::sigmoid(at::randn({1, kT, H}, cuda(at::kFloat)));
  const std::vector<PackedInput> inputs = {
      {"q", q, 1}, {"k", k, 1}, {"v", v, 1}, {"g", g, 1}, {"beta", beta, 1}};
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  auto alone = [scale](const std::vector<at::Tensor>& in) {
    return std::get<0>(gated_delta_rule(in[0], in[1], in[2], in[3], in[4], scale, std::nullopt,
                                        false, GdrQkNorm::kL2));
  };
  auto packed = [scale](const std::vector<at::Tensor>& in) {
    return std::get<0>(gated_delta_rule_varlen(in[0], in[1], in[2], in[3], in[4], scale, kCu,
                                               std::nullopt, false, GdrQkNorm::kL2));
  };
  expect_packed_equals_alone(inputs, 1, kCu, packed, alone);
  EXPECT_TRUE(boundaries_change_the_output(inputs, packed, alone));
  EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kKernel);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel);
}

}  // namespace
}  // namespace gdr
