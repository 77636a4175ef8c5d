// Trainer: builds the model and optimizer from a RunConfig and runs the training loop.
//
// One optimizer step (train_step):
//   for m in 1..M (M = train.grad_accum): take data.micro_batch_size windows of seq_len + 1
//     tokens, loss_m = causal_lm_loss(model(window), window) (seq_len next-token predictions
//     per window, see models/qwen/model.h), backward of loss_m / (W * M) (W ranks, 1 without
//     data parallelism); the microbatch gradients (widened to FP32) are added up by the
//     fixed tree of Note [Gradient reduction tree] (gdr/distributed.h), across ranks too;
//   grad_norm = global L2 norm of all gradients; clip to optimizer.grad_clip (when > 0) by
//     one host-side scale factor;
//   NaN/Inf in any loss_m or in grad_norm: stop with an error naming the step
//     (on_nonfinite: stop), or drop the gradients and count the step as skipped (skip);
//   lr from the schedule (learning_rate_at), torch::optim::AdamW step on the FP32 masters
//     (decoupled weight decay on every parameter, norms and embedding included: one param
//     group, as in the simplest reference setups).
//
// Note [Master weights]: the optimizer always holds FP32 parameters ("masters") and FP32
// exp_avg / exp_avg_sq. With train.dtype fp32 the model's parameters are the masters.
// With bf16 the model runs in BF16 (parameters and activations; the loss is FP32 inside
// causal_lm_loss), its gradients are widened to FP32 into the masters' .grad, AdamW updates
// the masters, and the masters are rounded back into the BF16 model after every step.
// Checkpoints store the masters, so resuming loses nothing to rounding.
//
// Execution policy: create() builds the run's policy once (execution_policy_for_run in
// gdr/run_config.h: the config's kernels: section, model.deterministic_mode,
// model.pre_gdr_fusion, train.cuda_graphs and the GDR_* overrides), applies its determinism
// (apply_deterministic_mode) before building anything, and makes it current on the
// trainer's thread whenever the trainer runs ops; checkpoints and snapshots record it, and
// resume() refuses a checkpoint whose policy differs in a choice that changes the bits.
//
// Determinism: with model.deterministic_mode (or GDR_DETERMINISTIC=1) the trainer turns on
// PyTorch's deterministic algorithms before building anything. Everything that decides a step's
// result is then a function of (config, seed, data, checkpoint): init from init_qwen_weights(seed),
// the data order from TokenWindows, the clip factor computed on the host. The default CPU generator
// is seeded from train.seed (it starts nondeterministic in every process); its state is saved and
// restored although no current op draws from it (no dropout), so a future one stays exact.
// CPU reductions in ATen split work by thread count: bit-exactness holds for the same
// binary with the same number of threads (pin it with train.num_threads to compare runs
// across machines).
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gdr/checkpoint.h"
#include "gdr/data.h"
#include "gdr/run_config.h"
#include "io/safetensors.h"

