// Document masking in the whole model on CPU (Note [Document masking] in
// models/qwen/document_bounds.h), FP32, tiny config (3 GDN layers + 1 attention layer, Hv >
// Hk): changing the tokens of one document leaves every other document's logits bit-identical
// (and without the bounds they change, so the check can fail); each document's logits match
// the model run on the document alone within the GEMMs' rounding; rows of one document take
// the ordinary path bit for bit; the loss drops the targets at document starts; DocumentBounds'
// offsets and its and the model's exact messages.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "models/qwen/config.h"
#include "models/qwen/document_bounds.h"
#include "models/qwen/model.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/bitwise_equal.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;

QwenConfig tiny_config() {
  const absl::StatusOr<QwenConfig> c = load_qwen_config("configs/tiny.yaml");
  TORCH_CHECK(c.ok(), c.status().ToString());
  return *c;
}

QwenForCausalLM tiny_model(PreGdrFusion fusion = PreGdrFusion::kGate) {
  QwenConfig config = tiny_config();
  config.pre_gdr_fusion = fusion;
  QwenForCausalLM model(config);
  init_qwen_weights(*model, 11);
  return model;
}

DocumentBounds bounds(std::vector<std::vector<int64_t>> starts, int64_t length) {
  absl::StatusOr<DocumentBounds> b = DocumentBounds::create(std::move(starts), length);
  TORCH_CHECK(b.ok(), b.status().ToString());
  return *b;
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

// Two rows of 40 tokens: row 0 holds documents [0, 13), [13, 29), [29, 40); row 1 holds
// [0, 21), [21, 40).
constexpr int64_t kT = 40;
const std::vector<std::vector<int64_t>> kStarts = {{0, 13, 29}, {0, 21}};

at::Tensor random_ids(uint64_t seed) {
  at::manual_seed(seed);
  return at::randint(0, 256, {2, kT}, at::kLong);
}

struct Span {
  int64_t row, start, end;
};
const std::vector<Span> kDocuments = {
    {0, 0, 13}, {0, 13, 29}, {0, 29, 40}, {1, 0, 21}, {1, 21, 40}};

at::Tensor logits_of(const at::Tensor& logits, const Span& d) {
  return logits[d.row].narrow(0, d.start, d.end - d.start);
}

TEST(DocumentMasking, ChangingOneDocumentLeavesEveryOtherDocumentsLogitsBitIdentical) {
  at::NoGradGuard no_grad;
  for (PreGdrFusion fusion : {PreGdrFusion::kGate, PreGdrFusion::kNone}) {
    QwenForCausalLM model = tiny_model(fusion);
    const DocumentBounds documents = bounds(kStarts, kT);
    const at::Tensor ids = random_ids(1);
    const at::Tensor logits = model->forward(ids, documents);
    for (size_t changed = 0; changed < kDocuments.size(); ++changed) {
      const Span& c = kDocuments[changed];
      at::Tensor other_ids = ids.clone();
      other_ids[c.row].narrow(0, c.start, c.end - c.start).random_(0, 256);
      const at::Tensor other = model->forward(other_ids, documents);
      for (size_t d = 0; d < kDocuments.size(); ++d) {
        const bool same =
            bitwise_equal(logits_of(logits, kDocuments[d]), logits_of(other, kDocuments[d]));
        if (d == changed) {
          EXPECT_FALSE(same) << "the changed document " << d << " must change";
        } else {
          EXPECT_TRUE(same) << "document " << d << " leaks from document " << changed;
        }
      }
    }
  }
}

TEST(DocumentMasking, WithoutBoundsTheSameChangeLeaksIntoTheNextDocuments) {
  at::NoGradGuard no_grad;
  QwenForCausalLM model = tiny_model();
  const at::Tensor ids = random_ids(2);
  at::Tensor other_ids = ids.clone();
  other_ids[0].narrow(0, 13, 16).random_(0, 256);  // document 1 of row 0
  const at::Tensor logits = model->forward(ids), other = model->forward(other_ids);
  EXPECT_TRUE(bitwise_equal(logits_of(logits, kDocuments[0]), logits_of(other, kDocuments[0])))
      << "causal: the earlier document never sees the later one";
  EXPECT_GT(max_abs_diff(logits_of(logits, kDocuments[2]), logits_of(other, kDocuments[2])), 1e-4);
  EXPECT_TRUE(bitwise_equal(logits[1], other[1])) << "rows never mix";
}

TEST(DocumentMasking, EachDocumentMatchesTheModelRunOnItAloneWithinGemmRounding) {
  at::NoGradGuard no_grad;
  QwenForCausalLM model = tiny_model();
  const at::Tensor ids = random_ids(3);
  const at::Tensor logits = model->forward(ids, bounds(kStarts, kT));
  const at::Tensor unmasked = model->forward(ids);
  for (const Span& d : kDocuments) {
    const at::Tensor alone =
        model->forward(ids[d.row].narrow(0, d.start, d.end - d.start).unsqueeze(0))[0];
    // FP32 GEMMs over 5..80 rows with K = 64..128: a few ulps of logits of size ~1.
    EXPECT_LT(max_abs_diff(logits_of(logits, d), alone), 1e-5)
        << "row " << d.row << " [" << d.start << ", " << d.end << ")";
    if (d.start > 0) {
      EXPECT_GT(max_abs_diff(logits_of(unmasked, d), alone), 1e-3)
          << "without bounds a later document sees the earlier ones";
    }
  }
}

TEST(DocumentMasking, RowsOfOneDocumentTakeTheOrdinaryPathBitForBit) {
  QwenForCausalLM model = tiny_model();
  const at::Tensor ids = random_ids(4);
  const DocumentBounds single = bounds({{0}, {0}}, kT);
  EXPECT_TRUE(single.single_documents());
  EXPECT_TRUE(bitwise_equal(model->forward(ids, single), model->forward(ids)));
  EXPECT_TRUE(bitwise_equal(model->loss(ids, ids, single), model->loss(ids, ids)));
}

// Note [Recomputation] with bounds: the recomputing blocks re-run each layer with the same
// document starts, so masked gradients are the plain run's bits.
TEST(DocumentMasking, RecomputationKeepsTheMaskedLossAndGradientsBitForBit) {
  QwenForCausalLM model = tiny_model();
  const at::Tensor ids = random_ids(6);
  auto loss_and_grads = [&](Recompute recompute) {
    ExecutionPolicy policy;
    policy.recompute = recompute;
    const ExecutionPolicyGuard guard(policy);
    std::vector<at::Tensor> grads;
    at::Tensor loss;
    {
      // The bounds die before the backward: the blocks must keep what they need.
      const DocumentBounds documents = bounds(kStarts, kT);
      for (at::Tensor& p : model->parameters()) p.mutable_grad().reset();
      loss = model->loss(ids, ids, documents);
    }
    loss.backward();
    for (const at::Tensor& p : model->parameters()) grads.push_back(p.grad().clone());
    return std::make_pair(loss.detach(), grads);
  };
  const auto [plain_loss, plain_grads] = loss_and_grads(Recompute::kNone);
  for (Recompute recompute : {Recompute::kAttention, Recompute::kFull}) {
    const auto [loss, grads] = loss_and_grads(recompute);
    EXPECT_TRUE(bitwise_equal(loss, plain_loss));
    for (size_t i = 0; i < grads.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(grads[i], plain_grads[i]))
          << i << " recompute " << static_cast<int>(recompute);
    }
  }
}

