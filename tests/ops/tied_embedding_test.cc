// CPU tests of the tied embedding pair (ops/tied_embedding/tied_embedding_op.h): the rows op
// against a plain loop written from the spec (FP32 sums in token order, one rounding), the chain's
// gradients against the composite (torch::nn::Embedding's at::embedding + matmul), the
// paths where one of the two backwards does not run, the GDR_TIED_EMBEDDING switch and
// the argument checks' exact messages.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <vector>

#include "ops/policy/execution_policy.h"
#include "ops/tied_embedding/tied_embedding_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"
#include "tests/ops/policy_for_test.h"
#include "tests/ops/tied_embedding_run.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::error_of;
using test_support::expected_fused_grad_weight;
using test_support::PolicyForTest;
using test_support::run_tied_chain;
using test_support::TiedChainResult;

// Independent check, written from the spec: for each row v, the rows of the tokens with
// id v summed in FP32 in token order from the first one, then ONE rounding into dW[v].
// Plain element loops over float copies; Double runs in double.
at::Tensor plain_loop_add_rows(const at::Tensor& dw_in, const at::Tensor& ids,
                               const at::Tensor& rows) {
  const bool fp64 = dw_in.scalar_type() == at::kDouble;
  const at::ScalarType acc_type = fp64 ? at::kDouble : at::kFloat;
  const at::Tensor dw = dw_in.to(acc_type), r = rows.to(acc_type);
  at::Tensor out = dw.clone();
  const int64_t vocab = dw.size(0), hidden = dw.size(1), tokens = ids.size(0);
  const auto id = ids.accessor<int64_t, 1>();
  for (int64_t v = 0; v < vocab; ++v) {
    for (int64_t c = 0; c < hidden; ++c) {
      bool any = false;
      double acc64 = 0;
      float acc32 = 0;
      for (int64_t t = 0; t < tokens; ++t) {
        if (id[t] != v) continue;
        const double x = r[t][c].item<double>();
        if (fp64) {
          acc64 = any ? acc64 + x : x;
        } else {
          acc32 = any ? acc32 + static_cast<float>(x) : static_cast<float>(x);
        }
        any = true;
      }
      if (!any) continue;
      if (fp64) {
        out[v][c] = dw[v][c].item<double>() + acc64;
      } else {
        out[v][c] = dw[v][c].item<float>() + acc32;  // FP32 add; the .to() below rounds once
      }
    }
  }
  return out.to(dw_in.scalar_type());
}

// Ids with repeats: 0 and V-1, one id in many tokens, a few once.
at::Tensor repeated_ids(int64_t vocab) {
  return at::tensor(
      std::vector<int64_t>{3, 0, vocab - 1, 3, 5, 3, 0, 3, 7, 3, 3, vocab - 1, 3, 2, 3, 3, 6, 3},
      at::kLong);
}

class AddRowsCpu : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(AddRowsCpu, MatchesAPlainLoopBitForBit) {
  const at::ScalarType dtype = GetParam();
  at::manual_seed(11);
  const int64_t vocab = 9, hidden = 13;
  const at::Tensor ids = repeated_ids(vocab);
  const at::Tensor rows = (at::randn({ids.size(0), hidden}) * 3).to(dtype);
  const at::Tensor dw0 = at::randn({vocab, hidden}).to(dtype);
  at::Tensor dw = dw0.clone();
  tied_embedding_add_rows_(dw, ids, rows);
  EXPECT_TRUE(bitwise_equal(dw, plain_loop_add_rows(dw0, ids, rows)));
  // Rows no token names are untouched (1 and 4 here).
  EXPECT_TRUE(bitwise_equal(dw[4], dw0[4]));
  EXPECT_TRUE(bitwise_equal(dw[1], dw0[1]));
}

TEST_P(AddRowsCpu, RoundsOnceNotPerToken) {
  // 1 + 64 * 2^-9: BF16 (8 bits of mantissa) loses each 2^-9 added one at a time to 1 but
  // not their FP32 sum; FP32 keeps both. The result must be round(1 + 0.125).
  const at::ScalarType dtype = GetParam();
  const at::Tensor ids = at::zeros({64}, at::kLong);
  const at::Tensor rows = at::full({64, 2}, std::ldexp(1.0, -9), at::kDouble).to(dtype);
  at::Tensor dw = at::ones({1, 2}, at::kDouble).to(dtype);
  tied_embedding_add_rows_(dw, ids, rows);
  EXPECT_TRUE(bitwise_equal(dw, at::full({1, 2}, 1.125, at::kDouble).to(dtype)));
}

