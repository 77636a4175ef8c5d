// ExecutionPolicy: every kernel and determinism choice of a run, as one value.
//
// Note [Execution policy]: which implementation each op runs (fused kernel or ATen
// composite, tensor cores or FP32 SIMT, cuDNN or ATen attention, the gate's tile, ...) is
// a field of ExecutionPolicy, never a variable an op reads from the environment. The policy
// is built once at start-up:
//   1. the defaults below (what a run gets when it says nothing),
//   2. the run config's `kernels:` section (keys: execution_policy_keys()), plus
//      model.deterministic_mode, model.pre_gdr_fusion, train.cuda_graphs and
//      train.recompute,
//   3. the GDR_* environment variables, as overrides (apply_environment_overrides: the one
//      place in gdr that reads them, so a user can A/B a kernel without editing a config),
//   4. validate_execution_policy (the rules between choices, e.g. deterministic mode
//      rejects pre_gdr_fusion: full),
// then printed in full in the run header and written into checkpoints and snapshots.
// Ops read it with current_execution_policy(): the policy of the innermost
// ExecutionPolicyGuard on this thread, or ExecutionPolicy{} (the defaults) when there is
// none. The caller (the trainer, a benchmark arm, a test) sets the guard. An autograd
// Function whose backward depends on the policy saves the forward's policy
// (intern_execution_policy) and restores it with a guard in its backward: autograd runs
// CUDA backwards on its own device threads, which have no guard of their own.
//
// Determinism is the exception that keeps the seed contract: use_deterministic_mode()
// (ops/policy/determinism.h) is still read at every call from its in-process override,
// GDR_DETERMINISTIC and PyTorch's deterministicAlgorithms(). The policy's `deterministic`
// field is what the run asked for; apply_deterministic_mode (ops/policy/determinism.h) turns
// PyTorch's switch on from it at start-up, which use_deterministic_mode() then sees.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "kernels/pre_gdr_gate/pre_gdr_gate.h"

