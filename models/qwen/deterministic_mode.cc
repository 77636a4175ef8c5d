#include "models/qwen/deterministic_mode.h"

#include <ATen/Context.h>

#include <cstdlib>
#include <string>

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
  // Note [cuBLAS workspace]: cuBLAS documents two ways to be bitwise reproducible when
  // streams share a handle: a separate workspace per stream (cublasSetWorkspace), or its
  // debug variable CUBLAS_WORKSPACE_CONFIG=:4096:8 / :16:8. libtorch does the first: every
  // (handle, stream) pair gets its own workspace from the caching allocator, and its
  // cuBLASLt calls pass an explicit workspace. libtorch 2.11 no longer checks the variable,
  // and exporting it makes cuBLAS pick slower kernels: on the H200 the 0.8B default step went
  // from 0.714 s to 0.979 s with the variable alone, which was all of deterministic mode's
  // cost (docs/benchmarks.md, issue 5). So it is not pinned; a value the user exports is
  // left alone (any value is reproducible under libtorch's per-stream workspaces). The
  // state-equality protocol (fresh-process reruns compared bit for bit on the H200) is the
  // check that this holds.
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
