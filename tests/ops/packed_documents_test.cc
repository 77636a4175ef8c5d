// Packed documents on CPU (Note [Packed documents] in ops/packed/packed_documents.h): each
// op's *_varlen entry point (the GDN core, the causal conv1d in both implementations, causal
// attention, partial RoPE) on documents packed back to back gives bit for bit the outputs and
// input gradients of the op on each document alone; without the bounds the outputs change
// (so the checks can fail); the attention also against an independent block-diagonal causal
// mask; the argument checks' exact messages. packed_documents_gpu_test runs the same checks
// on CUDA.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "ops/attention/attention_op.h"
#include "ops/causal_conv1d/causal_conv1d_op.h"
#include "ops/gdr_core/gdr_core_op.h"
#include "ops/packed/packed_documents.h"
#include "ops/rope/rope_op.h"
#include "tests/ops/error_of.h"
#include "tests/ops/packed_documents_checks.h"

namespace gdr {
namespace {

using test_support::boundaries_change_the_output;
using test_support::error_of;
using test_support::expect_packed_equals_alone;
using test_support::PackedInput;

// Lengths 7, 0 (empty), 13, 1 (a single token), 27: tails of every kind, T = 48.
const std::vector<int64_t> kCu = {0, 7, 7, 20, 21, 48};
constexpr int64_t kT = 48;

TEST(PackedDocuments, CausalConvEqualsEachDocumentAloneBothImplementations) {
  at::manual_seed(1);
  const at::Tensor x = at::randn({1, kT, 12}), w = at::randn({12, 1, 4}) * 0.5;
  const std::vector<PackedInput> inputs = {{"x", x, 1}, {"weight", w, -1}};
  for (CausalConvImpl impl : {CausalConvImpl::kAten, CausalConvImpl::kKernel}) {
    SCOPED_TRACE(impl == CausalConvImpl::kAten ? "composite" : "op");
    auto alone = [impl](const std::vector<at::Tensor>& in) {
      return impl == CausalConvImpl::kAten ? causal_conv1d_silu_composite(in[0], in[1])
                                           : causal_conv1d_silu(in[0], in[1]);
    };
    auto packed = [impl](const std::vector<at::Tensor>& in) {
      return causal_conv1d_silu_varlen(in[0], in[1], kCu, impl);
    };
    expect_packed_equals_alone(inputs, 1, kCu, packed, alone);
    EXPECT_TRUE(boundaries_change_the_output(inputs, packed, alone));
  }
}

TEST(PackedDocuments, CausalConvZeroesTheHistoryAtEachBoundary) {
  // Independent check: the first token of a document sees only itself, silu(w[K-1] * x).
  at::manual_seed(2);
  const at::Tensor x = at::randn({1, kT, 3}, at::kDouble), w = at::randn({3, 1, 4}, at::kDouble);
  const at::Tensor y = causal_conv1d_silu_varlen(x, w, kCu, CausalConvImpl::kAten);
  for (int64_t start : {0, 7, 20, 21}) {
    const at::Tensor expected = at::silu(x[0][start] * w.select(2, 3).squeeze(1));
    EXPECT_LT((y[0][start] - expected).abs().max().item<double>(), 1e-15) << start;
  }
}

TEST(PackedDocuments, CausalAttentionEqualsEachDocumentAlone) {
  at::manual_seed(3);
  const at::Tensor q = at::randn({1, 4, kT, 16}), k = at::randn({1, 2, kT, 16}),
                   v = at::randn({1, 2, kT, 16});
  const double scale = 0.25;
  const std::vector<PackedInput> inputs = {{"q", q, 2}, {"k", k, 2}, {"v", v, 2}};
  auto alone = [scale](const std::vector<at::Tensor>& in) {
    return causal_attention(in[0], in[1], in[2], scale);
  };
  auto packed = [scale](const std::vector<at::Tensor>& in) {
    return causal_attention_varlen(in[0], in[1], in[2], scale, kCu);
  };
  expect_packed_equals_alone(inputs, 2, kCu, packed, alone);
  EXPECT_TRUE(boundaries_change_the_output(inputs, packed, alone));
}

TEST(PackedDocuments, CausalAttentionIsABlockDiagonalCausalMask) {
  // Independent check written from the definition: one attention over the whole sequence
  // with a mask that allows key j for query i iff both are in one document and j <= i.
  at::manual_seed(4);
  const at::Tensor q = at::randn({1, 4, kT, 8}, at::kDouble),
                   k = at::randn({1, 2, kT, 8}, at::kDouble),
                   v = at::randn({1, 2, kT, 8}, at::kDouble);
  std::vector<int64_t> document(kT);
  for (size_t d = 0; d + 1 < kCu.size(); ++d) {
    for (int64_t t = kCu[d]; t < kCu[d + 1]; ++t) document[t] = static_cast<int64_t>(d);
  }
  at::Tensor allowed = at::zeros({kT, kT}, at::kBool);
  for (int64_t i = 0; i < kT; ++i) {
    for (int64_t j = 0; j <= i; ++j) allowed[i][j] = document[i] == document[j];
  }
  const at::Tensor expected = at::scaled_dot_product_attention(
      q, k, v, allowed, 0.0, /*is_causal=*/false, 0.3, /*enable_gqa=*/true);
  const at::Tensor packed = causal_attention_varlen(q, k, v, 0.3, kCu);
  EXPECT_LT((packed - expected).abs().max().item<double>(), 1e-12);
}

TEST(PackedDocuments, PartialRopeRestartsPositionsAtEachDocument) {
  at::manual_seed(5);
  // [1, T, H, hd] transposed, the model's layout.
  const at::Tensor x = at::randn({1, kT, 3, 16}).transpose(1, 2);
  const std::vector<PackedInput> inputs = {{"x", x, 2}};
  auto alone = [](const std::vector<at::Tensor>& in) { return partial_rope(in[0], 8, 1e4); };
  auto packed = [](const std::vector<at::Tensor>& in) {
    return partial_rope_varlen(in[0], 8, 1e4, kCu);
  };
  expect_packed_equals_alone(inputs, 2, kCu, packed, alone);
  EXPECT_TRUE(boundaries_change_the_output(inputs, packed, alone));
  // The result keeps the model's layout: transposing back is free.
  EXPECT_TRUE(packed(std::vector<at::Tensor>{x}).transpose(1, 2).is_contiguous());
}

TEST(PackedDocuments, GatedDeltaRuleEqualsEachDocumentAloneWithGradients) {
  at::manual_seed(6);
  const int64_t Hk = 2, H = 4, dk = 8, dv = 6;
  const at::Tensor q = at::randn({1, kT, Hk, dk}), k = at::randn({1, kT, Hk, dk}),
                   v = at::randn({1, kT, H, dv}), g = at::log_sigmoid(at::randn({1, kT, H})),
                   beta = at::sigmoid(at::randn({1, kT, H}));
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
}

TEST(PackedDocuments, OneDocumentIsTheOpItself) {
  at::manual_seed(7);
  const std::vector<int64_t> whole = {0, kT};
  const at::Tensor x = at::randn({1, kT, 5}), w = at::randn({5, 1, 3});
  EXPECT_TRUE(
      test_support::bitwise_equal(causal_conv1d_silu_varlen(x, w, whole, CausalConvImpl::kAten),
                                  causal_conv1d_silu_composite(x, w)));
  const at::Tensor q = at::randn({1, 2, kT, 8}), k = at::randn({1, 2, kT, 8});
  EXPECT_TRUE(test_support::bitwise_equal(causal_attention_varlen(q, k, k, 0.5, whole),
                                          causal_attention(q, k, k, 0.5)));
}

TEST(PackedDocuments, RejectsBadArgumentsNamingThem) {
  const at::Tensor x = at::zeros({1, kT, 4}), w = at::zeros({4, 1, 4});
  EXPECT_EQ(
      error_of([&] {
        causal_conv1d_silu_varlen(x, w, {0, 7, 40});
      }),
      "causal_conv1d_silu_varlen: expected cu_seqlens to run from 0 to T = 48 but got 0 .. 40");
  EXPECT_EQ(error_of([&] {
              causal_conv1d_silu_varlen(at::zeros({2, kT, 4}), w, {0, kT});
            }),
            "causal_conv1d_silu_varlen: expected packed x of shape [1, T, C] but got [2, 48, 4]");
  const at::Tensor q = at::zeros({1, 2, kT, 8});
  EXPECT_EQ(error_of([&] {
              causal_attention_varlen(q, q, q, 1.0, {0, 9, 5, kT});
            }),
            "causal_attention_varlen: expected non-decreasing cu_seqlens but offset 2 (5) < "
            "offset 1 (9)");
  EXPECT_EQ(error_of([&] {
              causal_attention_varlen(q, q.narrow(2, 0, 40), q, 1.0, {0, kT});
            }),
            "causal_attention_varlen: expected packed k of shape [1, heads, T, D] with T = 48 "
            "(q's) but got [1, 2, 40, 8]");
  EXPECT_EQ(error_of([&] { partial_rope_varlen(q, 4, 1e4, {kT}); }),
            "partial_rope_varlen: expected cu_seqlens with at least 2 offsets (one document) but "
            "got 1");
}

}  // namespace
}  // namespace gdr