TEST_P(AddRowsCpu, SkipsIdsOutsideTheVocabulary) {
  const at::ScalarType dtype = GetParam();
  const at::Tensor ids = at::tensor(std::vector<int64_t>{-1, 1, 4, 1, 100}, at::kLong);
  const at::Tensor rows = at::ones({5, 3}, at::kDouble).to(dtype);
  at::Tensor dw = at::zeros({4, 3}, at::kDouble).to(dtype);
  tied_embedding_add_rows_(dw, ids, rows);
  at::Tensor expected = at::zeros({4, 3}, at::kDouble);
  expected[1].fill_(2.0);
  EXPECT_TRUE(bitwise_equal(dw, expected.to(dtype)));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, AddRowsCpu,
                         ::testing::Values(at::kFloat, at::kBFloat16, at::kHalf, at::kDouble));

struct Chain {
  at::Tensor ids, weight, probe;
};

Chain make_chain(at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t vocab = 11, hidden = 6;
  Chain c;
  c.ids =
      at::tensor(std::vector<int64_t>{3, 0, 10, 3, 5, 3, 0, 3, 7, 3}, at::kLong).reshape({2, 5});
  c.weight = at::randn({vocab, hidden}).to(dtype);
  c.probe = at::randn({2, 5, vocab}).to(dtype);
  return c;
}

TEST(TiedEmbeddingChainCpu, MatchesTheCompositeInFp64) {
  const Chain c = make_chain(at::kDouble, 1);
  const TiedChainResult fused = run_tied_chain(true, c.ids, c.weight, c.probe);
  const TiedChainResult composite = run_tied_chain(false, c.ids, c.weight, c.probe);
  EXPECT_TRUE(bitwise_equal(fused.logits, composite.logits));
  EXPECT_TRUE(bitwise_equal(fused.grad_hidden, composite.grad_hidden));
  EXPECT_TRUE(bitwise_equal(fused.grad_h, composite.grad_h));
  // Only the summation order of the embedding rows (and one rounding fewer) differs.
  EXPECT_TRUE(at::allclose(fused.grad_weight, composite.grad_weight, 1e-13, 1e-13))
      << (fused.grad_weight - composite.grad_weight).abs().max().item<double>();
}

class TiedEmbeddingChainDtypes : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(TiedEmbeddingChainDtypes, ForwardAndHiddenGradientAreTheCompositesBits) {
  const Chain c = make_chain(GetParam(), 2);
  const TiedChainResult fused = run_tied_chain(true, c.ids, c.weight, c.probe);
  const TiedChainResult composite = run_tied_chain(false, c.ids, c.weight, c.probe);
  EXPECT_TRUE(bitwise_equal(fused.logits, composite.logits));
  EXPECT_TRUE(bitwise_equal(fused.grad_hidden, composite.grad_hidden));
  EXPECT_TRUE(bitwise_equal(fused.grad_h, composite.grad_h));
}

TEST_P(TiedEmbeddingChainDtypes, WeightGradientIsTheLmHeadsPlusOrderedRowsRoundedOnce) {
  const Chain c = make_chain(GetParam(), 3);
  const TiedChainResult fused = run_tied_chain(true, c.ids, c.weight, c.probe);
  EXPECT_TRUE(bitwise_equal(fused.grad_weight,
                            expected_fused_grad_weight(c.ids, c.weight, c.probe, fused)));
  // Against the composite: the composite rounds the embedding sum once more (and sums in
  // its own order), so FP32 agrees to rounding, BF16 to a few of its ulps.
  const TiedChainResult composite = run_tied_chain(false, c.ids, c.weight, c.probe);
  const bool bf16 = GetParam() == at::kBFloat16;
  EXPECT_TRUE(at::allclose(fused.grad_weight.to(at::kDouble), composite.grad_weight.to(at::kDouble),
                           bf16 ? 3e-2 : 1e-5, bf16 ? 3e-2 : 1e-5));
}

