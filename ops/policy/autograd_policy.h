// The forward's execution policy in an autograd Function's backward (Note [Execution
// policy] in ops/policy/execution_policy.h): autograd runs CUDA backwards on its own device
// threads, which have no ExecutionPolicyGuard of their own, so a Function whose backward
// picks kernels saves the forward's policy and restores it:
//   forward:  save_execution_policy(ctx);
//   backward: const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
#pragma once

#include <torch/csrc/autograd/custom_function.h>

#include "ops/policy/execution_policy.h"

namespace gdr {

inline constexpr char kSavedExecutionPolicy[] = "execution_policy";

inline void save_execution_policy(torch::autograd::AutogradContext* ctx) {
  ctx->saved_data[kSavedExecutionPolicy] = current_execution_policy_id();
}

inline ExecutionPolicyGuard restore_execution_policy(torch::autograd::AutogradContext* ctx) {
  return ExecutionPolicyGuard(ctx->saved_data.at(kSavedExecutionPolicy).toInt());
}

}  // namespace gdr
