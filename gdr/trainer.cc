#include "gdr/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "gdr/cuda_graph.h"
#include "gdr/distributed.h"
#include "gdr/microbatch_graphs.h"
#include "gdr/sha256.h"
#include "io/file_util.h"
#include "models/qwen/document_bounds.h"
#include "models/qwen/hf_checkpoint.h"
#include "models/qwen/model.h"
#include "ops/fused_adamw/fused_adamw_op.h"
#include "ops/policy/determinism.h"
#include "ops/policy/execution_policy.h"

namespace gdr {
namespace {

std::string hex_encode(const at::Tensor& bytes) {
  const at::Tensor b = bytes.contiguous();
  const uint8_t* p = b.data_ptr<uint8_t>();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * b.numel());
  for (int64_t i = 0; i < b.numel(); ++i) {
    out.push_back(kHex[p[i] >> 4]);
    out.push_back(kHex[p[i] & 0xf]);
  }
  return out;
}

absl::StatusOr<at::Tensor> hex_decode(const std::string& hex) {
  if (hex.size() % 2 != 0) return absl::DataLossError("rng_cpu: odd number of hex digits");
  at::Tensor out = at::empty({static_cast<int64_t>(hex.size() / 2)}, at::kByte);
  uint8_t* p = out.data_ptr<uint8_t>();
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < hex.size(); i += 2) {
    const int hi = digit(hex[i]), lo = digit(hex[i + 1]);
    if (hi < 0 || lo < 0) return absl::DataLossError("rng_cpu: not lower-case hex");
    p[i / 2] = static_cast<uint8_t>(hi << 4 | lo);
  }
  return out;
}

at::Tensor cpu_rng_state() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

// The default CPU generator starts from a nondeterministic seed in every process: seed it
// from train.seed so the RNG state, too, is a function of the config.
void seed_cpu_rng(uint64_t seed) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_current_seed(seed);
}

void set_cpu_rng_state(const at::Tensor& state) {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// sha256 over the per-tensor sha256s of `tensors` (bytes as stored, in order).
std::string tensors_checksum(const std::vector<at::Tensor>& tensors) {
  std::string digests;
  for (const at::Tensor& t : tensors) {
    const at::Tensor c = t.detach().to(at::kCPU).contiguous();
    digests += sha256_hex(absl::string_view(static_cast<const char*>(c.data_ptr()), c.nbytes()));
  }
  return sha256_hex(digests);
}

}  // namespace

double learning_rate_at(const RunConfig& config, int64_t step) {
  const double peak = config.optimizer.lr;
  const int64_t warmup = config.schedule.warmup_steps;
  if (warmup > 0 && step <= warmup) return peak * static_cast<double>(step) / warmup;
  const double floor = peak * config.schedule.min_lr_ratio;
  const int64_t decay_steps = config.schedule_total_steps() - warmup;
  if (decay_steps <= 0) return floor;
  const double progress = std::min(1.0, static_cast<double>(step - warmup) / decay_steps);
  return floor + 0.5 * (peak - floor) * (1.0 + std::cos(M_PI * progress));
}

std::string format_progress_line(const StepStats& s, int64_t total_steps) {
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "step %lld/%lld loss %.4f lr %.2e grad_norm %.2f tokens/s %.0f step_time %.3fs",
                static_cast<long long>(s.step), static_cast<long long>(total_steps), s.loss, s.lr,
                s.grad_norm, s.tokens_per_s, s.step_time_s);
  std::string line = buf;
  // Data parallelism: how much of the step the cross-rank gradient reduction took.
  if (s.reduce_time_s > 0) {
    std::snprintf(buf, sizeof(buf), " reduce %.3fs", s.reduce_time_s);
    line += buf;
  }
  if (s.skipped) line += " (skipped: non-finite)";
  return line;
}

std::string format_run_header(const RunConfig& config, const ExecutionPolicy& policy,
                              int64_t parameters, int world, int64_t first_step) {
  const QwenConfig& m = config.model;
  const TrainConfig& t = config.train;
  int64_t linear = 0;
  for (const std::string& type : m.layer_types) linear += type == "linear_attention" ? 1 : 0;
  const int64_t full = static_cast<int64_t>(m.layer_types.size()) - linear;
  const double p = static_cast<double>(parameters);
  const std::string size = p >= 1e9   ? absl::StrFormat("%.2fB", p / 1e9)
                           : p >= 1e6 ? absl::StrFormat("%.1fM", p / 1e6)
                           : p >= 1e3 ? absl::StrFormat("%.1fK", p / 1e3)
                                      : absl::StrCat(parameters);
  const bool cuda = t.device == TrainDevice::kCuda;
  const std::string fusion = execution_policy_value(policy, "pre_gdr_fusion");
  std::string line = absl::StrCat(
      "run: ", size, " parameters (", m.num_hidden_layers, " layers: ", linear,
      " linear_attention + ", full, " full_attention, hidden ", m.hidden_size, ") | ",
      cuda ? "cuda" : "cpu", " ", t.dtype == TrainDtype::kBFloat16 ? "bf16" : "fp32",
      " | deterministic ", policy.deterministic ? "on" : "off", " | pre_gdr_fusion ", fusion);
  if (config.data.document_masking) absl::StrAppend(&line, " | document masking");
  if (cuda) {
    absl::StrAppend(&line, " | gdr core ", execution_policy_value(policy, "gdr_core_impl"),
                    ", prep ", execution_policy_value(policy, "gdr_core_prep"), " | attention ",
                    execution_policy_value(policy, "attention"));
  }
  const int64_t tokens = static_cast<int64_t>(world) * t.grad_accum * config.data.micro_batch_size *
                         config.data.seq_len;
  absl::StrAppend(&line, " | ", tokens, " tokens per step (", world,
                  world == 1 ? " rank" : " ranks", " x ", t.grad_accum,
                  t.grad_accum == 1 ? " microbatch" : " microbatches", " x ",
                  config.data.micro_batch_size, " x ", config.data.seq_len, ") | steps ",
                  first_step, "..", t.steps);
  return line;
}

std::string format_sharding_line(const std::vector<int64_t>& numels, const std::vector<int>& owners,
                                 int world) {
  auto count = [](int64_t n) {
    const double v = static_cast<double>(n);
    return v >= 1e9   ? absl::StrFormat("%.2fB", v / 1e9)
           : v >= 1e6 ? absl::StrFormat("%.1fM", v / 1e6)
           : v >= 1e3 ? absl::StrFormat("%.1fK", v / 1e3)
                      : absl::StrCat(n);
  };
  std::vector<std::string> ranks;
  for (int r = 0; r < world; ++r) {
    int64_t tensors = 0, elements = 0;
    for (size_t i = 0; i < owners.size(); ++i) {
      if (owners[i] != r) continue;
      ++tensors;
      elements += numels[i];
    }
    ranks.push_back(
        absl::StrCat("rank ", r, " owns ", tensors, " tensors, ", count(elements), " elements"));
  }
  return absl::StrCat("optimizer state: sharded over ", world, " ranks (",
                      absl::StrJoin(ranks, "; "), ")");
}

std::string format_policy_line(const ExecutionPolicy& policy,
                               const std::vector<std::string>& from_environment) {
  std::string line = absl::StrCat("execution policy: ", describe_execution_policy(policy));
  if (!from_environment.empty()) {
    std::vector<std::string> variables;
    for (const ExecutionPolicyKey& key : execution_policy_keys()) {
      if (std::find(from_environment.begin(), from_environment.end(), key.key) !=
          from_environment.end()) {
        variables.push_back(key.variable);
      }
    }
    absl::StrAppend(&line, " (from the environment: ", absl::StrJoin(variables, ", "), ")");
  }
  return line;
}