namespace gdr {

class QwenForCausalLMImpl;
class ProcessGroup;

struct StepStats {
  int64_t step = 0;  // 1-based number of the step just taken
  std::vector<double> microbatch_losses;
  double loss = 0;  // mean of microbatch_losses
  double lr = 0;
  double grad_norm = 0;  // before clipping
  int64_t tokens = 0;    // predicted tokens in this step
  double step_time_s = 0;
  double tokens_per_s = 0;
  double reduce_time_s = 0;  // host wall time of the cross-rank gradient reduction (DP only)
  // Where the host's time went (Note [Host-bound steps] in trainer.cc): queueing the
  // microbatches' work, then waiting for the GPU to finish it at the step's one loss sync.
  double host_queue_s = 0;
  double gpu_wait_s = 0;
  // Microbatches of this rank replayed from the CUDA graph (Note [Microbatch graphs] in
  // gdr/microbatch_graphs.h); the others ran eagerly.
  int64_t graph_replays = 0;
  bool skipped = false;
};

// One evaluation on the validation set (Trainer::evaluate).
struct EvalStats {
  int64_t step = 0;       // steps taken before it
  double loss = 0;        // mean of the batches' mean next-token losses
  double perplexity = 0;  // exp(loss)
  int64_t batches = 0;    // min(train.eval_batches, whole batches in the validation set)
  int64_t tokens = 0;     // predicted tokens
  double time_s = 0;
};

// "eval step 10 loss 4.1234 perplexity 61.80 (8 batches, 2048 tokens, 0.05s)"
std::string format_eval_line(const EvalStats& stats);

// Linear warm-up to optimizer.lr over schedule.warmup_steps, then cosine decay to
// lr * min_lr_ratio at schedule_total_steps(); constant at the floor afterwards.
// `step` is 1-based.
double learning_rate_at(const RunConfig& config, int64_t step);

// "step 3/20 loss 4.1234 lr 1.00e-03 grad_norm 1.23 tokens/s 12345 step_time 0.123s"
std::string format_progress_line(const StepStats& stats, int64_t total_steps);

// The line Trainer::run prints first (rank 0), saying what is about to run: size, device,
// precision, determinism, the kernel switches in effect (CUDA only: CPU runs the
// composites), "document masking" when data.document_masking is on, and the step's
// tokens, e.g.
// "run: 0.85B parameters (24 layers: 18 linear_attention + 6 full_attention, hidden 1024) |
//  cuda bf16 | deterministic on | pre_gdr_fusion gate | gdr core kernel, prep kernel |
//  attention cudnn | 8192 tokens per step (1 rank x 4 microbatches x 1 x 2048) |
//  steps 1..30"
std::string format_run_header(const RunConfig& config, const ExecutionPolicy& policy,
                              int64_t parameters, int world, int64_t first_step);

// The line after it: the whole execution policy (Note [Execution policy]), e.g.
// "execution policy: deterministic=true ... cuda_graphs=true (from the environment:
//  GDR_ATTENTION)", naming the GDR_* variables that changed it.
std::string format_policy_line(const ExecutionPolicy& policy,
                               const std::vector<std::string>& from_environment);

// With train.shard_optimizer_state and several ranks, printed after the policy line
// (Note [Sharded optimizer state] in trainer.cc): the plan `owners` of parameters of sizes
// `numels`, e.g. "optimizer state: sharded over 2 ranks (rank 0 owns 27 tensors, 92.1K
// elements; rank 1 owns 26 tensors, 91.0K elements)".
std::string format_sharding_line(const std::vector<int64_t>& numels, const std::vector<int>& owners,
                                 int world);

// What optimizer state this rank holds: the parameters with AdamW moments (exp_avg and
// exp_avg_sq each have moment_elements elements) and, in bf16, FP32 masters.
struct OptimizerStateHeld {
  int64_t moment_tensors = 0;
  int64_t moment_elements = 0;
  int64_t master_tensors = 0;  // bf16 only (in fp32 the parameters are the masters)
  int64_t master_elements = 0;
};

class Trainer {
 public:
  // Applies deterministic mode, opens the data, builds and initialises the model.
  //
  // Data parallelism (`group` with world size W > 1, gdr/distributed.h): every rank reads
  // the same global window order; a step consumes W * grad_accum microbatches of
  // micro_batch_size windows, global microbatches r * grad_accum .. (r + 1) * grad_accum - 1
  // going to rank r (contiguous, so that the reduction tree does not depend on W), and the
  // data position is the same on every rank. The gradients are summed over ranks after the
  // accumulation steps, before the norm and clipping (Note [Gradient reduction tree]); the
  // step's losses are all W * grad_accum microbatch losses in global order, so every rank
  // computes the same step, and with grad_accum a power of two the same step as one
  // process with grad_accum W times larger. create() refuses, on every rank, a config
  // whose hash (sha256 of config_text) differs between ranks, and initial parameters whose
  // checksum differs. Only rank 0 prints progress and writes metrics and checkpoints;
  // snapshots are written by every rank, rank r > 0 to `<snapshot_dir>.rank<r>`, so the
  // ranks' states can be compared. Optimizer state is replicated, or, with
  // train.shard_optimizer_state, sharded over the ranks (Note [Sharded optimizer state] in
  // trainer.cc): then capture(), save_checkpoint(), write_snapshot(), master_parameters() and
  // optimizer_tensors() are collectives that every rank must call at the same point (run()
  // does), and they give the full state, as without sharding.
  static absl::StatusOr<std::unique_ptr<Trainer>> create(
      const RunConfig& config, std::shared_ptr<ProcessGroup> group = nullptr);
  ~Trainer();

  // Loads a checkpoint: `dir` is a step directory or a checkpoint_dir (its latest complete
  // step). See read_checkpoint for the refusals. A checkpoint written under a config that
  // computes differently (resume_config_differences in gdr/run_config.h) is refused with
  // FailedPrecondition naming the keys, unless `allow_config_change`.
  absl::Status resume(const std::string& dir, bool allow_config_change = false);

  // One optimizer step (see the header comment). Snapshot data of the step is kept for
  // write_snapshot.
  absl::StatusOr<StepStats> train_step();

  // The mean loss over the first train.eval_batches batches of the validation set, in index
  // order, without gradients. It changes nothing a step computes: no RNG draw, not the data
  // position, not the parameters or the optimizer state (Note [Evaluation] in trainer.cc).
  // Every rank evaluates every batch (the same result on each). FailedPrecondition without a
  // validation set; run() calls it every train.eval_every steps and after the last one.
  absl::StatusOr<EvalStats> evaluate();

  // Steps until train.steps, printing progress every log_every steps to `log`, appending
  // metrics, writing checkpoints (every checkpoint_every steps and after the last step)
  // and snapshots as configured.
  absl::Status run(std::ostream& log);

  // The state as a checkpoint, and writing it to `step_dir`.
  Checkpoint capture() const;
  absl::Status save_checkpoint(const std::string& step_dir) const;

  // A state snapshot of the last step (Note [State snapshots] in trainer.cc) in
  // `dir`/step_<N>/: snapshot.safetensors + snapshot.json.
  absl::Status write_snapshot(const std::string& dir) const;

  int64_t step() const;
  const DataPosition& data_position() const;
  const RunConfig& config() const;
  // FP32 masters under HF names, and "<name>.exp_avg|exp_avg_sq|step" optimizer tensors.
  io::NamedTensors master_parameters() const;
  io::NamedTensors optimizer_tensors() const;
  // The optimizer state kept in this process (all of it unless sharded).
  OptimizerStateHeld optimizer_state_held() const;
  QwenForCausalLMImpl& model();

 private:
  struct Impl;
  explicit Trainer(std::unique_ptr<Impl> impl);
  absl::StatusOr<StepStats> train_step_or_throw();
  std::unique_ptr<Impl> impl_;
};

}  // namespace gdr