// The bitwise check above only proves the single-gradient path if the two-gradient path
// (the LM head's dW returned to autograd, which adds the embedding's rounded sum) would
// give other bits: it does in BF16 for this chain.
TEST(TiedEmbeddingChainCpu, Bf16SingleGradientDiffersFromAutogradsSumOfTwo) {
  const Chain c = make_chain(at::kBFloat16, 3);
  const TiedChainResult fused = run_tied_chain(true, c.ids, c.weight, c.probe);
  const int64_t n = c.ids.numel(), hidden = c.weight.size(1), vocab = c.weight.size(0);
  const at::Tensor h = at::embedding(c.weight, c.ids);
  const at::Tensor hid = h + at::silu(h) * 0.5;
  const at::Tensor dw_lm = c.probe.reshape({n, vocab}).t().mm(hid.reshape({n, hidden}));
  at::Tensor embedding_grad = at::zeros_like(dw_lm);
  tied_embedding_add_rows_(embedding_grad, c.ids.reshape({-1}), fused.grad_h.reshape({n, hidden}));
  EXPECT_FALSE(bitwise_equal(fused.grad_weight, dw_lm + embedding_grad));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TiedEmbeddingChainDtypes,
                         ::testing::Values(at::kFloat, at::kBFloat16));

TEST(TiedEmbeddingLookupCpu, IsAtEmbeddingsBitsFor1dAnd3dIds) {
  at::manual_seed(4);
  const at::Tensor w = at::randn({7, 5}).to(at::kBFloat16);
  for (const at::Tensor& ids : {at::tensor(std::vector<int64_t>{6, 0, 3, 3}, at::kLong),
                                at::randint(0, 7, {2, 3, 4}, at::kLong)}) {
    const at::Tensor h = tied_embedding_lookup(ids, w, make_tied_embedding_state());
    EXPECT_TRUE(bitwise_equal(h, at::embedding(w, ids)));
  }
}

// The LM head's backward never runs (the loss does not reach it): the lookup allocates
// the zero gradient itself.
TEST(TiedEmbeddingPathsCpu, LookupAloneGivesTheEmbeddingGradient) {
  const Chain c = make_chain(at::kDouble, 5);
  const at::Tensor probe_h = at::randn({2, 5, 6}, at::kDouble);
  at::Tensor w = c.weight.clone().requires_grad_(true);
  const TiedEmbeddingStatePtr state = make_tied_embedding_state();
  const at::Tensor h = tied_embedding_lookup(c.ids, w, state);
  const at::Tensor unused_logits = tied_lm_head(h, w, state);
  (h * probe_h).sum().backward();
  at::Tensor w_ref = c.weight.clone().requires_grad_(true);
  (at::embedding(w_ref, c.ids) * probe_h).sum().backward();
  EXPECT_TRUE(at::allclose(w.grad(), w_ref.grad(), 1e-14, 1e-14));
}

// The LM head's input does not come from the lookup, so autograd may run either backward
// first: W still gets the sum of both gradients.
TEST(TiedEmbeddingPathsCpu, LmHeadOnAnIndependentInputStillAddsBothGradients) {
  const Chain c = make_chain(at::kDouble, 6);
  const at::Tensor other_in = at::randn({2, 5, 6}, at::kDouble);
  const at::Tensor probe_h = at::randn({2, 5, 6}, at::kDouble);
  at::Tensor w = c.weight.clone().requires_grad_(true);
  const TiedEmbeddingStatePtr state = make_tied_embedding_state();
  const at::Tensor h = tied_embedding_lookup(c.ids, w, state);
  const at::Tensor logits = tied_lm_head(other_in, w, state);
  ((logits * c.probe).sum() + (h * probe_h).sum()).backward();
  at::Tensor w_ref = c.weight.clone().requires_grad_(true);
  ((other_in.matmul(w_ref.t()) * c.probe).sum() + (at::embedding(w_ref, c.ids) * probe_h).sum())
      .backward();
  EXPECT_TRUE(at::allclose(w.grad(), w_ref.grad(), 1e-13, 1e-13));
}