namespace {

// The data's window starts (Note [Document starts] in gdr/data.h) as the model's bounds;
// TokenWindows gives valid ones, so a failure is a bug.
DocumentBounds document_bounds_of(std::vector<std::vector<int64_t>> starts, int64_t length) {
  absl::StatusOr<DocumentBounds> bounds = DocumentBounds::create(std::move(starts), length);
  TORCH_CHECK(bounds.ok(), "trainer: ", bounds.status().message());
  return *std::move(bounds);
}

// How this rank's microbatches of one step run (Note [Overlapped gradient reduction]).
struct MicrobatchPlan {
  size_t count = 0;     // this rank's microbatches
  int64_t divisor = 1;  // world * grad_accum: each backward is of loss / divisor
  // Eager, several ranks: the last backward hands each gradient to OverlappedReduction.
  bool overlap_eager = false;
  // Graphed: the last replay's gradients are summed range by range as they become final.
  bool overlap_graphed = false;
};

// What the microbatches of a step leave for the gradient reduction.
struct LocalGradients {
  // Each microbatch's FP32 gradient is a leaf of the reduction tree (Note [Gradient
  // reduction tree] in gdr/distributed.h); with accum <= 2 and one rank this is exactly
  // autograd's accumulation.
  PairwiseSum tree;
  // Losses stay on the device until the step's end: one host sync per step, not one per
  // microbatch, so the host can queue the next microbatch while the GPU finishes this one.
  std::vector<at::Tensor> losses_on_device;
  std::unique_ptr<OverlappedReduction> overlapped;  // overlap_eager: the cross-rank sum
  std::unique_ptr<RangeAllReduce> ranged;           // overlap_graphed with two ranks
  std::vector<at::Tensor> finished;  // overlap_graphed: the local sums, in params order
};

}  // namespace

struct Trainer::Impl {
  RunConfig config;
  TokenWindows data;
  // The run's kernel and determinism choices (Note [Execution policy]), current on the
  // trainer's thread while it builds the model and runs steps.
  ExecutionPolicy policy;
  std::vector<std::string> policy_from_environment;  // keys a GDR_* variable set
  std::optional<TokenWindows> valid;  // the validation set, when the config names one
  QwenForCausalLM model{nullptr};
  at::Device device{at::kCPU};
  std::vector<std::string> names;
  std::vector<at::Tensor> params;  // the model's, in names order
  // FP32; the same tensors as params for fp32. With sharded optimizer state in bf16, undefined
  // for the parameters this rank does not own (Note [Sharded optimizer state]).
  std::vector<at::Tensor> masters;
  std::unique_ptr<torch::optim::AdamW> optimizer;  // over the owned masters when sharded
  // Note [Sharded optimizer state]: the rank owning each parameter; empty when not sharded.
  std::vector<int> owner;
  int64_t step = 0;
  // Kept from the last step for snapshots.
  std::vector<at::Tensor> last_grads;
  std::vector<double> last_losses;
  std::shared_ptr<ProcessGroup> group;  // null: one process
  // Note [Microbatch graphs] (gdr/microbatch_graphs.h): null when graphs are off or not on
  // CUDA.
  std::unique_ptr<MicrobatchGraphs> graphs;
  int64_t eager_microbatches = 0;  // in this process
  std::string init_line;           // what train.init_from loaded, for the run header
  // Why CUDA graphs are off although train.cuda_graphs asked for them ("" when they are not):
  // run() prints it after the policy line.
  std::string cuda_graphs_off_reason;

  int rank() const { return group ? group->rank() : 0; }
  int world() const { return group ? group->world_size() : 1; }

  bool mixed() const { return config.train.dtype == TrainDtype::kBFloat16; }
  bool sharded() const { return !owner.empty(); }
  bool owns(size_t i) const { return owner.empty() || owner[i] == rank(); }

  // The masters and AdamW state of every parameter as master_parameters() and
  // optimizer_tensors() return them. Sharded: a collective (every rank calls it at the same
  // point), each non-owned parameter's master and state broadcast from its owner, kept as CPU
  // copies when `keep` (else dropped after the transfer, for ranks that only take part).
  absl::Status full_state(bool keep, io::NamedTensors* model_out,
                          io::NamedTensors* optimizer_out) const;
  // Sharded: each owner's updated parameters to every rank (the BF16 params in bf16, the
  // FP32 masters in fp32, which are the params).
  absl::Status broadcast_updated_parameters(int64_t step_number);

  torch::optim::AdamWParamState* adam_state(const at::Tensor& master) const {
    auto it = optimizer->state().find(master.unsafeGetTensorImpl());
    if (it == optimizer->state().end()) return nullptr;
    return static_cast<torch::optim::AdamWParamState*>(it->second.get());
  }

  // The phases of train_step, in the order it runs them.
  void clear_grads();
  // This rank's microbatches and, with data.document_masking, each one's document bounds
  // (Note [Document masking]; `documents` gets one entry per microbatch, empty without).
  std::vector<std::vector<int64_t>> fetch_microbatches(
      std::vector<std::optional<DocumentBounds>>& documents);
  absl::Status check_token_ids(const std::vector<std::vector<int64_t>>& mine,
                               int64_t step_number) const;
  at::Tensor upload(const std::vector<std::vector<int64_t>>& mine) const;
  MicrobatchPlan plan_microbatches(size_t count) const;
  absl::Status run_microbatches(const at::Tensor& step_ids,
                                const std::vector<std::optional<DocumentBounds>>& documents,
                                const MicrobatchPlan& plan, StepStats& stats,
                                LocalGradients& local);
  absl::Status replay_microbatch(size_t k, const at::Tensor& ids, const MicrobatchPlan& plan,
                                 StepStats& stats, LocalGradients& local);
  void eager_microbatch(const at::Tensor& ids, const DocumentBounds* documents, bool hand_over,
                        int64_t divisor, LocalGradients& local);
  void sync_losses(std::chrono::steady_clock::time_point start, LocalGradients& local,
                   StepStats& stats) const;
  absl::StatusOr<std::vector<at::Tensor>> reduce_gradients(LocalGradients& local, StepStats& stats);
  void measure(const std::vector<at::Tensor>& grads, StepStats& stats) const;
  absl::StatusOr<bool> check_finite(const StepStats& stats) const;
  absl::Status clip_and_step(std::vector<at::Tensor>& grads, const StepStats& stats);
  void record(std::vector<at::Tensor> grads, std::chrono::steady_clock::time_point start,
              StepStats& stats);

  // Note [Fused AdamW]: the optimizer tail of a step in one multi-tensor kernel family,
  // gdr::fused_adamw_step_ (ops/fused_adamw/fused_adamw_op.h): per element, the gradient clip (grad
  // *= grad_coef, written back so last_grads holds the clipped gradients), the AdamW update of the
  // FP32 master and its moments, and, in mixed precision, the store of the new master rounded to
  // BF16 into the model's parameter. On CUDA that is one launch (the step is host-bound and the
  // ATen sequence is ~225 launches: _foreach_mul_, _foreach_add_ on per-master step counters,
  // _fused_adamw_, _foreach_copy_) and reads the gradients once; it gives the bits of that ATen
  // sequence, which is what it runs on the CPU. It works on the state torch::optim::AdamW keeps
  // (the integer step of each AdamWParamState is the step count the kernel takes, as a float), so
  // snapshots, checkpoints and resume do not depend on the implementation. Elementwise, hence
  // deterministic. grad_coef: 1 when not clipping.
  void fused_adamw_step(double lr, double grad_coef) {
    const OptimizerConfig& o = config.optimizer;
    // Masters grouped by the step they take (one group in practice: every state is created
    // on the first step and saved and loaded together).
    struct Group {
      std::vector<at::Tensor> masters, grads, avgs, sqs, bf16_params;
    };
    std::map<int64_t, Group> groups;
    for (size_t i = 0; i < masters.size(); ++i) {
      if (!owns(i)) continue;  // Note [Sharded optimizer state]
      const at::Tensor& master = masters[i];
      torch::optim::AdamWParamState* st = adam_state(master);
      if (st == nullptr) {
        auto fresh = std::make_unique<torch::optim::AdamWParamState>();
        fresh->step(0);
        fresh->exp_avg(at::zeros_like(master, at::MemoryFormat::Preserve));
        fresh->exp_avg_sq(at::zeros_like(master, at::MemoryFormat::Preserve));
        st = fresh.get();
        optimizer->state()[master.unsafeGetTensorImpl()] = std::move(fresh);
      }
      st->step(st->step() + 1);
      Group& g = groups[st->step()];
      g.masters.push_back(master);
      g.grads.push_back(master.grad());
      g.avgs.push_back(st->exp_avg());
      g.sqs.push_back(st->exp_avg_sq());
      if (mixed()) g.bf16_params.push_back(params[i]);
    }
    at::NoGradGuard no_grad;
    for (const auto& [step, g] : groups) {
      fused_adamw_step_(g.masters, g.grads, g.avgs, g.sqs, g.bf16_params, lr, o.beta1, o.beta2,
                        o.weight_decay, o.eps, step, grad_coef);
    }
  }
};

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::~Trainer() = default;

