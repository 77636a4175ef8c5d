#include "models/qwen/deterministic_mode.h"

#include <ATen/Context.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace gdr {

absl::Status apply_deterministic_mode(const QwenConfig& config) {
  if (!config.deterministic_mode) return absl::OkStatus();
  // The same rule as validate_qwen_config, for configs built in code: checked before any
  // process state changes.
  if (config.pre_gdr_fusion == PreGdrFusion::kFull) {
    return absl::FailedPreconditionError(
        "deterministic_mode: true cannot be combined with pre_gdr_fusion: full (the fully fused "
        "pre-GDR path has no ordered, bit-reproducible backward); use pre_gdr_fusion: gate or "
        "none");
  }
  const char* current = std::getenv(kCublasWorkspaceConfigVar);
  if (current == nullptr || current[0] == '\0') {
    setenv(kCublasWorkspaceConfigVar, kCublasWorkspaceConfigDefault, /*overwrite=*/1);
  } else if (std::string(current) != ":4096:8" && std::string(current) != ":16:8") {
    return absl::FailedPreconditionError(
        absl::StrCat("deterministic_mode: true needs ", kCublasWorkspaceConfigVar,
                     " unset, \":4096:8\" or \":16:8\" (cuBLAS is only reproducible with a fixed "
                     "workspace) but it is \"",
                     current, "\""));
  }
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  // Note [Uninitialized-memory fill]: with deterministic algorithms on, PyTorch also fills
  // every at::empty() with NaN (or the dtype's max) by default: a guard against kernels that
  // read memory they never wrote, paid as one extra fill kernel per allocation. Our training
  // step is launch-bound, so that fill was most of deterministic mode's cost (issue 5).
  // Every kernel on the training path writes all of its outputs, and the state-equality
  // protocol (fresh-process reruns compared bit for bit) is what checks that, so the fill
  // is off unless GDR_DETERMINISTIC_FILL_UNINITIALIZED_MEMORY=1 asks for it (debugging).
  const char* fill = std::getenv(kDeterministicFillVar);
  at::globalContext().setDeterministicFillUninitializedMemory(fill != nullptr &&
                                                              std::string(fill) == "1");
  return absl::OkStatus();
}

}  // namespace gdr