// The lookup is not in the backward's graph at all: the LM head returns its dW itself
// (the composite's bits: the same mm).
TEST(TiedEmbeddingPathsCpu, LmHeadWithoutTheLookupInTheGraphKeepsItsGradient) {
  const Chain c = make_chain(at::kFloat, 7);
  const at::Tensor other_in = at::randn({2, 5, 6});
  at::Tensor w = c.weight.clone().requires_grad_(true);
  const TiedEmbeddingStatePtr state = make_tied_embedding_state();
  const at::Tensor unused_h = tied_embedding_lookup(c.ids, w, state);
  (tied_lm_head(other_in, w, state) * c.probe).sum().backward();
  at::Tensor w_ref = c.weight.clone().requires_grad_(true);
  (other_in.matmul(w_ref.t()) * c.probe).sum().backward();
  EXPECT_TRUE(bitwise_equal(w.grad(), w_ref.grad()));
}

// autograd::grad for the hidden state only (the lookup's node is in the graph but not
// executed), then a full backward: nothing stale is carried over.
TEST(TiedEmbeddingPathsCpu, GradForHiddenOnlyThenBackwardWithRetainedGraph) {
  const Chain c = make_chain(at::kDouble, 8);
  at::Tensor w = c.weight.clone().requires_grad_(true);
  const TiedEmbeddingStatePtr state = make_tied_embedding_state();
  const at::Tensor h = tied_embedding_lookup(c.ids, w, state);
  const at::Tensor hidden = h + at::silu(h) * 0.5;
  const at::Tensor loss = (tied_lm_head(hidden, w, state) * c.probe).sum();
  const at::Tensor d_hidden = torch::autograd::grad({loss}, {hidden}, {}, /*retain_graph=*/true)[0];
  loss.backward({}, /*retain_graph=*/true);
  loss.backward();
  at::Tensor w_ref = c.weight.clone().requires_grad_(true);
  const at::Tensor h_ref = at::embedding(w_ref, c.ids);
  const at::Tensor hidden_ref = h_ref + at::silu(h_ref) * 0.5;
  const at::Tensor loss_ref = (hidden_ref.matmul(w_ref.t()) * c.probe).sum();
  const at::Tensor d_hidden_ref =
      torch::autograd::grad({loss_ref}, {hidden_ref}, {}, /*retain_graph=*/true)[0];
  loss_ref.backward({}, /*retain_graph=*/true);
  loss_ref.backward();
  EXPECT_TRUE(bitwise_equal(d_hidden, d_hidden_ref));
  EXPECT_TRUE(at::allclose(w.grad(), w_ref.grad(), 1e-13, 1e-13));
}

// autograd::grad for W (exec_info names the nodes that lead to W): the single-gradient
// path still runs and gives backward()'s bits.
TEST(TiedEmbeddingPathsCpu, AutogradGradForTheWeightGivesBackwardsBits) {
  const Chain c = make_chain(at::kBFloat16, 10);
  const TiedChainResult reference = run_tied_chain(true, c.ids, c.weight, c.probe);
  at::Tensor w = c.weight.clone().requires_grad_(true);
  const TiedEmbeddingStatePtr state = make_tied_embedding_state();
  const at::Tensor h = tied_embedding_lookup(c.ids, w, state);
  const at::Tensor logits = tied_lm_head(h + at::silu(h) * 0.5, w, state);
  const at::Tensor grad_w = torch::autograd::grad({logits}, {w}, {c.probe})[0];
  EXPECT_TRUE(bitwise_equal(grad_w, reference.grad_weight));
}

// W frozen: nothing is stashed, no W gradient, other gradients as in the composite.
TEST(TiedEmbeddingPathsCpu, FrozenWeightGetsNoGradient) {
  const Chain c = make_chain(at::kFloat, 9);
  at::Tensor scale = at::full({6}, 1.5).requires_grad_(true);
  const TiedEmbeddingStatePtr state = make_tied_embedding_state();
  const at::Tensor h = tied_embedding_lookup(c.ids, c.weight, state);
  (tied_lm_head(h * scale, c.weight, state) * c.probe).sum().backward();
  at::Tensor scale_ref = at::full({6}, 1.5).requires_grad_(true);
  ((at::embedding(c.weight, c.ids) * scale_ref).matmul(c.weight.t()) * c.probe).sum().backward();
  EXPECT_FALSE(c.weight.grad().defined());
  EXPECT_TRUE(bitwise_equal(scale.grad(), scale_ref.grad()));
}