// Note [Starting from a Hugging Face checkpoint]: train.init_from fills the model while it
// is still FP32 on the CPU, before it moves to the run's device and dtype, so the FP32
// masters hold the checkpoint's values exactly (BF16 -> FP32 is exact) and a BF16 run's
// parameters equal a BF16 checkpoint bit for bit. The checkpoint's config.json must describe
// the `model:` section's model (load_hf_checkpoint_checked names every differing key); a
// multimodal checkpoint's vision tower and MTP head are skipped. Only the weights come from
// it: the optimizer starts fresh, the step counter at 0, the data order from the seed.
// --resume replaces the weights with the training checkpoint's, so init_from is not compared
// on resume. Every rank reads the file itself; the initial parameter checksum across ranks
// catches ranks that read different files.
absl::StatusOr<std::unique_ptr<Trainer>> Trainer::create(const RunConfig& config,
                                                         std::shared_ptr<ProcessGroup> group) {
  if (group != nullptr && group->world_size() > 1) {
    if (absl::Status s =
            check_same_on_all_ranks(*group, "config hash", sha256_hex(config.config_text));
        !s.ok()) {
      return s;
    }
  }
  std::vector<std::string> policy_from_environment;
  absl::StatusOr<ExecutionPolicy> policy =
      execution_policy_for_run(config, nullptr, &policy_from_environment);
  if (!policy.ok()) return policy.status();
  if (absl::Status s = apply_deterministic_mode(*policy); !s.ok()) return s;
  // Note [Document masking] (models/qwen/document_bounds.h): a masked microbatch slices its
  // rows at its own document starts, so no one captured graph replays every microbatch.
  std::string cuda_graphs_off_reason;
  if (config.data.document_masking && config.train.device == TrainDevice::kCuda &&
      policy->cuda_graphs) {
    policy->cuda_graphs = false;
    cuda_graphs_off_reason =
        "train.cuda_graphs: off for this run: with data.document_masking every microbatch is "
        "sliced at its own document starts, which one captured CUDA graph cannot replay; "
        "microbatches run eagerly";
  }
  const ExecutionPolicyGuard policy_guard(*policy);
  at::Device device(at::kCPU);
  if (config.train.device == TrainDevice::kCuda) {
    if (!at::hasCUDA()) {
      return absl::FailedPreconditionError(absl::StrCat(
          config.source, ": train.device: cuda requested but no CUDA device is available"));
    }
    device = at::Device(at::kCUDA);
  }
  seed_cpu_rng(static_cast<uint64_t>(config.train.seed));
  if (config.train.num_threads > 0) at::set_num_threads(static_cast<int>(config.train.num_threads));
  absl::StatusOr<DataSets> data = open_data_sets(
      config.data, static_cast<uint64_t>(config.train.seed), config.model.eos_token_ids);
  if (!data.ok()) return data.status();

  auto impl =
      std::unique_ptr<Impl>(new Impl{config, std::move(data->train), *policy,
                                     std::move(policy_from_environment), std::move(data->valid)});
  impl->device = device;
  impl->group = std::move(group);
  impl->cuda_graphs_off_reason = std::move(cuda_graphs_off_reason);
  CudaGraphCapture graph_capture = nullptr;  // Note [Microbatch graphs]
  std::string initial_checksum;              // of the masters, before any is released
  if (device.is_cuda() && policy->cuda_graphs) {
    graph_capture = cuda_graph_capture();
    if (graph_capture == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(config.source,
                       ": train.cuda_graphs: true needs a binary linked with //gdr:cuda_graph_cuda "
                       "(tools/train_cuda is); set train.cuda_graphs: false"));
    }
  }
  try {
    impl->model = QwenForCausalLM(config.model);
    if (config.train.init_from.empty()) {
      init_qwen_weights(*impl->model, static_cast<uint64_t>(config.train.seed));
    } else {
      // Note [Starting from a Hugging Face checkpoint]
      absl::StatusOr<HfLoadReport> loaded =
          load_hf_checkpoint_checked(*impl->model, config.train.init_from);
      if (!loaded.ok()) {
        return absl::Status(
            loaded.status().code(),
            absl::StrCat(config.source, ": train.init_from: ", loaded.status().message()));
      }
      impl->init_line = absl::StrCat(
          "initial weights: ", config.train.init_from, " (", loaded->loaded, " tensors",
          loaded->skipped > 0 ? absl::StrCat(", ", loaded->skipped, " of other parts skipped") : "",
          ")");
    }
    impl->model->to(device, impl->mixed() ? at::kBFloat16 : at::kFloat);
    for (const auto& item : impl->model->named_parameters()) {
      impl->names.push_back(item.key());
      impl->params.push_back(item.value());
      impl->masters.push_back(impl->mixed() ? item.value().detach().to(at::kFloat).clone()
                                            : item.value());
    }
    if (impl->world() > 1) initial_checksum = tensors_checksum(impl->masters);
    // Note [Sharded optimizer state]
    if (config.train.shard_optimizer_state && impl->world() > 1) {
      std::vector<int64_t> numels;
      for (const at::Tensor& p : impl->params) numels.push_back(p.numel());
      impl->owner = optimizer_state_owners(numels, impl->world());
    }
    std::vector<at::Tensor> owned;
    for (size_t i = 0; i < impl->masters.size(); ++i) {
      if (impl->owns(i)) {
        owned.push_back(impl->masters[i]);
      } else if (impl->mixed()) {
        impl->masters[i] = at::Tensor();  // the BF16 param is all a non-owner needs
      }
    }
    torch::optim::AdamWOptions options(config.optimizer.lr);
    options.betas({config.optimizer.beta1, config.optimizer.beta2})
        .eps(config.optimizer.eps)
        .weight_decay(config.optimizer.weight_decay);
    impl->optimizer = std::make_unique<torch::optim::AdamW>(owned, options);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(config.source, ": ", e.what_without_backtrace()));
  }
  if (graph_capture != nullptr) {
    Impl* m = impl.get();
    impl->graphs = std::make_unique<MicrobatchGraphs>(
        graph_capture, impl->params, impl->names,
        [m](const at::Tensor& ids) { return m->model->loss(ids, ids); });
  }
  if (impl->world() > 1) {
    if (absl::Status s =
            check_same_on_all_ranks(*impl->group, "initial parameter checksum", initial_checksum);
        !s.ok()) {
      return s;
    }
  }
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

absl::StatusOr<StepStats> Trainer::train_step() {
  const ExecutionPolicyGuard policy(impl_->policy);
  // Torch reports failures (e.g. an op with no deterministic path in deterministic mode)
  // as exceptions; they become errors naming the step.
  try {
    return train_step_or_throw();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("step ", impl_->step + 1, ": ", e.what_without_backtrace()));
  }
}

// One step as a sequence of phases (Trainer::Impl's methods below, in this order): fetch
// this rank's microbatches, check their token ids, upload them, run each microbatch eagerly
// or as a graph replay (adding its gradients to the reduction tree), wait for the losses,
// reduce the gradients (over microbatches, then ranks), measure the norm, stop or skip on
// non-finite values, clip and step the optimizer, and record the step.
absl::StatusOr<StepStats> Trainer::train_step_or_throw() {
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  StepStats stats;
  stats.step = m.step + 1;
  m.clear_grads();

  std::vector<std::optional<DocumentBounds>> documents;
  const std::vector<std::vector<int64_t>> mine = m.fetch_microbatches(documents);
  if (absl::Status s = m.check_token_ids(mine, stats.step); !s.ok()) return s;
  LocalGradients local;
  const at::Tensor step_ids = m.upload(mine);
  const MicrobatchPlan plan = m.plan_microbatches(mine.size());
  if (absl::Status s = m.run_microbatches(step_ids, documents, plan, stats, local); !s.ok()) {
    return s;
  }
  m.sync_losses(start, local, stats);

  absl::StatusOr<std::vector<at::Tensor>> grads = m.reduce_gradients(local, stats);
  if (!grads.ok()) return grads.status();
  m.measure(*grads, stats);
  absl::StatusOr<bool> finite = m.check_finite(stats);
  if (!finite.ok()) return finite.status();
  m.last_losses = stats.microbatch_losses;
  if (*finite) {
    if (absl::Status s = m.clip_and_step(*grads, stats); !s.ok()) return s;
  } else {
    stats.skipped = true;
  }
  m.record(std::move(*grads), start, stats);
  return stats;
}

