// recompute_in_backward (Note [Recomputation]): the same bits as the plain block for the
// outputs and every gradient, and the block's activations really are dropped.
#include "ops/recompute/recompute_op.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "ops/policy/execution_policy.h"

namespace gdr {
namespace {

at::Tensor leaf(at::Tensor t) { return t.set_requires_grad(true); }

struct Weights {
  at::Tensor w1, w2;
};

Weights make_weights() {
  at::manual_seed(3);
  return {leaf(at::randn({16, 32})), leaf(at::randn({32, 16}))};
}

// Two outputs, an optional second input, and a saved intermediate (`pre`) whose lifetime the
// tests watch.
RecomputedBlock mlp_block(const Weights& w, c10::weak_intrusive_ptr<c10::TensorImpl>* pre_seen,
                          int* calls) {
  return [w, pre_seen, calls](const std::vector<at::Tensor>& in) {
    ++*calls;
    at::Tensor h = in[0];
    if (in[1].defined()) h = h + in[1];
    const at::Tensor pre = at::matmul(h, w.w1);
    if (pre_seen != nullptr && *calls == 1) {
      *pre_seen = c10::weak_intrusive_ptr<c10::TensorImpl>(pre.getIntrusivePtr());
    }
    const at::Tensor out = at::matmul(at::silu(pre), w.w2);
    return std::vector<at::Tensor>{out, out.tanh()};
  };
}

struct Result {
  std::vector<at::Tensor> outputs;
  at::Tensor grad_x, grad_w1, grad_w2;
};

Result run(bool recompute, bool with_residual) {
  const Weights w = make_weights();
  at::manual_seed(5);
  const at::Tensor x = leaf(at::randn({4, 8, 16}));
  const at::Tensor residual = with_residual ? at::randn({4, 8, 16}) : at::Tensor();
  int calls = 0;
  const RecomputedBlock block = mlp_block(w, nullptr, &calls);
  const std::vector<at::Tensor> inputs = {x * 1.5, residual};
  const std::vector<at::Tensor> outputs =
      recompute ? recompute_in_backward(block, inputs) : block(inputs);
  const at::Tensor loss = (outputs[0] * outputs[0]).sum() + outputs[1].mean();
  loss.backward();
  EXPECT_EQ(calls, recompute ? 2 : 1);
  return {outputs, x.grad(), w.w1.grad(), w.w2.grad()};
}

TEST(Recompute, OutputsAndEveryGradientHaveThePlainBlocksBits) {
  for (bool with_residual : {false, true}) {
    const Result plain = run(false, with_residual);
    const Result again = run(true, with_residual);
    ASSERT_EQ(again.outputs.size(), 2u);
    for (size_t i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(plain.outputs[i], again.outputs[i]));
    EXPECT_TRUE(at::equal(plain.grad_x, again.grad_x)) << with_residual;
    EXPECT_TRUE(at::equal(plain.grad_w1, again.grad_w1)) << with_residual;
    EXPECT_TRUE(at::equal(plain.grad_w2, again.grad_w2)) << with_residual;
  }
}

TEST(Recompute, AnUnusedOutputGetsNoGradientAndTheRestStillFlows) {
  const Weights w = make_weights();
  const at::Tensor x = leaf(at::randn({2, 3, 16}));
  int calls = 0;
  const std::vector<at::Tensor> out =
      recompute_in_backward(mlp_block(w, nullptr, &calls), {x, at::Tensor()});
  out[1].sum().backward();  // out[0] unused
  ASSERT_TRUE(x.grad().defined());
  ASSERT_TRUE(w.w1.grad().defined());
  const at::Tensor expected_x_grad = x.grad().clone();
  x.mutable_grad().reset();
  w.w1.mutable_grad().reset();
  mlp_block(w, nullptr, &calls)({x, at::Tensor()})[1].sum().backward();
  EXPECT_TRUE(at::equal(x.grad(), expected_x_grad));
}

TEST(Recompute, TheBlocksActivationsAreDroppedAfterTheForward) {
  const Weights w = make_weights();
  const at::Tensor x = leaf(at::randn({4, 8, 16}));
  for (bool recompute : {false, true}) {
    c10::weak_intrusive_ptr<c10::TensorImpl> pre(c10::intrusive_ptr<c10::TensorImpl>{});
    int calls = 0;
    const RecomputedBlock block = mlp_block(w, &pre, &calls);
    const std::vector<at::Tensor> out =
        recompute ? recompute_in_backward(block, {x, at::Tensor()}) : block({x, at::Tensor()});
    // silu's backward saves its input `pre` in the plain block's graph; the recomputing
    // block keeps only its inputs and outputs.
    EXPECT_EQ(pre.expired(), recompute) << recompute;
    out[0].sum().backward();
  }
}

TEST(Recompute, WithoutGradModeItIsThePlainBlock) {
  const Weights w = make_weights();
  const at::Tensor x = leaf(at::randn({2, 3, 16}));
  int calls = 0;
  c10::NoGradGuard no_grad;
  const std::vector<at::Tensor> out =
      recompute_in_backward(mlp_block(w, nullptr, &calls), {x, at::Tensor()});
  EXPECT_EQ(calls, 1);
  EXPECT_FALSE(out[0].requires_grad());
}

TEST(Recompute, TheBackwardRunsUnderTheForwardsExecutionPolicy) {
  const Weights w = make_weights();
  const at::Tensor x = leaf(at::randn({2, 3, 16}));
  ExecutionPolicy forward_policy;
  forward_policy.rms_norm = RmsNormImpl::kComposite;
  std::vector<RmsNormImpl> seen;
  const RecomputedBlock block = [&](const std::vector<at::Tensor>& in) {
    seen.push_back(current_execution_policy().rms_norm);
    return std::vector<at::Tensor>{at::matmul(in[0], w.w1)};
  };
  std::vector<at::Tensor> out;
  {
    const ExecutionPolicyGuard guard(forward_policy);
    out = recompute_in_backward(block, {x});
  }
  ASSERT_NE(current_execution_policy().rms_norm, RmsNormImpl::kComposite);
  out[0].sum().backward();
  EXPECT_EQ(seen, (std::vector<RmsNormImpl>{RmsNormImpl::kComposite, RmsNormImpl::kComposite}));
}

}  // namespace
}  // namespace gdr
