// The causal attention op on CPU: the reference forward and backward against ATen's
// scaled_dot_product_attention and its autograd (FP64, grouped-query heads), the op's CPU
// dispatch, the backend choice, and the argument checks' exact messages.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <tuple>

#include "ops/attention/attention_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::error_of;
using test_support::PolicyForTest;

struct Inputs {
  at::Tensor q, k, v;
};

Inputs make_inputs(int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D, at::ScalarType t,
                   uint64_t seed) {
  at::manual_seed(seed);
  const auto o = at::TensorOptions().dtype(t);
  return {at::randn({B, Hq, T, D}, o), at::randn({B, Hkv, T, D}, o), at::randn({B, Hkv, T, D}, o)};
}

double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

TEST(CausalAttentionReference, ForwardMatchesAtenSdpaWithGroupedHeads) {
  for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{4, 2}, {3, 3}, {6, 1}}) {
    const Inputs in = make_inputs(2, Hq, Hkv, 9, 8, at::kDouble, 11);
    const double scale = 0.37;
    auto [out, logsumexp] = causal_attention_reference_forward(in.q, in.k, in.v, scale);
    const at::Tensor expected = at::scaled_dot_product_attention(
        in.q, in.k, in.v, {}, 0.0, /*is_causal=*/true, scale, /*enable_gqa=*/true);
    EXPECT_EQ(out.scalar_type(), at::kDouble);
    EXPECT_LT(max_abs_diff(out, expected), 1e-12) << Hq << "/" << Hkv;
    // Row 0 sees key 0 only: its log-sum-exp is that one score.
    const at::Tensor k0 = in.k.select(2, 0).repeat_interleave(Hq / Hkv, 1);  // [B, Hq, D]
    const at::Tensor score0 = (in.q.select(2, 0) * k0).sum(-1) * scale;
    EXPECT_LT(max_abs_diff(logsumexp.select(2, 0), score0), 1e-12);
    EXPECT_EQ(logsumexp.sizes(), (at::IntArrayRef{2, Hq, 9}));
  }
}

TEST(CausalAttentionReference, BackwardMatchesAutogradOfAtenSdpa) {
  for (auto [Hq, Hkv] : {std::pair<int64_t, int64_t>{4, 2}, {2, 2}, {4, 1}}) {
    const Inputs in = make_inputs(2, Hq, Hkv, 7, 16, at::kDouble, 12);
    const double scale = 1.0 / std::sqrt(16.0);
    const at::Tensor q = in.q.clone().requires_grad_(true);
    const at::Tensor k = in.k.clone().requires_grad_(true);
    const at::Tensor v = in.v.clone().requires_grad_(true);
    const at::Tensor expected_out =
        at::scaled_dot_product_attention(q, k, v, {}, 0.0, true, scale, true);
    const at::Tensor grad_out = at::randn_like(expected_out);
    expected_out.backward(grad_out);

    auto [out, logsumexp] = causal_attention_reference_forward(in.q, in.k, in.v, scale);
    auto [grad_q, grad_k, grad_v] =
        causal_attention_reference_backward(grad_out, in.q, in.k, in.v, out, logsumexp, scale);
    EXPECT_LT(max_abs_diff(grad_q, q.grad()), 1e-11) << Hq << "/" << Hkv;
    EXPECT_LT(max_abs_diff(grad_k, k.grad()), 1e-11) << Hq << "/" << Hkv;
    EXPECT_LT(max_abs_diff(grad_v, v.grad()), 1e-11) << Hq << "/" << Hkv;
    EXPECT_EQ(grad_k.sizes(), in.k.sizes());
  }
}

TEST(CausalAttentionReference, LowPrecisionInputsUseFloatMathAndKeepTheirDtype) {
  const Inputs in = make_inputs(1, 2, 1, 5, 8, at::kBFloat16, 13);
  auto [out, logsumexp] = causal_attention_reference_forward(in.q, in.k, in.v, 0.5);
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
  EXPECT_EQ(logsumexp.scalar_type(), at::kFloat);
  auto [expected, expected_lse] = causal_attention_reference_forward(
      in.q.to(at::kFloat), in.k.to(at::kFloat), in.v.to(at::kFloat), 0.5);
  EXPECT_TRUE(bitwise_equal(out, expected.to(at::kBFloat16)));
  EXPECT_TRUE(bitwise_equal(logsumexp, expected_lse));
}

