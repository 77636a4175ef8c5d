// The reference side of the fused AdamW tests (CPU and GPU): the optimizer state lists,
// the ATen sequence the fused op replaces (the trainer's former optimizer tail), and the
// bitwise comparison of tensor lists.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tests/ops/bitwise_equal.h"

namespace gdr::test_support {

constexpr double kLr = 3e-4, kBeta1 = 0.9, kBeta2 = 0.95, kWeightDecay = 0.1, kEps = 1e-8;

struct AdamWState {
  std::vector<at::Tensor> masters, grads, exp_avgs, exp_avg_sqs, bf16_params;

  AdamWState clone() const {
    AdamWState s;
    auto copy = [](const std::vector<at::Tensor>& from, std::vector<at::Tensor>& to) {
      for (const at::Tensor& t : from) to.push_back(t.clone());
    };
    copy(masters, s.masters);
    copy(grads, s.grads);
    copy(exp_avgs, s.exp_avgs);
    copy(exp_avg_sqs, s.exp_avg_sqs);
    copy(bf16_params, s.bf16_params);
    return s;
  }
};

// _foreach_mul_ (when clipping) + _foreach_add_ of the step counters + _fused_adamw_ +
// _foreach_copy_ into the BF16 parameters, on counters holding the previous step.
inline void aten_adamw_sequence(AdamWState& s, std::vector<at::Tensor>& steps, double coef,
                                bool bf16) {
  const at::NoGradGuard no_grad;
  if (coef != 1.0) at::_foreach_mul_(s.grads, coef);
  at::_foreach_add_(steps, 1.0);
  at::_fused_adamw_(s.masters, s.grads, s.exp_avgs, s.exp_avg_sqs, {}, steps, kLr, kBeta1, kBeta2,
                    kWeightDecay, kEps, /*amsgrad=*/false, /*maximize=*/false);
  if (bf16) at::_foreach_copy_(s.bf16_params, s.masters);
}

inline void expect_same(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want,
                        const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(got[i].cpu(), want[i].cpu())) << what << "[" << i << "]";
  }
}

}  // namespace gdr::test_support
