// apply_deterministic_mode(policy): the global ATen switch, the cuBLAS workspace variable
// left alone, the uninitialized-memory fill from the policy, and the conflict error. Each test
// resets the process state it touches.
#include "ops/policy/determinism.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdlib>
#include <string>

#include "models/qwen/config.h"
#include "models/qwen/model.h"
#include "ops/policy/execution_policy.h"

namespace gdr {
namespace {

class DeterministicMode : public ::testing::Test {
 protected:
  void SetUp() override {
    unsetenv(kCublasWorkspaceConfigVar);
    unsetenv("GDR_DETERMINISTIC");
    at::globalContext().setDeterministicAlgorithms(false, false);
    at::globalContext().setDeterministicFillUninitializedMemory(true);  // PyTorch's default
    policy_.deterministic = true;
  }
  void TearDown() override { at::globalContext().setDeterministicAlgorithms(false, false); }

  static std::string cublas_var() {
    const char* value = std::getenv(kCublasWorkspaceConfigVar);
    return value == nullptr ? "<unset>" : value;
  }

  ExecutionPolicy policy_;
};

// See Note [cuBLAS workspace]: the variable is not pinned (it slows cuBLAS down and libtorch's
// per-stream workspaces already make it reproducible).
TEST_F(DeterministicMode, TurnsOnTheGlobalSwitchAndLeavesTheCublasWorkspaceAlone) {
  ASSERT_TRUE(apply_deterministic_mode(policy_).ok());
  EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
  EXPECT_FALSE(at::globalContext().deterministicAlgorithmsWarnOnly());
  EXPECT_EQ(cublas_var(), "<unset>");
  EXPECT_TRUE(use_deterministic_mode());  // gdr's ops follow the global switch
}

// See Note [Uninitialized-memory fill]: off by default, on when asked.
TEST_F(DeterministicMode, TurnsOffTheUninitializedMemoryFillUnlessAskedFor) {
  ASSERT_TRUE(apply_deterministic_mode(policy_).ok());
  EXPECT_FALSE(at::globalContext().deterministicFillUninitializedMemory());
  policy_.deterministic_fill_uninitialized_memory = true;
  ASSERT_TRUE(apply_deterministic_mode(policy_).ok());
  EXPECT_TRUE(at::globalContext().deterministicFillUninitializedMemory());
  // An empty tensor is then NaN-filled, as PyTorch documents.
  EXPECT_TRUE(at::empty({4}, at::kFloat).isnan().all().item<bool>());
}

TEST_F(DeterministicMode, KeepsAWorkspaceValueTheUserExported) {
  for (const char* value : {":16:8", ":4096:2:16:8"}) {
    setenv(kCublasWorkspaceConfigVar, value, 1);
    ASSERT_TRUE(apply_deterministic_mode(policy_).ok()) << value;
    EXPECT_EQ(cublas_var(), value);
    EXPECT_TRUE(at::globalContext().deterministicAlgorithms());
  }
}

TEST_F(DeterministicMode, RejectsFullFusionNamingBothKeysAndChangesNothing) {
  policy_.pre_gdr_fusion = PreGdrFusion::kFull;
  const absl::Status status = apply_deterministic_mode(policy_);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(),
            "deterministic_mode: true cannot be combined with pre_gdr_fusion: full (the fully "
            "fused pre-GDR path has no ordered, bit-reproducible backward); use pre_gdr_fusion: "
            "gate or none");
  EXPECT_FALSE(at::globalContext().deterministicAlgorithms());
  EXPECT_EQ(cublas_var(), "<unset>");
}

TEST_F(DeterministicMode, DoesNothingWhenTheConfigLeavesItOff) {
  policy_.deterministic = false;
  ASSERT_TRUE(apply_deterministic_mode(policy_).ok());
  EXPECT_FALSE(at::globalContext().deterministicAlgorithms());
  EXPECT_EQ(cublas_var(), "<unset>");
}

// No op of the model lacks a deterministic CPU path (ATen would throw), and two runs give
// bit-identical loss and gradients.
TEST_F(DeterministicMode, TheTinyModelRunsTwiceBitIdenticallyUnderIt) {
  absl::StatusOr<QwenConfig> tiny = load_qwen_config("configs/tiny.yaml");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  tiny->deterministic_mode = true;
  policy_.pre_gdr_fusion = tiny->pre_gdr_fusion;
  ASSERT_TRUE(apply_deterministic_mode(policy_).ok());
  const at::Tensor ids = at::arange(2 * 70, at::kLong).remainder(251).reshape({2, 70});
  auto run = [&] {
    QwenForCausalLM model(*tiny);
    init_qwen_weights(*model, 11);
    const at::Tensor loss = model->loss(ids, ids);
    std::vector<at::Tensor> out = torch::autograd::grad({loss}, model->parameters());
    out.push_back(loss.detach());
    return out;
  };
  const std::vector<at::Tensor> first = run(), second = run();
  ASSERT_EQ(first.size(), second.size());
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(at::equal(first[i], second[i])) << i;
}

}  // namespace
}  // namespace gdr