void Trainer::Impl::clear_grads() {
  for (at::Tensor& p : params) p.mutable_grad().reset();
  for (at::Tensor& p : masters) {
    if (p.defined()) p.mutable_grad().reset();
  }
}

// Global microbatches k = 0 .. world * accum - 1 of this step; rank r trains on
// k = r * accum .. r * accum + accum - 1 (see Trainer::create). Every rank reads them all,
// so the data position stays the same on every rank.
std::vector<std::vector<int64_t>> Trainer::Impl::fetch_microbatches(
    std::vector<std::optional<DocumentBounds>>& documents) {
  const int64_t accum = config.train.grad_accum;
  const int64_t batch = config.data.micro_batch_size;
  const int64_t microbatches = world() * accum;
  const bool masking = config.data.document_masking;
  std::vector<std::vector<int64_t>> mine;
  documents.clear();
  for (int64_t k = 0; k < microbatches; ++k) {
    std::vector<std::vector<int64_t>> starts;
    std::vector<int64_t> b = data.next_batch(batch, masking ? &starts : nullptr);
    if (k / accum != rank()) continue;
    mine.push_back(std::move(b));
    if (masking) documents.push_back(document_bounds_of(std::move(starts), data.window_length()));
  }
  return mine;
}

namespace {

// The first token id of `rows` outside [0, vocab): its row, its position in the row, the id.
struct BadToken {
  size_t row = 0;
  size_t position = 0;
  int64_t id = 0;
};
std::optional<BadToken> first_out_of_vocabulary(const std::vector<std::vector<int64_t>>& rows,
                                                int64_t vocab) {
  for (size_t r = 0; r < rows.size(); ++r) {
    for (size_t i = 0; i < rows[r].size(); ++i) {
      if (rows[r][i] < 0 || rows[r][i] >= vocab) return BadToken{r, i, rows[r][i]};
    }
  }
  return std::nullopt;
}

}  // namespace

// Note [Token id check]: every id must index the embedding and the loss's vocabulary.
// Checked here on the host, where it costs nothing, because on the GPU an
// out-of-range id is a device-side assert in the embedding (the process dies with no
// useful message) and the fused loss does not check its targets (Note [Cross-entropy
// target check]).
absl::Status Trainer::Impl::check_token_ids(const std::vector<std::vector<int64_t>>& mine,
                                            int64_t step_number) const {
  const int64_t vocab = config.model.vocab_size;
  const std::optional<BadToken> bad = first_out_of_vocabulary(mine, vocab);
  if (!bad.has_value()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "step ", step_number, ": token id ", bad->id, " at position ", bad->position,
      " of microbatch ", rank() * config.train.grad_accum + static_cast<int64_t>(bad->row) + 1,
      " is outside the vocabulary [0, ", vocab, ") of model.vocab_size; check that the data (",
      config.data.source == DataSource::kEmbedded ? config.data.path : config.data.prefix,
      ") was tokenized for this model"));
}

// All of this rank's token windows in one upload, [microbatches, batch, window]. On CUDA
// from pinned memory without blocking: a copy from pageable memory (what Tensor::to does
// with a std::vector's tensor) synchronises the stream first, so every microbatch used to
// start with the GPU drained and idle while the host queued its first kernels.
at::Tensor Trainer::Impl::upload(const std::vector<std::vector<int64_t>>& mine) const {
  const int64_t batch = config.data.micro_batch_size;
  const int64_t window = data.window_length();
  at::Tensor step_ids = at::empty({static_cast<int64_t>(mine.size()), batch, window}, at::kLong);
  for (size_t k = 0; k < mine.size(); ++k) {
    std::copy(mine[k].begin(), mine[k].end(),
              step_ids.data_ptr<int64_t>() + static_cast<int64_t>(k) * batch * window);
  }
  if (device.is_cuda()) step_ids = step_ids.pin_memory().to(device, /*non_blocking=*/true);
  return step_ids;
}

// Note [Overlapped gradient reduction]: with train.overlap_grad_reduction, the last
// microbatch's backward hands each parameter's final local sum to the cross-rank
// reduction as soon as autograd produces its gradient.
// Graphed (Note [Microbatch graphs]): after the last replay is queued, a side stream
// waits for each 256 MiB range's mark (Note [Graph marks]), last parameters first as
// backward produces them, and adds the range's final local sums while the replay's
// backward goes on with earlier layers; with two ranks each range then goes to
// RangeAllReduce, so its transfer overlaps the rest of the backward too. With more
// ranks the reduction runs after the loop. (Handing the gradients over from an eager
// last backward cost more host and GPU time than the overlap hid: docs/benchmarks.md,
// Decisions.) Eager runs with several ranks hand over from the last backward's hooks.
MicrobatchPlan Trainer::Impl::plan_microbatches(size_t count) const {
  MicrobatchPlan plan;
  plan.count = count;
  plan.divisor = world() * config.train.grad_accum;
  plan.overlap_eager = world() > 1 && config.train.overlap_grad_reduction && graphs == nullptr;
  plan.overlap_graphed = config.train.overlap_grad_reduction && graphs != nullptr && count >= 2;
  return plan;
}

// Each microbatch, in order: a graph replay once a microbatch has run eagerly in this
// process (Note [Microbatch graphs]), except the eager hand-over one; else eagerly.
absl::Status Trainer::Impl::run_microbatches(
    const at::Tensor& step_ids, const std::vector<std::optional<DocumentBounds>>& documents,
    const MicrobatchPlan& plan, StepStats& stats, LocalGradients& local) {
  const int64_t batch = config.data.micro_batch_size;
  const int64_t window = data.window_length();
  for (size_t k = 0; k < plan.count; ++k) {
    const at::Tensor ids = step_ids[static_cast<int64_t>(k)];
    const bool hand_over = plan.overlap_eager && k + 1 == plan.count;
    stats.tokens += batch * (window - 1);
    // Masked microbatches never replay: graphs are off with data.document_masking.
    const DocumentBounds* bounds = documents.empty() ? nullptr : &*documents[k];
    if (!hand_over && graphs != nullptr && eager_microbatches > 0 && bounds == nullptr) {
      if (absl::Status s = replay_microbatch(k, ids, plan, stats, local); !s.ok()) return s;
    } else {
      eager_microbatch(ids, bounds, hand_over, plan.divisor, local);
    }
  }
  return absl::OkStatus();
}

// See Note [Microbatch graphs]: captures every position at the first graphed microbatch, then
// replays microbatch k's graph and hands its gradients to the tree.
absl::Status Trainer::Impl::replay_microbatch(size_t k, const at::Tensor& ids,
                                              const MicrobatchPlan& plan, StepStats& stats,
                                              LocalGradients& local) {
  if (!graphs->captured()) {
    if (absl::Status status = graphs->capture(ids, plan.count, plan.divisor, plan.overlap_graphed);
        !status.ok()) {
      return absl::InternalError(absl::StrCat("step ", stats.step, ": ", status.message()));
    }
  }
  MicrobatchGraph& g = graphs->replay(k, plan.count, ids);
  ++stats.graph_replays;
  local.losses_on_device.push_back(g.loss.detach().reshape({1}).clone());
  if (plan.overlap_graphed && !g.ranges.empty() && k + 1 == plan.count) {
    if (world() == 2) local.ranged = std::make_unique<RangeAllReduce>(*group);
    local.finished = g.sum_ranges_when_final(local.tree, local.ranged.get());
    return absl::OkStatus();
  }
  // Kept, not copied: graph k mod positions replays again only after the tree has summed
  // this leaf's group (Note [Microbatch graphs]).
  local.tree.add_kept(g.leaf);
  return absl::OkStatus();
}

