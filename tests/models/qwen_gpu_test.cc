// GPU tests of the Qwen3.5 model (tag gpu): the real 0.8B text config, forward+backward
// in BF16 at sequence 2048 with both fusion levels (loss finite, the two levels agree
// within BF16 tolerance, peak memory reported), and the tiny config with
// deterministic_mode giving bit-identical gradients on a rerun.
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "models/qwen/config.h"
#include "models/qwen/model.h"
#include "ops/policy/determinism.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

struct Result {
  double loss = 0;
  std::vector<at::Tensor> grads;
};

Result forward_backward(QwenForCausalLM& model, const at::Tensor& ids) {
  model->zero_grad();
  at::Tensor loss = model->loss(ids, ids);
  loss.backward();
  Result r;
  r.loss = loss.item<double>();
  for (const auto& p : model->parameters()) r.grads.push_back(p.grad().detach().clone());
  return r;
}

TEST(QwenGpu, Qwen0p8bForwardBackwardInBf16AgreesBetweenFusionLevels) {
  auto config = load_qwen_config("configs/qwen3_5_0_8b.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  QwenForCausalLM model(*config);
  init_qwen_weights(*model, 1234);
  model->to(at::kCUDA, at::kBFloat16);
  at::manual_seed(5);
  const at::Tensor ids = at::randint(0, config->vocab_size, {1, 2048},
                                     at::TensorOptions().device(at::kCUDA).dtype(at::kLong));

  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  model->set_pre_gdr_fusion(PreGdrFusion::kNone);
  const Result none = forward_backward(model, ids);
  model->set_pre_gdr_fusion(PreGdrFusion::kGate);
  const Result gate = forward_backward(model, ids);
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  const double peak_gib =
      stats.allocated_bytes[static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE)].peak /
      1073741824.0;
  std::printf("0.8B BF16 seq 2048: loss none %.6f gate %.6f; peak allocated %.2f GiB\n", none.loss,
              gate.loss, peak_gib);

  ASSERT_TRUE(std::isfinite(none.loss));
  ASSERT_TRUE(std::isfinite(gate.loss));
  // Random-init loss is about log(vocab) = 12.4.
  EXPECT_NEAR(none.loss, std::log(static_cast<double>(config->vocab_size)), 1.0);
  EXPECT_NEAR(gate.loss, none.loss, 2e-2 * std::abs(none.loss));
  // Gradients: the fusion levels differ only in the gate's rounding points (the fused
  // op keeps FP32 where the composite rounds) so BF16 gradients agree to a few percent.
  double worst = 0;
  std::string worst_name;
  const auto named = model->named_parameters();
  for (size_t i = 0; i < none.grads.size(); ++i) {
    const at::Tensor x = none.grads[i].to(at::kFloat), y = gate.grads[i].to(at::kFloat);
    const double denom = y.norm().item<double>() + 1e-12;
    const double rel = (x - y).norm().item<double>() / denom;
    if (rel > worst) {
      worst = rel;
      worst_name = named[i].key();
    }
  }
  std::printf("worst relative gradient difference none vs gate: %.3e (%s)\n", worst,
              worst_name.c_str());
  EXPECT_LT(worst, 5e-2);
}

TEST(QwenGpu, TinyConfigInDeterministicModeRerunsBitIdentically) {
  auto config = load_qwen_config("configs/tiny.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  config->deterministic_mode = true;
  config->pre_gdr_fusion = PreGdrFusion::kGate;
  ExecutionPolicy policy;
  policy.deterministic = true;
  policy.pre_gdr_fusion = PreGdrFusion::kGate;
  ASSERT_TRUE(apply_deterministic_mode(policy).ok());
  const ExecutionPolicyGuard guard(policy);
  auto run = [&] {
    QwenForCausalLM model(*config);
    init_qwen_weights(*model, 77);
    model->to(at::kCUDA, at::kBFloat16);
    at::manual_seed(3);
    const at::Tensor ids = at::randint(0, config->vocab_size, {4, 256},
                                       at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
    return forward_backward(model, ids);
  };
  const Result first = run();
  const Result second = run();
  EXPECT_EQ(first.loss, second.loss);
  ASSERT_EQ(first.grads.size(), second.grads.size());
  for (size_t i = 0; i < first.grads.size(); ++i) {
    EXPECT_TRUE(at::equal(first.grads[i].view(at::kShort), second.grads[i].view(at::kShort)))
        << "grad " << i;
  }
}

// See Note [Residual add in the norm]: the fused add + norm gives the bits of the add followed
// by the fused norm, so the whole model's loss and every gradient are the same bits with
// GDR_ADD_RMS_NORM=composite (deterministic mode: every other kernel replays bit for bit).
TEST(QwenGpu, ResidualAddInTheNormGivesTheComposedBits) {
  auto config = load_qwen_config("configs/tiny.yaml");
  ASSERT_TRUE(config.ok()) << config.status();
  config->deterministic_mode = true;
  config->pre_gdr_fusion = PreGdrFusion::kGate;
  ExecutionPolicy policy;
  policy.deterministic = true;
  policy.pre_gdr_fusion = PreGdrFusion::kGate;
  ASSERT_TRUE(apply_deterministic_mode(policy).ok());
  auto run = [&](const char* add_rms_norm) {
    test_support::PolicyForTest run_policy;
    run_policy.set("deterministic", "true");
    run_policy.set("GDR_ADD_RMS_NORM", add_rms_norm);
    QwenForCausalLM model(*config);
    init_qwen_weights(*model, 91);
    model->to(at::kCUDA, at::kBFloat16);
    at::manual_seed(4);
    const at::Tensor ids = at::randint(0, config->vocab_size, {2, 256},
                                       at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
    return forward_backward(model, ids);
  };
  const Result composed = run("composite");
  const Result fused = run("fused");
  EXPECT_EQ(composed.loss, fused.loss);
  ASSERT_EQ(composed.grads.size(), fused.grads.size());
  for (size_t i = 0; i < composed.grads.size(); ++i) {
    EXPECT_TRUE(at::equal(composed.grads[i].view(at::kShort), fused.grads[i].view(at::kShort)))
        << "grad " << i;
  }
}

}  // namespace
}  // namespace gdr