TEST(CausalAttentionOp, CpuDispatchIsTheReference) {
  const Inputs in = make_inputs(1, 4, 2, 6, 8, at::kFloat, 14);
  const auto forward = c10::Dispatcher::singleton()
                           .findSchemaOrThrow("gdr::causal_attention_forward", "")
                           .typed<std::tuple<at::Tensor, at::Tensor>(
                               const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  auto [out, logsumexp] = forward.call(in.q, in.k, in.v, 0.25);
  auto [expected, expected_lse] = causal_attention_reference_forward(in.q, in.k, in.v, 0.25);
  EXPECT_TRUE(bitwise_equal(out, expected));
  EXPECT_TRUE(bitwise_equal(logsumexp, expected_lse));
}

TEST(CausalAttention, CpuTensorsTakeAtenSdpa) {
  const Inputs in = make_inputs(1, 4, 2, 6, 8, at::kFloat, 15);
  std::string why;
  EXPECT_EQ(attention_backend(in.q, in.k, in.v, 0.3, &why), AttentionBackend::kAten);
  EXPECT_EQ(why, "the tensors are not on a CUDA device");
  {
    const PolicyForTest aten("GDR_ATTENTION", "aten");
    EXPECT_EQ(attention_backend(in.q, in.k, in.v, 0.3, &why), AttentionBackend::kAten);
    EXPECT_EQ(why, "the attention implementation is aten");
  }
  EXPECT_TRUE(
      bitwise_equal(causal_attention(in.q, in.k, in.v, 0.3),
                    at::scaled_dot_product_attention(in.q, in.k, in.v, {}, 0.0, true, 0.3, true)));
}

TEST(CausalAttention, RefusesAnUnknownSwitchValue) {
  EXPECT_EQ(test_support::policy_error("GDR_ATTENTION", "flash"),
            "GDR_ATTENTION: expected cudnn or aten, but got 'flash'");
}

TEST(CausalAttentionChecks, ExactMessages) {
  const Inputs in = make_inputs(1, 4, 2, 6, 8, at::kFloat, 17);
  auto forward_error = [](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          double scale) {
    return error_of([&] { causal_attention_reference_forward(q, k, v, scale); });
  };
  EXPECT_EQ(forward_error(in.q[0], in.k, in.v, 0.5),
            "causal_attention_forward: expected q of rank 4 ([B, heads, T, D]), but got shape "
            "[4, 6, 8]");
  EXPECT_EQ(forward_error(in.q, in.k.to(at::kDouble), in.v, 0.5),
            "causal_attention_forward: expected k of dtype Float (q's), but got Double");
  EXPECT_EQ(forward_error(in.q, in.k.to(at::kInt), in.v, 0.5),
            "causal_attention_forward: expected k of dtype BFloat16, Half, Float or Double, but "
            "got Int");
  EXPECT_EQ(forward_error(in.q, in.k, in.v.narrow(2, 0, 5), 0.5),
            "causal_attention_forward: expected v of shape [1, 2, 6, 8] (k's), but got "
            "[1, 2, 5, 8]");
  EXPECT_EQ(forward_error(in.q, in.k.narrow(2, 0, 5), in.v.narrow(2, 0, 5), 0.5),
            "causal_attention_forward: expected k with sequence length 6 (q's; causal "
            "self-attention), but got 5");
  EXPECT_EQ(forward_error(in.q, in.k.narrow(3, 0, 4), in.v.narrow(3, 0, 4), 0.5),
            "causal_attention_forward: expected k with head_dim 8 (q's), but got 4");
  const Inputs three_heads = make_inputs(1, 4, 3, 6, 8, at::kFloat, 18);
  EXPECT_EQ(forward_error(three_heads.q, three_heads.k, three_heads.v, 0.5),
            "causal_attention_forward: expected q's head count to be a multiple of k's "
            "(grouped-query attention), but got 4 query heads and 3 key heads");
  EXPECT_EQ(forward_error(in.q, in.k, in.v, 0.0),
            "causal_attention_forward: expected a positive finite scale, but got 0");

  auto [out, logsumexp] = causal_attention_reference_forward(in.q, in.k, in.v, 0.5);
  EXPECT_EQ(error_of([&] {
              causal_attention_reference_backward(out, in.q, in.k, in.v, out,
                                                  logsumexp.to(at::kDouble), 0.5);
            }),
            "causal_attention_backward: expected logsumexp of dtype Float, but got Double");
  EXPECT_EQ(error_of([&] {
              causal_attention_reference_backward(out[0], in.q, in.k, in.v, out, logsumexp, 0.5);
            }),
            "causal_attention_backward: expected grad_out of shape [1, 4, 6, 8] (q's), but got "
            "[4, 6, 8]");
  EXPECT_EQ(error_of([&] {
              causal_attention_reference_backward(out, in.q, in.k, in.v, out,
                                                  logsumexp.unsqueeze(-1), 0.5);
            }),
            "causal_attention_backward: expected logsumexp of shape [1, 4, 6] ([B, Hq, T]), but "
            "got [1, 4, 6, 1]");
}

}  // namespace
}  // namespace gdr
