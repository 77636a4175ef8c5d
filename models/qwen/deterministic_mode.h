// Model-level deterministic mode: turns the `deterministic_mode` config key into process
// state before a model runs.
//
// When config.deterministic_mode is true:
//   - at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false), which
//     sends ATen and gdr's ops down their ordered paths (gdr's ops read it through
//     use_deterministic_mode(); see Note [Deterministic mode resolution] in
//     ops/determinism.h) and makes ATen throw on ops with no deterministic path;
//   - CUBLAS_WORKSPACE_CONFIG is left alone (Note [cuBLAS workspace] in
//     deterministic_mode.cc: libtorch already gives cuBLAS what it needs to be
//     reproducible, and pinning the variable made every step ~35% slower);
//   - PyTorch's fill of uninitialized memory (on by default with deterministic algorithms)
//     is turned off unless GDR_DETERMINISTIC_FILL_UNINITIALIZED_MEMORY=1 (Note
//     [Uninitialized-memory fill] in deterministic_mode.cc).
// deterministic_mode with pre_gdr_fusion: full is an absl::FailedPreconditionError naming
// both keys, returned before anything is changed (full fusion has no ordered backward).
// When false, nothing is changed (an earlier setting is left alone).
// Call it once at start-up, before the model runs.
#pragma once

#include "absl/status/status.h"
#include "models/qwen/config.h"

namespace gdr {

inline constexpr char kCublasWorkspaceConfigVar[] = "CUBLAS_WORKSPACE_CONFIG";
inline constexpr char kDeterministicFillVar[] = "GDR_DETERMINISTIC_FILL_UNINITIALIZED_MEMORY";

absl::Status apply_deterministic_mode(const QwenConfig& config);

}  // namespace gdr