TEST(TiedEmbeddingSwitch, ParsesFusedCompositeAndRefusesAnythingElse) {
  {
    const PolicyForTest unset("GDR_TIED_EMBEDDING", "");
    EXPECT_EQ(current_execution_policy().tied_embedding, TiedEmbeddingImpl::kFused);
  }
  {
    const PolicyForTest composite("GDR_TIED_EMBEDDING", "composite");
    EXPECT_EQ(current_execution_policy().tied_embedding, TiedEmbeddingImpl::kComposite);
    EXPECT_FALSE(tied_embedding_fusable(at::zeros({3, 2})));
  }
  {
    const PolicyForTest fused("GDR_TIED_EMBEDDING", "fused");
    EXPECT_EQ(current_execution_policy().tied_embedding, TiedEmbeddingImpl::kFused);
    EXPECT_TRUE(tied_embedding_fusable(at::zeros({3, 2}, at::kBFloat16)));
    EXPECT_FALSE(tied_embedding_fusable(at::zeros({3, 2}, at::kLong)));
  }
  EXPECT_EQ(test_support::policy_error("GDR_TIED_EMBEDDING", "dense"),
            "GDR_TIED_EMBEDDING: expected fused or composite, but got 'dense'");
}

TEST(TiedEmbeddingChecks, ErrorMessagesNameTheArgument) {
  const at::Tensor w = at::zeros({4, 3});
  const at::Tensor ids = at::zeros({2}, at::kLong);
  const TiedEmbeddingStatePtr s = make_tied_embedding_state();
  EXPECT_EQ(error_of([&] { tied_embedding_lookup(ids.to(at::kInt), w, s); }),
            "tied_embedding_lookup: expected ids of dtype Long, but got Int");
  EXPECT_EQ(error_of([&] { tied_embedding_lookup(ids, at::zeros({4}), s); }),
            "tied_embedding_lookup: expected a 2-D weight [V, H], but got shape [4]");
  EXPECT_EQ(error_of([&] { tied_embedding_lookup(ids, w, nullptr); }),
            "tied_embedding_lookup: state is null; expected make_tied_embedding_state()");
  EXPECT_EQ(error_of([&] { tied_embedding_lookup(ids.to(at::kMeta), w, s); }),
            "tied_embedding_lookup: ids are on meta but weight is on cpu; expected one device");
  EXPECT_EQ(error_of([&] {
              tied_lm_head(at::zeros({2, 3}, at::kDouble), w, s);
            }),
            "tied_lm_head: expected hidden of dtype Float (weight's), but got Double");
  EXPECT_EQ(error_of([&] {
              tied_lm_head(at::zeros({2, 5}), w, s);
            }),
            "tied_lm_head: expected hidden [..., 3] with at least 2 dims, but got shape [2, 5]");
  EXPECT_EQ(error_of([&] {
              tied_lm_head(at::zeros({2, 3}, at::kMeta), w, s);
            }),
            "tied_lm_head: hidden is on meta but weight is on cpu; expected one device");
  EXPECT_EQ(error_of([&] {
              tied_lm_head(at::zeros({2, 3}), at::zeros({4, 3}, at::kInt), s);
            }),
            "tied_lm_head: expected weight of dtype Float, Half, BFloat16 or Double, but got Int");
  at::Tensor dw = at::zeros({4, 3});
  EXPECT_EQ(error_of([&] {
              tied_embedding_add_rows_(dw, ids, at::zeros({2, 3}, at::kDouble));
            }),
            "tied_embedding_add_rows_: expected rows of dtype Float (grad_weight's), but got "
            "Double");
  EXPECT_EQ(error_of([&] {
              tied_embedding_add_rows_(dw, ids, at::zeros({3, 3}));
            }),
            "tied_embedding_add_rows_: expected contiguous rows of shape [2, 3], but got shape "
            "[3, 3] and strides [3, 1]");
  at::Tensor dw_t = at::zeros({3, 4}).t();
  EXPECT_EQ(error_of([&] {
              tied_embedding_add_rows_(dw_t, ids, at::zeros({2, 3}));
            }),
            "tied_embedding_add_rows_: expected a contiguous 2-D grad_weight [V, H], but got "
            "shape [4, 3] and strides [1, 4]");
  EXPECT_EQ(error_of([&] {
              tied_embedding_add_rows_(dw, ids.reshape({1, 2}), at::zeros({2, 3}));
            }),
            "tied_embedding_add_rows_: expected ids [N] of dtype Long, but got shape [1, 2] and "
            "dtype Long");
}

}  // namespace
}  // namespace gdr
