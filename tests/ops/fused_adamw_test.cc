// CPU tests of the fused optimizer tail (ops/fused_adamw/fused_adamw_op.h): the CPU implementation
// gives the bits of the ATen sequence the trainer ran before it (_foreach_mul_ when clipping,
// _foreach_add_ on FP32 step counters, _fused_adamw_, _foreach_copy_ into BF16 params)
// over several steps, with and without clipping and BF16 params; argument errors (exact
// messages naming the list and index).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/fused_adamw/fused_adamw.h"
#include "ops/fused_adamw/fused_adamw_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"
#include "tests/ops/fused_adamw_reference.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::error_of;

using State = test_support::AdamWState;
using test_support::expect_same;
using test_support::kBeta1;
using test_support::kBeta2;
using test_support::kEps;
using test_support::kLr;
using test_support::kWeightDecay;

State make_state(uint64_t seed) {
  at::manual_seed(seed);
  const std::vector<std::vector<int64_t>> shapes = {{1}, {3}, {4}, {5}, {1023}, {64, 33}};
  State s;
  for (const auto& shape : shapes) {
    s.masters.push_back(at::randn(shape));
    s.grads.push_back(at::randn(shape) * 1e-2);
    s.exp_avgs.push_back(at::randn(shape) * 1e-3);
    s.exp_avg_sqs.push_back(at::rand(shape) * 1e-5);
    s.bf16_params.push_back(s.masters.back().to(at::kBFloat16));
  }
  return s;
}

TEST(FusedAdamWKernel, EveryChunkFindsItsTensor) {
  // numel 0, 20000 (3 chunks), 0, 8192 (1), 0, 1 (1), 0.
  const std::vector<int64_t> numels = {0, 20000, 0, 8192, 0, 1, 0};
  std::vector<int64_t> begin = {0};
  for (int64_t n : numels) begin.push_back(begin.back() + kernels::fused_adamw_chunks(n));
  ASSERT_EQ(begin.back(), 5);
  const int count = static_cast<int>(numels.size());
  std::string owners;
  for (int64_t chunk = 0; chunk < begin.back(); ++chunk) {
    owners += std::to_string(kernels::fused_adamw_tensor_of(begin.data(), count, chunk)) + " ";
  }
  EXPECT_EQ(owners, "1 1 1 3 5 ");
  const int64_t one[] = {0, 1};
  EXPECT_EQ(kernels::fused_adamw_tensor_of(one, 1, 0), 0);
}

TEST(FusedAdamW, CpuGivesTheBitsOfTheAtenSequence) {
  for (double coef : {1.0, 0.37}) {
    for (bool bf16 : {true, false}) {
      State ours = make_state(7);
      State ref = ours.clone();
      std::vector<at::Tensor> steps;
      for (size_t i = 0; i < ref.masters.size(); ++i) steps.push_back(at::zeros({}));
      for (int64_t step = 1; step <= 3; ++step) {
        // Fresh gradients each step (the optimizer consumes them).
        at::manual_seed(100 + step);
        for (size_t i = 0; i < ours.grads.size(); ++i) {
          ours.grads[i].copy_(at::randn(ours.grads[i].sizes()) * 1e-2);
          ref.grads[i].copy_(ours.grads[i]);
        }
        fused_adamw_step_(ours.masters, ours.grads, ours.exp_avgs, ours.exp_avg_sqs,
                          bf16 ? ours.bf16_params : std::vector<at::Tensor>{}, kLr, kBeta1, kBeta2,
                          kWeightDecay, kEps, step, coef);
        test_support::aten_adamw_sequence(ref, steps, coef, bf16);
        const std::string what = "coef " + std::to_string(coef) + (bf16 ? " bf16" : "") + " step " +
                                 std::to_string(step) + " ";
        expect_same(ours.masters, ref.masters, what + "masters");
        expect_same(ours.grads, ref.grads, what + "grads");
        expect_same(ours.exp_avgs, ref.exp_avgs, what + "exp_avgs");
        expect_same(ours.exp_avg_sqs, ref.exp_avg_sqs, what + "exp_avg_sqs");
        expect_same(ours.bf16_params, ref.bf16_params, what + "bf16_params");
      }
    }
  }
}

