#include "models/qwen/deterministic_mode.h"

#include <ATen/Context.h>

#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"

namespace gdr {

absl::Status apply_deterministic_mode(const QwenConfig& config) {
  if (!config.deterministic_mode) return absl::OkStatus();
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
  return absl::OkStatus();
}

}  // namespace gdr