TEST(DocumentMasking, TheLossDropsTheTargetsAtDocumentStarts) {
  QwenForCausalLM model = tiny_model();
  const at::Tensor ids = random_ids(5);
  const DocumentBounds documents = bounds(kStarts, kT);
  at::Tensor expected_labels = ids.clone();
  expected_labels[0][13] = kIgnoreIndex;
  expected_labels[0][29] = kIgnoreIndex;
  expected_labels[1][21] = kIgnoreIndex;
  EXPECT_TRUE(at::equal(document_masked_labels(ids, documents), expected_labels));
  EXPECT_TRUE(bitwise_equal(model->loss(ids, ids, documents),
                            causal_lm_loss(model->forward(ids, documents), expected_labels)));
  // Gradients flow through the masked loss.
  model->loss(ids, ids, documents).backward();
  EXPECT_GT(model->model->embed_tokens->weight.grad().abs().max().item<double>(), 0.0);
  // Independent check: the mean over documents' own next-token terms, each document alone.
  at::NoGradGuard no_grad;
  double sum = 0;
  int64_t count = 0;
  for (const Span& d : kDocuments) {
    const at::Tensor doc = ids[d.row].narrow(0, d.start, d.end - d.start).unsqueeze(0);
    const int64_t terms = d.end - d.start - 1;
    sum += model->loss(doc, doc).item<double>() * static_cast<double>(terms);
    count += terms;
  }
  EXPECT_NEAR(model->loss(ids, ids, documents).item<double>(), sum / static_cast<double>(count),
              1e-5);
}

TEST(DocumentMasking, BoundsGiveTheFlatOffsets) {
  const DocumentBounds documents = bounds(kStarts, kT);
  EXPECT_EQ(documents.cu_seqlens(), (std::vector<int64_t>{0, 13, 29, 40, 61, 80}));
  EXPECT_EQ(documents.flat_starts_after_the_first(), (std::vector<int64_t>{13, 29, 61}));
  EXPECT_FALSE(documents.single_documents());
}

TEST(DocumentMasking, BadBoundsAreErrorsNamingTheRow) {
  auto message = [](std::vector<std::vector<int64_t>> starts, int64_t length) {
    return std::string(DocumentBounds::create(std::move(starts), length).status().message());
  };
  EXPECT_EQ(message({{0, 5}, {0, 9, 9}}, 10),
            "document bounds: row 1: expected strictly increasing document starts in [0, 10) "
            "beginning with 0 but got [0, 9, 9]");
  EXPECT_EQ(message({{3}}, 10),
            "document bounds: row 0: expected strictly increasing document starts in [0, 10) "
            "beginning with 0 but got [3]");
  EXPECT_EQ(message({{0, 10}}, 10),
            "document bounds: row 0: expected strictly increasing document starts in [0, 10) "
            "beginning with 0 but got [0, 10]");
  EXPECT_EQ(message({}, 10), "document bounds: expected at least one row but got none");
  EXPECT_EQ(message({{0}}, 0), "document bounds: expected a row length >= 1 but got 0");

  QwenForCausalLM model = tiny_model();
  try {
    model->forward(random_ids(6), bounds({{0, 3}}, kT));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "QwenModel: expected document bounds of 2 rows of 40 tokens (input_ids' B, T) but "
              "got 1 rows of 40");
  }
}

}  // namespace
}  // namespace gdr