namespace gdr {

// How the Gated DeltaNet layers run the pre-GDR gate (model.pre_gdr_fusion): none = the ATen
// composite, gate = the fused gate op, full = conv1d + SiLU + L2 norm + repeat + gate in one
// CUDA op (no ordered backward, so not with deterministic mode).
enum class PreGdrFusion { kNone, kGate, kFull };
// The GDR core's state pass on CUDA: the chunk-scan kernels or the per-chunk ATen loop.
enum class GdrCoreImpl { kKernel, kComposite };
// The GDR core's chunk preparation (steps 1-6) on CUDA: the chunk-prep kernels or ATen.
enum class GdrCorePrep { kKernel, kAten };
// Full attention on CUDA: cuDNN's flash attention through gdr's op, or ATen's SDPA.
enum class AttentionBackend { kCudnn, kAten };
// The gate backward's ordered reduction (Note [Single-pass ordered reduction]): chosen by
// shape and capture state (auto), or one variant forced; the same bits either way.
enum class GateOrderedVariant { kAuto, kSinglePass, kTwoPass };
enum class RmsNormImpl { kFused, kComposite };
// The fused RMSNorm's CUDA kernels: rows resident in registers where they fit (the default),
// or the streaming kernels for every row.
enum class RmsNormKernel { kResident, kStreaming };
// The decoder layers' residual adds: inside the next zero-centred norm, or separate adds.
enum class AddRmsNormImpl { kFused, kComposite };
enum class CausalConvImpl { kKernel, kAten };
enum class GatedActivationImpl { kFused, kComposite };
enum class RopeImpl { kFused, kComposite };
enum class CrossEntropyImpl { kFused, kComposite };
enum class TiedEmbeddingImpl { kFused, kComposite };
enum class LinearGroupImpl { kFused, kComposite };
// Activation recomputation in the model's backward (Note [Recomputation] in
// ops/recompute/recompute_op.h): none, each layer's token mixer (Gated DeltaNet or gated
// attention, with its projections), or whole decoder layers.
enum class Recompute { kNone, kAttention, kFull };

struct ExecutionPolicy {
  // Determinism (Note [Deterministic mode resolution] in ops/policy/determinism.h).
  bool deterministic = false;
  // PyTorch's NaN fill of every at::empty() under deterministic algorithms (a debugging aid;
  // Note [Uninitialized-memory fill] in ops/policy/determinism.cc).
  bool deterministic_fill_uninitialized_memory = false;
  PreGdrFusion pre_gdr_fusion = PreGdrFusion::kGate;
  // Pre-GDR gate backward: a fixed tile in both modes (nullopt: the selection rule), and
  // the ordered reduction's variant.
  std::optional<kernels::GateTile> gate_tile;
  GateOrderedVariant gate_ordered = GateOrderedVariant::kAuto;
  // GDR core.
  GdrCoreImpl gdr_core_impl = GdrCoreImpl::kKernel;
  GdrCorePrep gdr_core_prep = GdrCorePrep::kKernel;
  bool chunk_scan_tensor_cores = true;  // the scan's 3xTF32 tensor-core variant
  bool chunk_prep_tensor_cores = true;  // the prep backward's dM, dK / dQ on tensor cores
  bool chunk_gemm_tensor_cores =
      true;                      // the state pass's GEMMs on the 3xTF32 kernel (false: cuBLAS FP32)
  bool chunk_gemm_wgmma = true;  // that GEMM on wgmma where the GPU code has it (sm_90a)
  bool chunk_gemm_overlap = true;  // the backward's dQd / dP GEMMs on a side stream
  bool gdr_core_v_fp32 = false;    // hand the core an FP32 copy of v
  // The other ops.
  AttentionBackend attention = AttentionBackend::kCudnn;
  RmsNormImpl rms_norm = RmsNormImpl::kFused;
  RmsNormKernel rms_norm_kernel = RmsNormKernel::kResident;
  AddRmsNormImpl add_rms_norm = AddRmsNormImpl::kFused;
  CausalConvImpl causal_conv = CausalConvImpl::kKernel;
  GatedActivationImpl gated_activation = GatedActivationImpl::kFused;
  RopeImpl rope = RopeImpl::kFused;
  CrossEntropyImpl cross_entropy = CrossEntropyImpl::kFused;
  TiedEmbeddingImpl tied_embedding = TiedEmbeddingImpl::kFused;
  LinearGroupImpl linear_group = LinearGroupImpl::kFused;
  // The trainer: replay microbatches from CUDA graphs (train.cuda_graphs; CUDA only).
  bool cuda_graphs = true;
  // The model: activations recomputed in the backward (train.recompute; same bits).
  Recompute recompute = Recompute::kNone;
};

bool operator==(const ExecutionPolicy& a, const ExecutionPolicy& b);
inline bool operator!=(const ExecutionPolicy& a, const ExecutionPolicy& b) { return !(a == b); }

// ---------------------------------------------------------------------------------------
// Keys, values and the environment.

// One choice of the policy: its key (in a run config's `kernels:` section, or the section
// and key named by `config_key` for the three that live elsewhere), its environment
// override ("" where there is none), the values it takes, its default and one line saying
// what it picks.
struct ExecutionPolicyKey {
  std::string key;         // "rms_norm"
  std::string config_key;  // "kernels.rms_norm" (or "model.deterministic_mode", ...)
  std::string variable;    // "GDR_RMS_NORM"
  std::vector<std::string>
      values;                 // {"fused", "composite"}; the gate tile: {"auto", "TxHxTHREADS"}
  std::string default_value;  // "fused"
  std::string what;
  // Every value computes the same bits (a scheduling or launch choice: the gate's ordered
  // variant, the GEMM overlap, the residual add's place, the norm's kernel variant, CUDA
  // graphs, the debugging fill; or fused kernels that round where the ATen ops round: the
  // gated activations, RoPE); a resumed run may change it.
  bool same_bits = false;
};

// Every choice, in the order describe_execution_policy prints them.
const std::vector<ExecutionPolicyKey>& execution_policy_keys();

// Sets the choice named `key` (ExecutionPolicyKey::key) from its text. Errors are
// InvalidArgument "<source>: expected <values>, but got '<text>'", e.g.
// "configs/x.yaml: kernels.rms_norm: expected fused or composite, but got 'fast'";
// an unknown key is "<source>: unknown key".
absl::Status set_execution_policy_value(ExecutionPolicy& policy, absl::string_view key,
                                        absl::string_view text, absl::string_view source);

// The canonical text of one choice ("fused", "true", "auto", "128x16x256").
std::string execution_policy_value(const ExecutionPolicy& policy, absl::string_view key);

// Returns the value of an environment variable, or nullptr when it is unset.
using EnvironmentReader = std::function<const char*(const char*)>;

// Applies every GDR_* variable that is set and not empty over `policy`; an invalid value is
// an InvalidArgument naming the variable ("GDR_RMS_NORM: expected fused or composite, but
// got 'x'"). `get` defaults to the process environment. `overridden`, when given, receives
// the keys the environment changed (for the run header).
absl::Status apply_environment_overrides(ExecutionPolicy& policy, EnvironmentReader get = nullptr,
                                         std::vector<std::string>* overridden = nullptr);

// The rules between choices: deterministic with pre_gdr_fusion: full is a
// FailedPrecondition naming both settings (the fully fused pre-GDR path has no ordered,
// bit-reproducible backward).
absl::Status validate_execution_policy(const ExecutionPolicy& policy);

// Every choice as "key=value", space-separated, in execution_policy_keys() order: what the
// run header prints and checkpoints and snapshots record.
std::string describe_execution_policy(const ExecutionPolicy& policy);

// The keys whose values differ between two descriptions (describe_execution_policy), e.g.
// a checkpoint's and the current run's; a key missing on one side counts as different.
std::vector<std::string> execution_policy_differences(absl::string_view a, absl::string_view b);

// GDR_DETERMINISTIC: nullopt when unset or empty; throws c10::Error naming the variable
// when it is not a boolean. Read by use_deterministic_mode() at every call.
std::optional<bool> deterministic_mode_from_environment();

// GDR_* variables that are set but that no part of gdr reads (a misspelt switch must not
// pass silently); the run prints a warning naming them.
std::vector<std::string> unknown_gdr_environment_variables();

// ---------------------------------------------------------------------------------------
// The current policy.

// The policy of the innermost ExecutionPolicyGuard on this thread, else the defaults.
const ExecutionPolicy& current_execution_policy();

// Makes `policy` the current one on this thread for the guard's scope (nestable).
class ExecutionPolicyGuard {
 public:
  explicit ExecutionPolicyGuard(const ExecutionPolicy& policy);
  // The policy interned under `id` (intern_execution_policy).
  explicit ExecutionPolicyGuard(int64_t id);
  ~ExecutionPolicyGuard();
  ExecutionPolicyGuard(const ExecutionPolicyGuard&) = delete;
  ExecutionPolicyGuard& operator=(const ExecutionPolicyGuard&) = delete;

 private:
  int64_t previous_;
};

// A process-wide id of `policy` (equal policies share one id), for autograd Functions to
// save the forward's policy in their context: ctx->saved_data["policy"] =
// current_execution_policy_id(); and in backward: ExecutionPolicyGuard
// policy(ctx->saved_data["policy"].toInt());
int64_t intern_execution_policy(const ExecutionPolicy& policy);
int64_t current_execution_policy_id();

}  // namespace gdr
