// RunConfig: everything a training run needs, loaded from one YAML file.
//
// Layout (every section but `model:` is ours; `model:` is read by load_qwen_config_yaml in
// models/qwen/config.h, so the model keys and their messages are exactly the model's):
//   model:      QwenConfig keys (deterministic_mode lives here).
//   data:       source: embedded | indexed
//               path: text file for `embedded` (default data/corpus.txt, byte tokens 0..255)
//               prefix: Megatron .bin/.idx prefix for `indexed`
//               seq_len, micro_batch_size
//               valid_fraction (0..0.5: the held-out tail of the stream), or valid_path /
//               valid_prefix (a second text file / indexed dataset): the validation set
//               document_masking: true | false (default false): packed documents kept apart
//               in the model, starts from the document index / model.eos_token_id (Note
//               [Document starts] in gdr/data.h; the embedded source needs eos_token_id)
//   optimizer:  impl: fused | loop (AdamW update, see OptimizerImpl), lr, betas: [b1, b2],
//               eps, weight_decay, grad_clip (<= 0: no clipping)
//   schedule:   warmup_steps, total_steps (0: = train.steps), min_lr_ratio (cosine floor)
//   train:      steps, grad_accum (microbatches per optimizer step), seed, dtype: fp32 | bf16,
//               device: cpu | cuda, log_every, metrics_path (JSON lines, "" = none),
//               checkpoint_dir ("" = none), checkpoint_every (0 = only at the end),
//               snapshot_dir ("" = none; a state snapshot after every step),
//               on_nonfinite: stop | skip,
//               num_threads (ATen intra-op threads; 0 = ATen's default, one per core),
//               overlap_grad_reduction: true | false (sum / reduce during the last backward)
//               shard_optimizer_state: false | true (ZeRO-1 over data-parallel ranks; same bits)
//               cuda_graphs: true | false (CUDA: replay microbatches from a CUDA graph)
//               eval_every (0 = never), eval_batches: evaluation on the validation set
//               init_from: a Hugging Face checkpoint to start from ("" = reference init)
//               recompute: none | attention | full (activation recomputation; same bits)
//   kernels:    the execution policy's kernel choices, one key each (rms_norm: composite,
//               attention: aten, pre_gdr_gate_tile: 128x16x256, ...; execution_policy_keys()
//               in ops/policy/execution_policy.h, and README's switch table)
// Every section is optional except `model:`; a missing key keeps its default below.
//
// Errors are absl::InvalidArgumentError (NotFoundError for a missing file) whose message is
// "<file>: <section>.<key>: <what is wrong>", the same shape as the model loader's, e.g.
//   "configs/x.yaml: train.steps: expected an integer but got 'many'"
//   "configs/x.yaml: train.stepz: unknown key"
//
// Overrides: `--set=train.steps=5` sets one key by its dotted path before parsing. The value
// is parsed as a YAML scalar (or flow list) and typed by the key's schema, so a wrong type
// gives the same message as in the file. A path naming no known key is an error
// "--set train.stepz=5: train.stepz: unknown key".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "models/qwen/config.h"
#include "ops/policy/execution_policy.h"