// Forward, loss and backward of loss / divisor; the gradients (widened to FP32) become a
// leaf of the tree. With `hand_over` each parameter's final local sum goes to the
// cross-rank reduction from a hook as backward produces it (Note [Overlapped gradient
// reduction]).
void Trainer::Impl::eager_microbatch(const at::Tensor& ids, const DocumentBounds* documents,
                                     bool hand_over, int64_t divisor, LocalGradients& local) {
  ++eager_microbatches;
  const at::Tensor loss = documents ? model->loss(ids, ids, *documents) : model->loss(ids, ids);
  std::vector<unsigned> hooks;
  if (hand_over) {
    std::vector<std::vector<int64_t>> shapes;
    for (const at::Tensor& p : params) shapes.push_back(p.sizes().vec());
    local.overlapped = std::make_unique<OverlappedReduction>(
        *group, shapes, at::TensorOptions().dtype(at::kFloat).device(device));
    for (size_t i = 0; i < params.size(); ++i) {
      hooks.push_back(params[i].register_hook([this, &local, i](at::Tensor grad) {
        local.overlapped->set(i,
                              local.tree.finish_with_last(i, mixed() ? grad.to(at::kFloat) : grad));
      }));
    }
  }
  (loss / static_cast<double>(divisor)).backward();
  for (size_t i = 0; i < hooks.size(); ++i) params[i].remove_hook(hooks[i]);
  local.losses_on_device.push_back(loss.detach().reshape({1}));
  if (hand_over) {
    for (at::Tensor& p : params) p.mutable_grad().reset();
    return;
  }
  std::vector<at::Tensor> leaf;
  for (at::Tensor& p : params) {
    leaf.push_back(mixed() ? p.grad().to(at::kFloat) : p.grad());
    p.mutable_grad().reset();
  }
  local.tree.add(std::move(leaf));
}

// Note [Host-bound steps]: the loss copy below is the step's first wait on the device.
// The host time up to it is spent queueing work (autograd, dispatch, launches); the
// wait is what the GPU still had to do. A wait near zero means the GPU finished before
// the host had queued everything: the step is host-bound, and faster kernels will not
// shorten it (metrics.jsonl: host_queue_s, gpu_wait_s).
void Trainer::Impl::sync_losses(std::chrono::steady_clock::time_point start, LocalGradients& local,
                                StepStats& stats) const {
  const auto sync_start = std::chrono::steady_clock::now();
  stats.host_queue_s = std::chrono::duration<double>(sync_start - start).count();
  // float -> double is exact, so these are the values loss.item<double>() would give.
  const at::Tensor host = at::cat(local.losses_on_device).to(at::kCPU, at::kDouble);
  stats.gpu_wait_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - sync_start).count();
  const double* p = host.data_ptr<double>();
  stats.microbatch_losses.assign(p, p + host.numel());
}

// The step's gradients, summed over this rank's microbatches and then over ranks, set as
// the masters' .grad (the returned tensors alias them). Under data parallelism the losses
// are gathered too: stats.microbatch_losses becomes every rank's, in global order.
absl::StatusOr<std::vector<at::Tensor>> Trainer::Impl::reduce_gradients(LocalGradients& local,
                                                                        StepStats& stats) {
  std::vector<at::Tensor> grads;
  const auto reduce_start = std::chrono::steady_clock::now();
  if (local.ranged != nullptr) {
    if (absl::Status s = local.ranged->finish(); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("step ", stats.step, ": ", s.message()));
    }
    grads = std::move(local.finished);
  } else if (!local.finished.empty()) {
    grads = std::move(local.finished);
  } else if (local.overlapped != nullptr) {
    absl::StatusOr<std::vector<at::Tensor>> reduced = local.overlapped->finish();
    if (!reduced.ok()) {
      return absl::UnavailableError(
          absl::StrCat("step ", stats.step, ": ", reduced.status().message()));
    }
    grads = std::move(*reduced);
  } else {
    grads = local.tree.finish();
  }
  for (size_t i = 0; i < masters.size(); ++i) {
    if (masters[i].defined()) masters[i].mutable_grad() = grads[i];
  }
  if (world() > 1) {
    std::vector<std::vector<double>> losses;
    // Overlapped: the gradients are reduced already; only the losses are gathered.
    const std::vector<at::Tensor> to_reduce =
        local.overlapped != nullptr || local.ranged != nullptr ? std::vector<at::Tensor>{} : grads;
    if (absl::Status s = group->all_reduce_sum(to_reduce, stats.microbatch_losses, &losses);
        !s.ok()) {
      return absl::UnavailableError(absl::StrCat("step ", stats.step, ": ", s.message()));
    }
    stats.reduce_time_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - reduce_start).count();
    stats.microbatch_losses.clear();  // all of them, in global order
    for (int r = 0; r < world(); ++r) {
      for (double l : losses[r]) stats.microbatch_losses.push_back(l);
    }
    stats.tokens *= world();
  }
  return grads;
}

// The step's gradient norm, mean loss and learning rate.
void Trainer::Impl::measure(const std::vector<at::Tensor>& grads, StepStats& stats) const {
  // Global L2 norm: per-tensor FP32 norms, then the norm of those, in a fixed order. One
  // multi-tensor op (on CUDA a few launches of per-chunk partials summed in chunk order:
  // no atomics, so deterministic) instead of one reduction launch per tensor (321 in the
  // 0.8B model, slower: docs/benchmarks.md, Other kernels in the 0.8B step); on the CPU it
  // is the per-tensor norm.
  const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2);
  stats.grad_norm = at::stack(norms).norm().item<double>();
  double loss_sum = 0;
  for (double l : stats.microbatch_losses) loss_sum += l;
  stats.loss = loss_sum / static_cast<double>(stats.microbatch_losses.size());
  stats.lr = learning_rate_at(config, stats.step);
}

// True when every loss and the gradient norm are finite; false when not and
// train.on_nonfinite is skip; Aborted, naming the first non-finite value, when it is stop.
absl::StatusOr<bool> Trainer::Impl::check_finite(const StepStats& stats) const {
  std::string nonfinite;
  for (size_t i = 0; i < stats.microbatch_losses.size(); ++i) {
    if (!std::isfinite(stats.microbatch_losses[i]) && nonfinite.empty()) {
      nonfinite = absl::StrCat("non-finite loss ", stats.microbatch_losses[i], " in microbatch ",
                               i + 1, " of ", stats.microbatch_losses.size());
    }
  }
  if (nonfinite.empty() && !std::isfinite(stats.grad_norm)) {
    nonfinite = absl::StrCat("non-finite gradient norm ", stats.grad_norm);
  }
  if (!nonfinite.empty() && config.train.on_nonfinite == OnNonfinite::kStop) {
    return absl::AbortedError(absl::StrCat("step ", stats.step, ": ", nonfinite,
                                           "; stopping (train.on_nonfinite: stop)"));
  }
  return nonfinite.empty();
}

// Clips the gradients to optimizer.grad_clip and takes the optimizer step at stats.lr;
// `grads` alias the masters' .grad.
absl::Status Trainer::Impl::clip_and_step(std::vector<at::Tensor>& grads, const StepStats& stats) {
  const double clip = config.optimizer.grad_clip;
  // One scale factor computed on the host: the same bits however the grads are laid out.
  double coef = 1.0;
  if (clip > 0) coef = std::min(1.0, clip / (stats.grad_norm + 1e-6));
  if (config.optimizer.impl == OptimizerImpl::kFused) {
    // Clips the grads (they alias the masters' .grad), updates the masters and, in mixed
    // precision, writes the BF16 params (Note [Fused AdamW]). Sharded: the owned ones.
    fused_adamw_step(stats.lr, coef);
    if (sharded() && coef < 1.0) {
      // The other gradients clipped too, so snapshots record what the replicated run's do.
      std::vector<at::Tensor> others;
      for (size_t i = 0; i < grads.size(); ++i) {
        if (!owns(i)) others.push_back(grads[i]);
      }
      at::NoGradGuard no_grad;
      if (!others.empty()) at::_foreach_mul_(others, coef);
    }
  } else {
    at::NoGradGuard no_grad;
    if (coef < 1.0) at::_foreach_mul_(grads, coef);  // grads alias the masters' .grad
    for (auto& param_group : optimizer->param_groups()) {
      static_cast<torch::optim::AdamWOptions&>(param_group.options()).lr(stats.lr);
    }
    optimizer->step();  // the owned masters only when sharded: the optimizer holds no others
    if (mixed()) {
      std::vector<at::Tensor> owned_params, owned_masters;
      for (size_t i = 0; i < params.size(); ++i) {
        if (!owns(i)) continue;
        owned_params.push_back(params[i]);
        owned_masters.push_back(masters[i]);
      }
      if (!owned_params.empty()) at::_foreach_copy_(owned_params, owned_masters);
    }
  }
  if (sharded()) return broadcast_updated_parameters(stats.step);
  return absl::OkStatus();
}

