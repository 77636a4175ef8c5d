#include "ops/policy/determinism.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>

#include "ops/policy/execution_policy.h"

namespace gdr {
namespace {

// -1 = no override, 0 = false, 1 = true. Atomic because autograd runs backward on its own
// device threads, which must see the override set by the caller's thread.
std::atomic<int> g_override{-1};

}  // namespace

bool use_deterministic_mode() {
  const int forced = g_override.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
  if (std::optional<bool> from_env = deterministic_mode_from_environment()) return *from_env;
  return at::globalContext().deterministicAlgorithms();
}

void set_deterministic_mode_override(std::optional<bool> value) {
  g_override.store(value.has_value() ? (*value ? 1 : 0) : -1, std::memory_order_relaxed);
}

std::optional<bool> deterministic_mode_override() {
  const int forced = g_override.load(std::memory_order_relaxed);
  if (forced < 0) return std::nullopt;
  return forced == 1;
}

DeterministicModeGuard::DeterministicModeGuard(std::optional<bool> value)
    : previous_(deterministic_mode_override()) {
  set_deterministic_mode_override(value);
}

DeterministicModeGuard::~DeterministicModeGuard() { set_deterministic_mode_override(previous_); }

absl::Status apply_deterministic_mode(const ExecutionPolicy& policy) {
  if (absl::Status s = validate_execution_policy(policy); !s.ok()) return s;
  if (!policy.deterministic) return absl::OkStatus();
  // Note [cuBLAS workspace]: cuBLAS documents two ways to be bitwise reproducible when
  // streams share a handle: a separate workspace per stream (cublasSetWorkspace), or its
  // debug variable CUBLAS_WORKSPACE_CONFIG=:4096:8 / :16:8. libtorch does the first: every
  // (handle, stream) pair gets its own workspace from the caching allocator, and its
  // cuBLASLt calls pass an explicit workspace. libtorch 2.11 no longer checks the variable,
  // and exporting it makes cuBLAS pick slower kernels (pinned, it was all of deterministic
  // mode's extra step cost: docs/benchmarks.md, Decisions). So it is not pinned; a value the
  // user exports is left alone (any value is reproducible under libtorch's per-stream
  // workspaces). The state-equality protocol (fresh-process reruns compared bit for bit on
  // the GPU) is the check that this holds.
  at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  // Note [Uninitialized-memory fill]: with deterministic algorithms on, PyTorch also fills
  // every at::empty() with NaN (or the dtype's max) by default: a guard against kernels that
  // read memory they never wrote, paid as one extra fill kernel per allocation, which made
  // up most of deterministic mode's cost in a launch-bound step (docs/benchmarks.md,
  // Decisions).
  // Every kernel on the training path writes all of its outputs, and the state-equality
  // protocol (fresh-process reruns compared bit for bit) is what checks that, so the fill
  // is off unless the policy's deterministic_fill_uninitialized_memory asks for it
  // (debugging; GDR_DETERMINISTIC_FILL_UNINITIALIZED_MEMORY=1).
  at::globalContext().setDeterministicFillUninitializedMemory(
      policy.deterministic_fill_uninitialized_memory);
  return absl::OkStatus();
}

}  // namespace gdr