TEST(FusedAdamW, ClipsTheGradientsInPlaceOnlyWhenCoefIsNotOne) {
  State s = make_state(3);
  const at::Tensor before = s.grads[4].clone();
  fused_adamw_step_(s.masters, s.grads, s.exp_avgs, s.exp_avg_sqs, {}, kLr, kBeta1, kBeta2,
                    kWeightDecay, kEps, 1, 1.0);
  EXPECT_TRUE(bitwise_equal(s.grads[4], before));
  fused_adamw_step_(s.masters, s.grads, s.exp_avgs, s.exp_avg_sqs, {}, kLr, kBeta1, kBeta2,
                    kWeightDecay, kEps, 2, 0.5);
  EXPECT_TRUE(bitwise_equal(s.grads[4], before * 0.5));
}

TEST(FusedAdamW, EmptyListsAreANoOp) {
  EXPECT_EQ(error_of([] { fused_adamw_step_({}, {}, {}, {}, {}, kLr, 0.9, 0.95, 0, 1e-8, 1, 1); }),
            "(no error)");
}

TEST(FusedAdamW, ErrorsNameTheListAndIndex) {
  const State s = make_state(1);
  auto call = [&](std::vector<at::Tensor> masters, std::vector<at::Tensor> grads,
                  std::vector<at::Tensor> avgs, std::vector<at::Tensor> sqs,
                  std::vector<at::Tensor> bf16, int64_t step = 1) {
    return error_of([&] {
      fused_adamw_step_(masters, grads, avgs, sqs, bf16, kLr, kBeta1, kBeta2, kWeightDecay, kEps,
                        step, 1.0);
    });
  };
  const auto& m = s.masters;
  const auto& g = s.grads;
  const auto& a = s.exp_avgs;
  const auto& q = s.exp_avg_sqs;
  const auto& b = s.bf16_params;
  auto drop_last = [](std::vector<at::Tensor> v) {
    v.pop_back();
    return v;
  };
  auto with = [](std::vector<at::Tensor> v, size_t i, at::Tensor t) {
    v[i] = std::move(t);
    return v;
  };
  EXPECT_EQ(call(m, drop_last(g), a, q, b),
            "fused_adamw_step_: expected 6 grads (one per master) but got 5");
  EXPECT_EQ(call(m, g, drop_last(a), q, b),
            "fused_adamw_step_: expected 6 exp_avgs (one per master) but got 5");
  EXPECT_EQ(call(m, g, a, drop_last(q), b),
            "fused_adamw_step_: expected 6 exp_avg_sqs (one per master) but got 5");
  EXPECT_EQ(call(m, g, a, q, drop_last(b)),
            "fused_adamw_step_: expected bf16_params empty or 6 tensors (one per master) but got "
            "5");
  EXPECT_EQ(call({}, g, a, q, {}),
            "fused_adamw_step_: expected 0 grads (one per master) but got 6");
  EXPECT_EQ(call(m, g, a, q, b, 0), "fused_adamw_step_: expected step >= 1 but got 0");
  EXPECT_EQ(call(with(m, 2, m[2].to(at::kHalf)), g, a, q, b),
            "fused_adamw_step_: expected masters[2] of dtype Float but got Half");
  EXPECT_EQ(call(m, with(g, 3, g[3].to(at::kDouble)), a, q, b),
            "fused_adamw_step_: expected grads[3] of dtype Float but got Double");
  EXPECT_EQ(call(m, g, a, q, with(b, 0, b[0].to(at::kFloat))),
            "fused_adamw_step_: expected bf16_params[0] of dtype BFloat16 but got Float");
  EXPECT_EQ(call(m, g, a, with(q, 5, q[5].t()), b),
            "fused_adamw_step_: expected exp_avg_sqs[5] of masters[5]'s shape [64, 33] but got "
            "[33, 64]");
  EXPECT_EQ(call(m, g, with(a, 1, at::Tensor()), q, b),
            "fused_adamw_step_: expected exp_avgs[1] to be a defined tensor");
}

}  // namespace
}  // namespace gdr
