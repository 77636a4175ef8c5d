// Document masking in the whole model on CUDA (tag gpu; Note [Document masking] in
// models/qwen/document_bounds.h): a tiny model with head dims the CUDA kernels take (the GDR
// core's chunk kernels, cuDNN attention, the fused conv, RoPE and norms), BF16, deterministic
// mode: changing the tokens of one document leaves every other document's logits
// bit-identical, rows of one document take the ordinary path bit for bit, and the masked loss
// and gradients are bit-identical on a rerun. packed_documents_gpu_test checks the ops alone.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "models/qwen/config.h"
#include "models/qwen/document_bounds.h"
#include "models/qwen/model.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::PolicyForTest;

QwenForCausalLM kernel_shaped_model() {
  absl::StatusOr<QwenConfig> config = load_qwen_config("configs/tiny.yaml");
  TORCH_CHECK(config.ok(), config.status().ToString());
  config->hidden_size = 128;
  config->head_dim = 64;
  config->linear_key_head_dim = 64;
  config->linear_value_head_dim = 64;
  QwenForCausalLM model(*config);
  init_qwen_weights(*model, 21);
  model->to(at::kCUDA, at::kBFloat16);
  return model;
}

constexpr int64_t kT = 300;
const std::vector<std::vector<int64_t>> kStarts = {{0, 70, 200}, {0, 129}};

struct Span {
  int64_t row, start, end;
};
const std::vector<Span> kDocuments = {
    {0, 0, 70}, {0, 70, 200}, {0, 200, 300}, {1, 0, 129}, {1, 129, 300}};

DocumentBounds bounds(std::vector<std::vector<int64_t>> starts) {
  absl::StatusOr<DocumentBounds> b = DocumentBounds::create(std::move(starts), kT);
  TORCH_CHECK(b.ok(), b.status().ToString());
  return *b;
}

at::Tensor random_ids(uint64_t seed) {
  at::manual_seed(seed);
  return at::randint(0, 256, {2, kT}, at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
}

TEST(DocumentMaskingGpu, ChangingOneDocumentLeavesEveryOtherDocumentsLogitsBitIdentical) {
  const PolicyForTest policy("GDR_DETERMINISTIC", "1");
  at::NoGradGuard no_grad;
  QwenForCausalLM model = kernel_shaped_model();
  const DocumentBounds documents = bounds(kStarts);
  const at::Tensor ids = random_ids(1);
  const at::Tensor logits = model->forward(ids, documents);
  for (size_t changed = 0; changed < kDocuments.size(); ++changed) {
    const Span& c = kDocuments[changed];
    at::Tensor other_ids = ids.clone();
    other_ids[c.row].narrow(0, c.start, c.end - c.start).random_(0, 256);
    const at::Tensor other = model->forward(other_ids, documents);
    for (size_t d = 0; d < kDocuments.size(); ++d) {
      const Span& s = kDocuments[d];
      const bool same = bitwise_equal(logits[s.row].narrow(0, s.start, s.end - s.start),
                                      other[s.row].narrow(0, s.start, s.end - s.start));
      EXPECT_EQ(same, d != changed) << "document " << d << ", changed " << changed;
    }
  }
}

TEST(DocumentMaskingGpu, RowsOfOneDocumentTakeTheOrdinaryPathBitForBit) {
  const PolicyForTest policy("GDR_DETERMINISTIC", "1");
  QwenForCausalLM model = kernel_shaped_model();
  const at::Tensor ids = random_ids(2);
  EXPECT_TRUE(bitwise_equal(model->loss(ids, ids, bounds({{0}, {0}})), model->loss(ids, ids)));
}

TEST(DocumentMaskingGpu, MaskedLossAndGradientsAreBitIdenticalOnARerun) {
  const PolicyForTest policy("GDR_DETERMINISTIC", "1");
  QwenForCausalLM model = kernel_shaped_model();
  const at::Tensor ids = random_ids(3);
  const DocumentBounds documents = bounds(kStarts);
  auto run = [&] {
    model->zero_grad();
    at::Tensor loss = model->loss(ids, ids, documents);
    loss.backward();
    std::vector<at::Tensor> out = {loss.detach().clone()};
    for (const auto& p : model->parameters()) out.push_back(p.grad().detach().clone());
    return out;
  };
  const std::vector<at::Tensor> first = run(), second = run();
  ASSERT_TRUE(std::isfinite(first[0].item<double>()));
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(bitwise_equal(first[i], second[i])) << i;
}

}  // namespace
}  // namespace gdr
