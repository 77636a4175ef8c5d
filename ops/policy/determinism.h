// use_deterministic_mode(): the one switch that sends gdr's ops down their ordered,
// bit-reproducible paths.
//
// Note [Deterministic mode resolution]: the answer is, in order of precedence,
//   1. an in-process override (set_deterministic_mode_override / DeterministicModeGuard),
//   2. the environment variable GDR_DETERMINISTIC (1/true/on or 0/false/off; parsed by
//      deterministic_mode_from_environment in ops/policy/execution_policy.h),
//   3. PyTorch's global switch, at::globalContext().deterministicAlgorithms().
// It is read at every call, so flipping any of them between calls switches paths.
#pragma once

#include <optional>

#include "absl/status/status.h"
#include "ops/policy/execution_policy.h"

namespace gdr {

bool use_deterministic_mode();

void set_deterministic_mode_override(std::optional<bool> value);
std::optional<bool> deterministic_mode_override();

// Sets the override for a scope and restores the previous one.
class DeterministicModeGuard {
 public:
  explicit DeterministicModeGuard(std::optional<bool> value);
  ~DeterministicModeGuard();
  DeterministicModeGuard(const DeterministicModeGuard&) = delete;
  DeterministicModeGuard& operator=(const DeterministicModeGuard&) = delete;

 private:
  std::optional<bool> previous_;
};

// Turns the policy's `deterministic` (model.deterministic_mode in a run config) into process
// state, once at start-up before a model runs. First validate_execution_policy: an invalid
// policy (deterministic with pre_gdr_fusion: full) is its error, returned before anything
// changes. Then, when `deterministic` is true:
//   - at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false), which
//     sends ATen and gdr's ops down their ordered paths (use_deterministic_mode() sees it)
//     and makes ATen throw on ops with no deterministic path;
//   - CUBLAS_WORKSPACE_CONFIG is left alone (Note [cuBLAS workspace] in determinism.cc);
//   - PyTorch's fill of uninitialized memory is set from the policy's
//     deterministic_fill_uninitialized_memory (off by default; Note [Uninitialized-memory
//     fill] in determinism.cc).
// When false, nothing is changed (an earlier setting is left alone).
absl::Status apply_deterministic_mode(const ExecutionPolicy& policy);

inline constexpr char kCublasWorkspaceConfigVar[] = "CUBLAS_WORKSPACE_CONFIG";

}  // namespace gdr
