// GPU tests of the fused optimizer tail (tag gpu): the one-pass kernel gives the bits of
// CUDA ATen's sequence (_foreach_mul_ when clipping, _foreach_add_ on FP32 step counters,
// _fused_adamw_, _foreach_copy_ into BF16 params) for tensors of assorted sizes (numel %
// 4 != 0, several chunks, an empty one, 2-D, views at offset 1 that are not 16-byte
// aligned), over consecutive steps, with and without clipping and BF16 params; replays give
// the same bits while other streams load the GPU.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ops/fused_adamw/fused_adamw_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/fused_adamw_reference.h"
#include "tests/ops/gpu_contention.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;

using State = test_support::AdamWState;
using test_support::expect_same;
using test_support::kBeta1;
using test_support::kBeta2;
using test_support::kEps;
using test_support::kLr;
using test_support::kWeightDecay;

// A CUDA tensor of `shape` whose storage starts `offset` elements into a larger one (offset
// 1: 4-byte but not 16-byte aligned), filled from `values` (a CPU tensor of that shape).
at::Tensor place(const at::Tensor& values, int64_t offset, at::ScalarType dtype) {
  const at::Tensor big =
      at::empty({values.numel() + offset}, at::TensorOptions().dtype(dtype).device(at::kCUDA));
  at::Tensor view = big.narrow(0, offset, values.numel()).view(values.sizes());
  view.copy_(values);
  return view;
}

struct Spec {
  std::vector<int64_t> shape;
  // Offset of master, grad, exp_avg, exp_avg_sq, bf16 param (0 or 1).
  int64_t offsets[5];
};

State make_state(uint64_t seed) {
  const std::vector<Spec> specs = {
      {{1}, {0, 0, 0, 0, 0}},      {{3}, {0, 0, 0, 0, 0}},
      {{4}, {0, 0, 0, 0, 0}},      {{5}, {0, 0, 0, 0, 0}},
      {{0}, {0, 0, 0, 0, 0}},      {{1023}, {0, 0, 0, 0, 0}},
      {{4096}, {0, 0, 0, 0, 0}},   {{(1 << 20) + 3}, {0, 0, 0, 0, 0}},
      {{64, 33}, {0, 0, 0, 0, 0}}, {{256, 128}, {0, 0, 0, 0, 0}},
      {{20000}, {1, 1, 1, 1, 1}},  // every pointer misaligned
      {{9000}, {0, 1, 0, 0, 0}},   // only the grad misaligned
      {{8192}, {0, 0, 0, 0, 1}},   // only the BF16 param misaligned
  };
  at::manual_seed(seed);
  State s;
  for (const Spec& spec : specs) {
    const at::Tensor master = at::randn(spec.shape);
    s.masters.push_back(place(master, spec.offsets[0], at::kFloat));
    s.grads.push_back(place(at::randn(spec.shape) * 1e-2, spec.offsets[1], at::kFloat));
    s.exp_avgs.push_back(place(at::randn(spec.shape) * 1e-3, spec.offsets[2], at::kFloat));
    s.exp_avg_sqs.push_back(place(at::rand(spec.shape) * 1e-5, spec.offsets[3], at::kFloat));
    s.bf16_params.push_back(place(master, spec.offsets[4], at::kBFloat16));
  }
  return s;
}

void new_grads(State& s, uint64_t seed) {
  at::manual_seed(seed);
  for (at::Tensor& g : s.grads) g.copy_(at::randn(g.sizes()) * 1e-2);
}

void fused(State& s, int64_t step, double coef, bool bf16) {
  fused_adamw_step_(s.masters, s.grads, s.exp_avgs, s.exp_avg_sqs,
                    bf16 ? s.bf16_params : std::vector<at::Tensor>{}, kLr, kBeta1, kBeta2,
                    kWeightDecay, kEps, step, coef);
}

void expect_same_state(const State& got, const State& want, const std::string& what) {
  expect_same(got.masters, want.masters, what + " masters");
  expect_same(got.grads, want.grads, what + " grads");
  expect_same(got.exp_avgs, want.exp_avgs, what + " exp_avgs");
  expect_same(got.exp_avg_sqs, want.exp_avg_sqs, what + " exp_avg_sqs");
  expect_same(got.bf16_params, want.bf16_params, what + " bf16_params");
}

TEST(FusedAdamWGpu, KernelGivesTheBitsOfTheAtenSequence) {
  for (double coef : {1.0, 0.37}) {
    for (bool bf16 : {true, false}) {
      State ours = make_state(11);
      State ref = ours.clone();
      std::vector<at::Tensor> steps;
      for (size_t i = 0; i < ref.masters.size(); ++i) {
        steps.push_back(at::zeros({}, at::TensorOptions().device(at::kCUDA)));
      }
      for (int64_t step = 1; step <= 3; ++step) {
        new_grads(ours, 100 + step);
        new_grads(ref, 100 + step);
        fused(ours, step, coef, bf16);
        test_support::aten_adamw_sequence(ref, steps, coef, bf16);
        expect_same_state(ours, ref,
                          "coef " + std::to_string(coef) + (bf16 ? " bf16" : " no-bf16") +
                              " step " + std::to_string(step));
      }
    }
  }
}

TEST(FusedAdamWGpu, LaterStepsAndNoWeightDecayGiveTheAtenBits) {
  // Step 1000 (bias corrections near 1) and weight_decay 0 (ATen skips the decay).
  State ours = make_state(5);
  State ref = ours.clone();
  fused_adamw_step_(ours.masters, ours.grads, ours.exp_avgs, ours.exp_avg_sqs, ours.bf16_params,
                    kLr, kBeta1, kBeta2, /*weight_decay=*/0.0, kEps, 1000, 0.5);
  std::vector<at::Tensor> steps;
  for (size_t i = 0; i < ref.masters.size(); ++i) {
    steps.push_back(at::full({}, 1000.0, at::TensorOptions().device(at::kCUDA)));
  }
  {
    const at::NoGradGuard no_grad;
    at::_foreach_mul_(ref.grads, 0.5);
    at::_fused_adamw_(ref.masters, ref.grads, ref.exp_avgs, ref.exp_avg_sqs, {}, steps, kLr, kBeta1,
                      kBeta2, 0.0, kEps, false, false);
    at::_foreach_copy_(ref.bf16_params, ref.masters);
  }
  expect_same_state(ours, ref, "step 1000, no weight decay");
}

TEST(FusedAdamWGpu, ReplaysGiveTheSameBitsUnderContention) {
  // make_state, not clone: clones would be aligned, and the replays should take the
  // misaligned paths too.
  State first = make_state(21);
  fused(first, 2, 0.37, true);
  const test_support::GpuContention contention;
  for (int replay = 0; replay < 50; ++replay) {
    State again = make_state(21);
    fused(again, 2, 0.37, true);
    expect_same_state(again, first, "replay " + std::to_string(replay));
    if (::testing::Test::HasFailure()) break;
  }
}

}  // namespace
}  // namespace gdr