namespace gdr {

enum class DataSource { kEmbedded, kIndexed };
enum class TrainDtype { kFloat32, kBFloat16 };
enum class TrainDevice { kCpu, kCuda };
enum class OnNonfinite { kStop, kSkip };

struct DataConfig {
  DataSource source = DataSource::kEmbedded;
  std::string path = "data/corpus.txt";
  std::string prefix;
  int64_t seq_len = 64;
  int64_t micro_batch_size = 4;
  // Validation set (one of these, or none; see open_data_sets in gdr/data.h): a held-out
  // fraction of the training windows, or a second source of the same kind.
  double valid_fraction = 0;
  std::string valid_path;    // embedded
  std::string valid_prefix;  // indexed
  // Note [Document masking] (models/qwen/document_bounds.h): each microbatch (training and
  // evaluation) carries its rows' document starts (Note [Document starts] in gdr/data.h) and
  // the model keeps the documents apart; on CUDA the microbatches then run eagerly (no CUDA
  // graphs).
  bool document_masking = false;
};

// How the AdamW update runs: kFused is gdr::fused_adamw_step_ (ops/fused_adamw/fused_adamw_op.h:
// gradient clip, AdamW and the BF16 parameter store in one multi-tensor pass on CUDA, with the bits
// of ATen's _foreach_mul_ + _fused_adamw_ (what torch.optim.AdamW(fused=True) runs) +
// _foreach_copy_), kLoop is libtorch's torch::optim::AdamW::step() (several ATen ops per
// parameter). Same formula, same state
// (exp_avg, exp_avg_sq, step in torch::optim's state map, so checkpoints are the same
// format); the two differ in FP32 rounding, so compare runs with the same setting.
enum class OptimizerImpl { kFused, kLoop };

struct OptimizerConfig {
  OptimizerImpl impl = OptimizerImpl::kFused;
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  double grad_clip = 1.0;
};

struct ScheduleConfig {
  int64_t warmup_steps = 0;
  int64_t total_steps = 0;  // 0: train.steps
  double min_lr_ratio = 0.1;
};

struct TrainConfig {
  int64_t steps = 10;
  int64_t grad_accum = 1;
  int64_t seed = 1234;
  TrainDtype dtype = TrainDtype::kFloat32;
  TrainDevice device = TrainDevice::kCpu;
  int64_t log_every = 1;
  std::string metrics_path;
  std::string checkpoint_dir;
  int64_t checkpoint_every = 0;
  std::string snapshot_dir;
  OnNonfinite on_nonfinite = OnNonfinite::kStop;
  int64_t num_threads = 0;
  // Start the gradient reduction during the last microbatch's backward: across ranks
  // under data parallelism, and, with CUDA graphs, the sum over microbatches on one GPU too
  // (Note [Overlapped gradient reduction] in gdr/distributed.h and gdr/trainer.cc); same
  // bits either way.
  bool overlap_grad_reduction = true;
  // Data parallelism: each rank keeps the AdamW moments (and, in bf16, the FP32 masters) of
  // the parameters it owns only, steps those, and broadcasts their new values (Note [Sharded
  // optimizer state] in gdr/trainer.cc); ignored with one rank; same bits either way.
  bool shard_optimizer_state = false;
  // CUDA only (ignored on CPU): capture one microbatch's forward and backward into a CUDA
  // graph and replay it (Note [Microbatch graphs] in gdr/microbatch_graphs.h); same bits
  // either way.
  bool cuda_graphs = true;
  // Activations recomputed in the backward to save memory (Note [Recomputation] in
  // ops/recompute/recompute_op.h): none, attention (each layer's token mixer) or full (whole
  // decoder layers); same bits either way.
  Recompute recompute = Recompute::kNone;
  // Evaluation on the validation set every eval_every steps (0: never) and after the last
  // step, over the first eval_batches micro_batch_size-window batches of it; it never
  // changes what training computes.
  int64_t eval_every = 0;
  int64_t eval_batches = 8;
  // Start from these weights instead of the reference init (Note [Starting from a Hugging
  // Face checkpoint] in gdr/trainer.cc): a Hugging Face directory, index JSON or
  // .safetensors file whose config.json must describe the `model:` section's model. The
  // optimizer starts fresh; --resume wins over it.
  std::string init_from;
};

struct RunConfig {
  QwenConfig model;
  DataConfig data;
  OptimizerConfig optimizer;
  ScheduleConfig schedule;
  TrainConfig train;
  // The `kernels:` section's choices (the other fields keep their defaults here; see
  // file_execution_policy).
  ExecutionPolicy kernels;
  std::string source;       // the file it came from
  std::string config_text;  // the effective YAML (overrides applied), kept in checkpoints

  int64_t schedule_total_steps() const {
    return schedule.total_steps > 0 ? schedule.total_steps : train.steps;
  }
};

// One `--set` override: "section.key=value".
struct ConfigOverride {
  std::string path;   // "train.steps"
  std::string value;  // "5"
};

// Splits "train.steps=5"; InvalidArgument naming the text when there is no '=' or no
// "section.key" before it.
absl::StatusOr<ConfigOverride> parse_config_override(const std::string& text);

absl::StatusOr<RunConfig> load_run_config(const std::string& path,
                                          const std::vector<ConfigOverride>& overrides = {});

// load_run_config for a config held as text (a checkpoint's state.json "config"); messages
// and RunConfig::source name `shown_as` as the file.
absl::StatusOr<RunConfig> load_run_config_text(const std::string& text,
                                               const std::string& shown_as);

absl::string_view train_dtype_name(TrainDtype dtype);

// The execution policy the file asks for: the `kernels:` section plus
// model.deterministic_mode, model.pre_gdr_fusion, train.cuda_graphs and train.recompute.
// load_run_config already refused one that validate_execution_policy refuses.
ExecutionPolicy file_execution_policy(const RunConfig& config);

// The run's execution policy (Note [Execution policy]): file_execution_policy with the GDR_*
// environment variables applied over it (`get`: the process environment by default; the
// keys they changed go to `from_environment` when given), then validated. Errors name the
// variable ("GDR_RMS_NORM: expected fused or composite, but got 'x'") or, for a rule
// between choices, the config file.
absl::StatusOr<ExecutionPolicy> execution_policy_for_run(
    const RunConfig& config, EnvironmentReader get = nullptr,
    std::vector<std::string>* from_environment = nullptr);

// The dotted keys whose values differ between the config a checkpoint was written with
// (`saved_config_text`, RunConfig::config_text of that run; `saved_source` names it in
// errors) and `current`, leaving out what a resumed run may change without changing what
// its steps compute: train.steps (unless it moves the schedule's end), log_every,
// metrics_path, checkpoint_dir, checkpoint_every, snapshot_dir, on_nonfinite,
// overlap_grad_reduction, shard_optimizer_state, cuda_graphs and the kernels: choices that give the
// same bits (ExecutionPolicyKey::same_bits). Model keys are compared as written. Empty when the
// resumed run continues the same computation.
absl::StatusOr<std::vector<std::string>> resume_config_differences(
    const std::string& saved_config_text, const std::string& saved_source,
    const RunConfig& current);

}  // namespace gdr