// Note [Sharded optimizer state] (train.shard_optimizer_state, ZeRO stage 1): with W > 1
// ranks each parameter has one owner, optimizer_state_owners (gdr/distributed.h) of the
// parameters' sizes in named_parameters order, the same plan on every rank. Every rank still
// gets the full summed gradients (Note [Gradient reduction tree]) and computes the gradient
// norm and clip factor from them as before; only the owner steps a parameter (both
// optimizer.impl paths are given the owned masters alone) and keeps its AdamW moments and, in
// bf16, its FP32 master: a non-owner keeps the BF16 parameter only. After the step each
// owner's updated parameters are broadcast to all ranks (ProcessGroup::broadcast: the bytes
// of the FP32 parameters, which are the masters, in fp32; of the BF16 parameters in bf16),
// in rank order. AdamW is elementwise, so the owner computes exactly the bits a replicated
// run computes, and the sharded run is byte-identical to it: train.shard_optimizer_state
// may change on resume. Checkpoints and snapshots keep their format (the full state):
// full_state gathers each non-owned master and state from its owner, tensor by tensor, as
// CPU copies; resume reads the whole checkpoint on every rank and keeps the owned moments
// and masters. The step's microbatch graphs (Note [Microbatch graphs]) are unaffected: the
// optimizer step and the broadcast run outside them and write the parameters in place.
// Memory per parameter with W ranks: AdamW moments 8 B / W, in bf16 FP32 masters 4 B / W,
// plus the replicated parameters, gradients and FP32 reduced gradients.
absl::Status Trainer::Impl::broadcast_updated_parameters(int64_t step_number) {
  for (int r = 0; r < world(); ++r) {
    std::vector<at::Tensor> mine;
    for (size_t i = 0; i < params.size(); ++i) {
      if (owner[i] == r) mine.push_back(params[i]);
    }
    if (absl::Status s = group->broadcast(mine, r); !s.ok()) {
      return absl::UnavailableError(
          absl::StrCat("step ", step_number, ": sharded optimizer state: ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status Trainer::Impl::full_state(bool keep, io::NamedTensors* model_out,
                                       io::NamedTensors* optimizer_out) const {
  for (size_t i = 0; i < names.size(); ++i) {
    const std::string& name = names[i];
    const bool local = owns(i);
    at::Tensor master;
    bool has_state = false;
    int64_t step_count = 0;
    at::Tensor avg, sq;
    if (local) {
      master = masters[i].detach();
      if (const torch::optim::AdamWParamState* st = adam_state(masters[i]); st != nullptr) {
        has_state = true;
        step_count = st->step();
        avg = st->exp_avg();
        sq = st->exp_avg_sq();
      }
    }
    if (sharded()) {
      // One buffer per parameter: {has_state, step} as int64, exp_avg, exp_avg_sq, master (FP32).
      const int64_t n = params[i].numel();
      const at::TensorOptions bytes = at::TensorOptions().dtype(at::kByte).device(device);
      at::Tensor buffer;
      if (local) {
        const at::Tensor header =
            at::tensor(std::vector<int64_t>{has_state ? 1 : 0, step_count}, at::kLong).to(device);
        const at::Tensor zeros =
            at::zeros({n}, at::TensorOptions().dtype(at::kFloat).device(device));
        std::vector<at::Tensor> pieces{header.view(at::kByte)};
        for (const at::Tensor& t : {has_state ? avg : zeros, has_state ? sq : zeros, master}) {
          pieces.push_back(t.contiguous().reshape({-1}).view(at::kByte));
        }
        buffer = at::cat(pieces);
      } else {
        buffer = at::empty({16 + 3 * 4 * n}, bytes);
      }
      if (absl::Status s = group->broadcast({buffer}, owner[i]); !s.ok()) {
        return absl::UnavailableError(
            absl::StrCat("gathering the sharded optimizer state: ", s.message()));
      }
      if (!local) {
        if (!keep) continue;
        const at::Tensor host = buffer.cpu();
        const at::Tensor header = host.narrow(0, 0, 16).view(at::kLong);
        has_state = header[0].item<int64_t>() != 0;
        step_count = header[1].item<int64_t>();
        auto piece = [&](int k) {
          return host.narrow(0, 16 + k * 4 * n, 4 * n)
              .view(at::kFloat)
              .clone()
              .view(params[i].sizes());
        };
        avg = piece(0);
        sq = piece(1);
        master = piece(2);
      }
    }
    if (!keep) continue;
    if (model_out != nullptr) model_out->emplace_back(name, master);
    if (optimizer_out != nullptr && has_state) {
      optimizer_out->emplace_back(name + ".exp_avg", avg);
      optimizer_out->emplace_back(name + ".exp_avg_sq", sq);
      optimizer_out->emplace_back(name + ".step", at::scalar_tensor(step_count, at::kLong));
    }
  }
  return absl::OkStatus();
}

// Keeps the gradients the optimizer consumed for write_snapshot (the optimizer reads them
// and does not write them, so no copy is needed), clears every .grad, advances the step
// count and times the step.
void Trainer::Impl::record(std::vector<at::Tensor> grads,
                           std::chrono::steady_clock::time_point start, StepStats& stats) {
  last_grads = std::move(grads);
  clear_grads();
  step = stats.step;
  stats.step_time_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats.tokens_per_s = stats.step_time_s > 0 ? stats.tokens / stats.step_time_s : 0;
}

io::NamedTensors Trainer::master_parameters() const {
  io::NamedTensors out;
  const absl::Status s = impl_->full_state(true, &out, nullptr);
  TORCH_CHECK(s.ok(), s.ToString());
  return out;
}

io::NamedTensors Trainer::optimizer_tensors() const {
  io::NamedTensors out;
  const absl::Status s = impl_->full_state(true, nullptr, &out);
  TORCH_CHECK(s.ok(), s.ToString());
  return out;
}

OptimizerStateHeld Trainer::optimizer_state_held() const {
  OptimizerStateHeld held;
  for (size_t i = 0; i < impl_->masters.size(); ++i) {
    const at::Tensor& master = impl_->masters[i];
    if (!master.defined()) continue;
    if (impl_->mixed()) {
      ++held.master_tensors;
      held.master_elements += master.numel();
    }
    if (const torch::optim::AdamWParamState* st = impl_->adam_state(master); st != nullptr) {
      ++held.moment_tensors;
      held.moment_elements += st->exp_avg().numel();
    }
  }
  return held;
}

namespace {

// A resumed run must compute what the saved run would have: its execution policy may differ
// only in choices that give the same bits (ExecutionPolicyKey::same_bits). Checkpoints
// written before the policy existed ("") are not checked.
absl::Status check_same_bits_policy(const std::string& saved, const ExecutionPolicy& current,
                                    const std::string& step_dir) {
  if (saved.empty()) return absl::OkStatus();
  std::vector<std::string> differing;
  for (const std::string& key :
       execution_policy_differences(saved, describe_execution_policy(current))) {
    bool same_bits = false;
    for (const ExecutionPolicyKey& k : execution_policy_keys()) {
      if (k.key == key) same_bits = k.same_bits;
    }
    if (!same_bits) differing.push_back(key);
  }
  if (differing.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      step_dir, ": the checkpoint was written under a different execution policy (",
      absl::StrJoin(differing, ", "),
      "; from the run config's kernels: section or GDR_* variables); resuming would not "
      "continue the same run (allow_config_change overrides this)"));
}

}  // namespace

Checkpoint Trainer::capture() const {
  Checkpoint c;
  const absl::Status s = impl_->full_state(true, &c.model, &c.optimizer);
  TORCH_CHECK(s.ok(), s.ToString());
  c.state.step = impl_->step;
  c.state.data_position = impl_->data.position();
  c.state.rng_cpu_hex = hex_encode(cpu_rng_state());
  c.state.config_text = impl_->config.config_text;
  c.state.execution_policy = describe_execution_policy(impl_->policy);
  return c;
}

absl::Status Trainer::save_checkpoint(const std::string& step_dir) const {
  if (impl_->sharded() && impl_->rank() != 0) {
    // Takes part in gathering the state only (Note [Sharded optimizer state]).
    return impl_->full_state(false, nullptr, nullptr);
  }
  try {
    return write_checkpoint(step_dir, capture());
  } catch (const c10::Error& e) {
    return absl::UnavailableError(e.what_without_backtrace());
  }
}

absl::Status Trainer::resume(const std::string& dir, bool allow_config_change) {
  absl::StatusOr<std::string> step_dir = resolve_checkpoint_dir(dir);
  if (!step_dir.ok()) return step_dir.status();
  absl::StatusOr<Checkpoint> ckpt = read_checkpoint(*step_dir);
  if (!ckpt.ok()) return ckpt.status();
  Impl& m = *impl_;
  if (!allow_config_change) {
    absl::StatusOr<std::vector<std::string>> differing = resume_config_differences(
        ckpt->state.config_text, *step_dir + "/state.json: config", m.config);
    if (!differing.ok()) return differing.status();
    if (!differing->empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          *step_dir, ": the checkpoint was written with a different config (",
          absl::StrJoin(*differing, ", "),
          "); resuming would not continue the same run (allow_config_change overrides this)"));
    }
    if (absl::Status s = check_same_bits_policy(ckpt->state.execution_policy, m.policy, *step_dir);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s =
          io::check_tensor_specs(io::specs_of(ckpt->model), io::specs_of(master_parameters()),
                                 *step_dir + "/model.safetensors");
      !s.ok()) {
    return s;
  }
  // Validate everything first, then change state: a refused checkpoint leaves the trainer
  // as it was.
  std::map<std::string, at::Tensor> weights, opt;
  for (auto& [name, t] : ckpt->model) weights[name] = t;
  for (auto& [name, t] : ckpt->optimizer) opt[name] = t;
  absl::StatusOr<at::Tensor> rng = hex_decode(ckpt->state.rng_cpu_hex);
  if (!rng.ok()) return rng.status();
  if (rng->numel() != cpu_rng_state().numel()) {
    return absl::DataLossError(absl::StrCat(*step_dir, "/state.json: rng_cpu: expected ",
                                            cpu_rng_state().numel(), " bytes but got ",
                                            rng->numel()));
  }
  if (ckpt->state.data_position.index >= m.data.num_windows() ||
      ckpt->state.data_position.index < 0 || ckpt->state.data_position.epoch < 0) {
    return absl::DataLossError(
        absl::StrCat(*step_dir, "/state.json: data_position {epoch ",
                     ckpt->state.data_position.epoch, ", index ", ckpt->state.data_position.index,
                     "} is outside the data set (", m.data.num_windows(), " windows per epoch)"));
  }
  std::vector<std::unique_ptr<torch::optim::AdamWParamState>> states(m.names.size());
  for (size_t i = 0; i < m.names.size(); ++i) {
    const std::string& name = m.names[i];
    const auto avg = opt.find(name + ".exp_avg");
    if (avg == opt.end()) continue;  // saved before the first step
    const auto sq = opt.find(name + ".exp_avg_sq");
    const auto step = opt.find(name + ".step");
    if (sq == opt.end() || step == opt.end() || avg->second.sizes() != m.params[i].sizes() ||
        sq->second.sizes() != m.params[i].sizes() || avg->second.scalar_type() != at::kFloat ||
        sq->second.scalar_type() != at::kFloat || step->second.numel() != 1) {
      return absl::DataLossError(absl::StrCat(*step_dir, "/optimizer.safetensors: ", name,
                                              ": expected FP32 exp_avg and exp_avg_sq shaped "
                                              "like the parameter and a scalar step"));
    }
    if (!m.owns(i)) continue;  // Note [Sharded optimizer state]: the owner keeps it
    states[i] = std::make_unique<torch::optim::AdamWParamState>();
    states[i]->step(step->second.item<int64_t>());
    states[i]->exp_avg(avg->second.to(m.device).clone());
    states[i]->exp_avg_sq(sq->second.to(m.device).clone());
  }

  at::NoGradGuard no_grad;
  m.optimizer->state().clear();
  for (size_t i = 0; i < m.names.size(); ++i) {
    // BF16 params: the FP32 weights rounded, as copying from the master does.
    if (m.masters[i].defined()) m.masters[i].copy_(weights.at(m.names[i]));
    if (m.mixed()) m.params[i].copy_(weights.at(m.names[i]));
    if (states[i] != nullptr) {
      m.optimizer->state()[m.masters[i].unsafeGetTensorImpl()] = std::move(states[i]);
    }
  }
  if (absl::Status s = m.data.set_position(ckpt->state.data_position); !s.ok()) return s;
  try {
    set_cpu_rng_state(*rng);
  } catch (const c10::Error& e) {
    return absl::DataLossError(
        absl::StrCat(*step_dir, "/state.json: rng_cpu: ", e.what_without_backtrace()));
  }
  m.step = ckpt->state.step;
  if (m.world() > 1) {
    // Every rank read the checkpoint itself: make sure they all read the same one.
    // Of the checkpoint's weights (the masters' values, also where a rank keeps none).
    std::vector<at::Tensor> read;
    for (const std::string& name : m.names) read.push_back(weights.at(name));
    return check_same_on_all_ranks(*m.group, "resumed parameter checksum", tensors_checksum(read));
  }
  return absl::OkStatus();
}

// Note [State snapshots]: the evidence the state-equality protocol compares (see
// /work/shared/design/determinism.md). After step N, snapshot_dir/step_N/ holds
//   snapshot.safetensors: "loss/microbatch" F32 [M] and "loss/mean" F32 [] (the step's
//     losses), "param/<name>" FP32 masters after the step, "grad/<name>" the FP32 gradients
//     the optimizer consumed (accumulated over the microbatches, after clipping),
//     "adam/<name>.exp_avg|exp_avg_sq|step" after the step, "rng/cpu" U8 generator state,
//     "data/position" I64 [2] = {epoch, index} of the next window;
//   snapshot.json: step, losses, data position and the execution policy as text for people
//   to read.
// Nothing time-dependent is written, so equal runs give byte-equal directories.
absl::Status Trainer::write_snapshot(const std::string& dir) const {
  const Impl& m = *impl_;
  io::NamedTensors tensors;
  std::vector<float> losses(m.last_losses.begin(), m.last_losses.end());
  double sum = 0;
  for (double l : m.last_losses) sum += l;
  tensors.emplace_back("loss/microbatch", at::tensor(losses, at::kFloat));
  tensors.emplace_back("loss/mean",
                       at::scalar_tensor(sum / std::max<size_t>(1, losses.size()), at::kFloat));
  io::NamedTensors model, optimizer;
  if (absl::Status s = m.full_state(true, &model, &optimizer); !s.ok()) return s;
  for (auto& [name, t] : model) tensors.emplace_back("param/" + name, t);
  for (size_t i = 0; i < m.last_grads.size(); ++i) {
    tensors.emplace_back("grad/" + m.names[i], m.last_grads[i]);
  }
  for (auto& [name, t] : optimizer) tensors.emplace_back("adam/" + name, t);
  tensors.emplace_back("rng/cpu", cpu_rng_state());
  tensors.emplace_back("data/position", at::tensor(std::vector<int64_t>{m.data.position().epoch,
                                                                        m.data.position().index},
                                                   at::kLong));
  const std::string step_dir = io::join_path(dir, absl::StrCat("step_", m.step));
  std::error_code ec;
  std::filesystem::create_directories(step_dir, ec);
  if (ec) return absl::InternalError(absl::StrCat(step_dir, ": ", ec.message()));
  if (absl::Status s =
          io::write_safetensors(io::join_path(step_dir, "snapshot.safetensors"), tensors);
      !s.ok()) {
    return s;
  }
  nlohmann::ordered_json json = {
      {"step", m.step},
      {"microbatch_losses", m.last_losses},
      {"data_position", {{"epoch", m.data.position().epoch}, {"index", m.data.position().index}}},
      {"execution_policy", describe_execution_policy(m.policy)},
  };
  return io::write_file_atomically(io::join_path(step_dir, "snapshot.json"), json.dump(2) + "\n");
}

absl::Status Trainer::run(std::ostream& log) {
  const TrainConfig& tc = impl_->config.train;
  const bool rank0 = impl_->rank() == 0;
  std::string snapshot_dir = tc.snapshot_dir;
  if (!rank0 && !snapshot_dir.empty()) snapshot_dir += absl::StrCat(".rank", impl_->rank());
  std::ofstream metrics;
  if (rank0 && !tc.metrics_path.empty()) {
    const std::string parent = io::dirname_of(tc.metrics_path);
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    metrics.open(tc.metrics_path, std::ios::app);
    if (!metrics) {
      return absl::FailedPreconditionError(
          absl::StrCat(tc.metrics_path, ": cannot open the metrics file for appending"));
    }
  }
  if (rank0 && impl_->step < tc.steps) {
    int64_t parameters = 0;
    for (const at::Tensor& p : impl_->params) parameters += p.numel();
    log << format_run_header(impl_->config, impl_->policy, parameters, impl_->world(),
                             impl_->step + 1)
        << std::endl
        << format_policy_line(impl_->policy, impl_->policy_from_environment) << std::endl;
    if (impl_->sharded()) {
      std::vector<int64_t> numels;
      for (const at::Tensor& p : impl_->params) numels.push_back(p.numel());
      log << format_sharding_line(numels, impl_->owner, impl_->world()) << std::endl;
    }
    if (!impl_->init_line.empty() && impl_->step == 0) log << impl_->init_line << std::endl;
    if (!impl_->cuda_graphs_off_reason.empty()) log << impl_->cuda_graphs_off_reason << std::endl;
    for (const std::string& name : unknown_gdr_environment_variables()) {
      log << "warning: " << name << " is set but no part of gdr reads it (a misspelt switch?)"
          << std::endl;
    }
  }
  bool first_step = true;
  while (impl_->step < tc.steps) {
    absl::StatusOr<StepStats> stats = train_step();
    if (!stats.ok()) return stats.status();
    if (first_step && impl_->sharded()) {
      // Every rank: what it holds, the evidence that the state is sharded.
      const OptimizerStateHeld held = optimizer_state_held();
      log << "rank " << impl_->rank() << " holds AdamW moments of " << held.moment_tensors
          << " tensors (" << held.moment_elements << " elements)";
      if (impl_->mixed()) {
        log << " and FP32 masters of " << held.master_tensors << " tensors ("
            << held.master_elements << " elements)";
      }
      log << std::endl;
    }
    first_step = false;
    if (rank0 && (stats->step % tc.log_every == 0 || stats->step == tc.steps)) {
      log << format_progress_line(*stats, tc.steps) << std::endl;
    }
    if (metrics.is_open()) {
      nlohmann::ordered_json line = {
          {"step", stats->step},
          {"loss", stats->loss},
          {"microbatch_losses", stats->microbatch_losses},
          {"lr", stats->lr},
          {"grad_norm", stats->grad_norm},
          {"tokens", stats->tokens},
          {"tokens_per_s", stats->tokens_per_s},
          {"step_time_s", stats->step_time_s},
          {"reduce_time_s", stats->reduce_time_s},
          {"host_queue_s", stats->host_queue_s},
          {"gpu_wait_s", stats->gpu_wait_s},
          {"graph_replays", stats->graph_replays},
          {"skipped", stats->skipped},
      };
      metrics << line.dump() << "\n" << std::flush;
    }
    if (!snapshot_dir.empty()) {
      if (absl::Status s = write_snapshot(snapshot_dir); !s.ok()) return s;
    }
    const int64_t every = tc.eval_every;
    if (every > 0 && (stats->step % every == 0 || stats->step == tc.steps)) {
      absl::StatusOr<EvalStats> eval = evaluate();
      if (!eval.ok()) return eval.status();
      if (rank0) log << format_eval_line(*eval) << std::endl;
      if (metrics.is_open()) {
        nlohmann::ordered_json line = {{"step", eval->step},
                                       {"eval_loss", eval->loss},
                                       {"eval_perplexity", eval->perplexity},
                                       {"eval_batches", eval->batches},
                                       {"eval_tokens", eval->tokens},
                                       {"eval_time_s", eval->time_s}};
        metrics << line.dump() << "\n" << std::flush;
      }
    }
    const bool periodic = tc.checkpoint_every > 0 && stats->step % tc.checkpoint_every == 0;
    // Sharded: every rank takes part in gathering the state; rank 0 writes it.
    if ((rank0 || impl_->sharded()) && !tc.checkpoint_dir.empty() &&
        (periodic || stats->step == tc.steps)) {
      const std::string dir = checkpoint_step_dir(tc.checkpoint_dir, stats->step);
      const auto save_start = std::chrono::steady_clock::now();
      if (absl::Status s = save_checkpoint(dir); !s.ok()) return s;
      if (!rank0) continue;
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - save_start).count();
      // A multi-GB write stalls training for seconds: say how long, so it is not mistaken
      // for a hang or a slow step.
      log << "checkpoint " << dir << " written in " << absl::StrFormat("%.1f", seconds) << " s"
          << std::endl;
    }
  }
  return absl::OkStatus();
}

// Note [Evaluation]: evaluation reads its own windows (DataSets::valid, in index order) and
// runs the model's forward and loss under NoGradGuard, eagerly (never from the microbatch
// graphs), on the trainer's thread with the run's execution policy, then syncs once for the
// losses. It draws from no generator and leaves the training data position, the parameters,
// gradients and optimizer state alone, so a run with evaluation computes the same bits as
// one without (//tests/gdr:trainer_test compares them).
absl::StatusOr<EvalStats> Trainer::evaluate() {
  Impl& m = *impl_;
  if (!m.valid.has_value()) {
    return absl::FailedPreconditionError(
        "evaluate: the run has no validation set (data.valid_fraction, data.valid_path or "
        "data.valid_prefix)");
  }
  const ExecutionPolicyGuard policy(m.policy);
  const auto start = std::chrono::steady_clock::now();
  const int64_t batch = m.config.data.micro_batch_size;
  const int64_t batches = std::min(m.config.train.eval_batches, m.valid->num_windows() / batch);
  if (batches < 1) {
    return absl::FailedPreconditionError(
        absl::StrCat("evaluate: the validation set has ", m.valid->num_windows(),
                     " windows, fewer than one batch of data.micro_batch_size = ", batch));
  }
  std::vector<std::vector<int64_t>> rows;
  std::vector<std::optional<DocumentBounds>> documents;  // Note [Document masking]
  for (int64_t b = 0; b < batches; ++b) {
    std::vector<std::vector<int64_t>> starts;
    const bool masking = m.config.data.document_masking;
    rows.push_back(m.valid->windows_in_order(b * batch, batch, masking ? &starts : nullptr));
    if (masking) {
      documents.push_back(document_bounds_of(std::move(starts), m.valid->window_length()));
    }
  }
  const int64_t vocab = m.config.model.vocab_size;
  if (const std::optional<BadToken> bad = first_out_of_vocabulary(rows, vocab)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "evaluation: token id ", bad->id, " at position ", bad->position, " of batch ",
        bad->row + 1, " is outside the vocabulary [0, ", vocab,
        ") of model.vocab_size; check that the validation data was tokenized for this model"));
  }
  try {
    at::NoGradGuard no_grad;
    const at::Tensor ids = m.upload(rows);
    std::vector<at::Tensor> losses;
    for (int64_t b = 0; b < batches; ++b) {
      losses.push_back((documents.empty() ? m.model->loss(ids[b], ids[b])
                                          : m.model->loss(ids[b], ids[b], *documents[b]))
                           .detach());
    }
    // One sync, then the mean in a fixed order on the host.
    const at::Tensor host = at::stack(losses).to(at::kDouble).cpu();
    double sum = 0;
    for (int64_t b = 0; b < batches; ++b) sum += host[b].item<double>();
    EvalStats stats;
    stats.step = m.step;
    stats.batches = batches;
    stats.tokens = batches * batch * m.valid->seq_len();
    stats.loss = sum / static_cast<double>(batches);
    stats.perplexity = std::exp(stats.loss);
    stats.time_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return stats;
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("evaluation after step ", m.step, ": ", e.what_without_backtrace()));
  }
}

std::string format_eval_line(const EvalStats& s) {
  return absl::StrFormat("eval step %d loss %.4f perplexity %.2f (%d batches, %d tokens, %.2fs)",
                         s.step, s.loss, s.perplexity, s.batches, s.tokens, s.time_s);
}

int64_t Trainer::step() const { return impl_->step; }
const DataPosition& Trainer::data_position() const { return impl_->data.position(); }
const RunConfig& Trainer::config() const { return impl_->config; }
QwenForCausalLMImpl& Trainer::model() { return *impl_->model; }

}  // namespace gdr
