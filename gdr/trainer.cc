#include "gdr/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
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
#include "gdr/sha256.h"
#include "io/file_util.h"
#include "ops/policy/determinism.h"
#include "models/qwen/model.h"
#include "ops/attention/attention_op.h"
#include "ops/fused_adamw/fused_adamw_op.h"
#include "ops/gdr_core/gdr_core_op.h"

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

std::string format_run_header(const RunConfig& config, int64_t parameters, int world,
                              int64_t first_step) {
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
  const char* fusion = m.pre_gdr_fusion == PreGdrFusion::kNone   ? "none"
                       : m.pre_gdr_fusion == PreGdrFusion::kGate ? "gate"
                                                                 : "full";
  std::string line = absl::StrCat(
      "run: ", size, " parameters (", m.num_hidden_layers, " layers: ", linear,
      " linear_attention + ", full, " full_attention, hidden ", m.hidden_size, ") | ",
      cuda ? "cuda" : "cpu", " ", t.dtype == TrainDtype::kBFloat16 ? "bf16" : "fp32",
      " | deterministic ", m.deterministic_mode ? "on" : "off", " | pre_gdr_fusion ", fusion);
  if (cuda) {
    absl::StrAppend(&line, " | gdr core ", to_string(gdr_core_impl()), ", prep ",
                    to_string(gdr_core_prep()), " | attention ",
                    attention_impl() == AttentionBackend::kCudnn ? "cudnn" : "aten");
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

// Note [Microbatch graphs]: with train.cuda_graphs on CUDA, a microbatch's forward,
// loss and backward are captured once into a CUDA graph (after one eager microbatch has
// warmed up autotune caches, cuBLAS handles and the autograd threads) and replayed for
// every later microbatch with its token ids copied into the graph's input. The step is
// otherwise host-bound: autograd, dispatch and ~2,000 kernel launches per microbatch take
// the host longer than the GPU takes to run them. A replay launches the very kernels the
// eager microbatch would, with the same arguments, in the same order, so the bits are the
// same (trainer_gpu_test compares a graphed run with an eager one). NCCL stays outside
// the graph (its dead-peer timeout needs the host): under data parallelism every
// microbatch is replayed and the reduction starts after the last replay (RangeAllReduce
// with two ranks, see train_step_or_throw). Capture fails (with an error naming
// train.cuda_graphs) when an op synchronises with the host; keep forward and backward free
// of .item() and pageable copies. The graph's memory pool holds one microbatch's
// activations for the run's lifetime (the 0.8B peak fell anyway, 26.9 -> 21.2 GiB, as the
// eager microbatches' allocations went away).
//
// One graph per position k mod PairwiseSum::kDeferredLeaves in the step (so up to four),
// all sharing one memory pool (the activations of one microbatch; CudaGraphCapture's
// share_memory_with), each with its own gradient leaf. The gradient tree keeps the leaves
// of a deferred group as they are (PairwiseSum::add_kept) and sums the group in one pass
// when it is complete, at position k = 4j + 3, or at the step's end; the next replay of
// graph k mod 4 comes after that on the same stream, so a leaf is read before it is
// overwritten. With a single graph every leaf had to be copied out before the next replay
// (PairwiseSum's former add_copy_of): 3 of the 4 leaves per 0.8B step, 3.1 ms of 191.
// All the position graphs are captured together, in position order, at the first graphed
// microbatch (step 1's second, after the eager warm-up one), because a shared pool is only
// safe when graphs replay in the order they were captured: a later capture may place its
// leaf in memory an earlier graph uses for temporaries (its freed activations, or a cuBLAS
// workspace), so graph j < i must not replay between graph i's replay and the tree's read
// of leaf i. In position order it never does: the replay after graph i that reaches a
// lower position starts the next group, and the tree has summed leaf i's group before it.
// (Capturing graph 0 last, at step 2, put leaf 0 into graph 1's activations: NaN gradients
// on the H200.) The last position's graph carries the marks.
struct MicrobatchGraph {
  at::Tensor ids;   // the graph's input: [batch, window] token ids
  at::Tensor loss;  // its outputs, overwritten by every replay
  // The microbatch's gradient leaf (Note [Gradient reduction tree]): the parameters'
  // gradients as backward left them (BF16 for bf16 training), in params order.
  // PairwiseSum::add_kept and finish_with_last widen them as they add them (one pass over
  // the gradients instead of a widening copy and then an add; the bits of the eager path's
  // grad.to(kFloat) leaves). Widening outside the graph, per tensor, was
  // tried first: ~300 launches per replay filled the stream's launch queue.
  std::vector<at::Tensor> leaf;
  // Note [Graph marks]: the parameters in ranges of about kRangeElements gradient elements,
  // last parameter first (each range's indices descending), and for each range the mark
  // after which its gradients are final in a replay. Empty when captured without marks
  // (train.overlap_grad_reduction off, or one microbatch per step).
  std::vector<std::vector<size_t>> ranges;
  std::vector<size_t> range_marks;
  std::unique_ptr<CapturedWork> work;
};

// 256 MiB of FP32 gradients: the granularity of the overlapped sum and of the ranged
// two-rank all-reduce. Ranges of 256 MiB ran at ~300 GB/s where 64 MiB ones ran at ~230 on
// the H200 pair (docs/benchmarks.md).
constexpr int64_t kRangeElements = int64_t{64} << 20;

// Note [Graph marks]: counts down a range's parameters as autograd stores their gradients
// and sets the range's mark when the last one is stored (a hook after the accumulation, so
// the mark follows every kernel that wrote them, a layout-fixing copy included).
class MarkWhenRangeStored final : public torch::autograd::PostAccumulateGradHook {
 public:
  MarkWhenRangeStored(CapturedWork& work, size_t& pending, size_t& mark)
      : work_(work), pending_(pending), mark_(mark) {}
  void operator()(const torch::autograd::Variable&) override {
    if (--pending_ == 0) mark_ = work_.mark();
  }

 private:
  CapturedWork& work_;
  size_t& pending_;
  size_t& mark_;
};

struct Trainer::Impl {
  RunConfig config;
  TokenWindows data;
  QwenForCausalLM model{nullptr};
  at::Device device{at::kCPU};
  std::vector<std::string> names;
  std::vector<at::Tensor> params;   // the model's, in names order
  std::vector<at::Tensor> masters;  // FP32; the same tensors as params for fp32
  std::unique_ptr<torch::optim::AdamW> optimizer;
  int64_t step = 0;
  // Kept from the last step for snapshots.
  std::vector<at::Tensor> last_grads;
  std::vector<double> last_losses;
  std::shared_ptr<ProcessGroup> group;  // null: one process
  // Note [Microbatch graphs]: null when graphs are off or not on CUDA.
  CudaGraphCapture graph_capture = nullptr;
  // Indexed by position in the step mod PairwiseSum::kDeferredLeaves; null until captured.
  std::vector<std::unique_ptr<MicrobatchGraph>> graphs;
  int64_t eager_microbatches = 0;  // in this process

  int rank() const { return group ? group->rank() : 0; }
  int world() const { return group ? group->world_size() : 1; }

  bool mixed() const { return config.train.dtype == TrainDtype::kBFloat16; }

  torch::optim::AdamWParamState* adam_state(const at::Tensor& master) const {
    auto it = optimizer->state().find(master.unsafeGetTensorImpl());
    if (it == optimizer->state().end()) return nullptr;
    return static_cast<torch::optim::AdamWParamState*>(it->second.get());
  }

  // The capture whose memory pool the next capture shares (Note [Microbatch graphs]): the
  // first position's, which is captured first; null for that first capture.
  const CapturedWork* graph_pool_owner() const {
    return !graphs.empty() && graphs[0] != nullptr ? graphs[0]->work.get() : nullptr;
  }

  // Captures one microbatch (forward, loss, backward of loss / divisor) on `ids`'s shape
  // into graphs[slot]; the parameters' .grad are left empty.
  // With `marks`, a mark follows each range of parameters' gradients (Note [Graph marks]).
  absl::Status capture_microbatch(size_t slot, const at::Tensor& ids, int64_t divisor, bool marks) {
    auto captured = std::make_unique<MicrobatchGraph>();
    captured->ids = at::empty_like(ids);
    captured->ids.copy_(ids, /*non_blocking=*/true);
    try {
      captured->work = graph_capture(
          [&](CapturedWork& work) {
            const at::Tensor loss = model->loss(captured->ids, captured->ids);
            // Note [Graph marks]
            constexpr size_t kNoMark = static_cast<size_t>(-1);
            std::vector<size_t> pending;
            if (marks) {
              int64_t elements = 0;
              for (size_t j = params.size(); j-- > 0;) {
                if (elements == 0) captured->ranges.emplace_back();
                captured->ranges.back().push_back(j);
                elements += params[j].numel();
                if (elements >= kRangeElements) elements = 0;
              }
              captured->range_marks.assign(captured->ranges.size(), kNoMark);
              pending.resize(captured->ranges.size());
              for (size_t r = 0; r < captured->ranges.size(); ++r) {
                pending[r] = captured->ranges[r].size();
                for (size_t j : captured->ranges[r]) {
                  torch::autograd::impl::set_post_acc_grad_hooks(
                      params[j], std::make_unique<MarkWhenRangeStored>(work, pending[r],
                                                                       captured->range_marks[r]));
                }
              }
            }
            (loss / static_cast<double>(divisor)).backward();
            for (at::Tensor& p : params) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
            captured->loss = loss.detach();
            for (size_t i = 0; i < params.size(); ++i) {
              const at::Tensor grad = params[i].grad();
              TORCH_CHECK(grad.defined(), "parameter ", names[i],
                          " got no gradient in the captured microbatch");
              captured->leaf.push_back(grad);
            }
            for (size_t r = 0; r < captured->range_marks.size(); ++r) {
              TORCH_CHECK(captured->range_marks[r] != kNoMark, "gradient range ", r,
                          " got no mark in the captured microbatch");
            }
          },
          graph_pool_owner());
    } catch (const c10::Error& e) {
      for (at::Tensor& p : params) {
        p.mutable_grad().reset();
        torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
      }
      return absl::FailedPreconditionError(absl::StrCat(
          "train.cuda_graphs: capturing a microbatch's forward and backward into a CUDA graph "
          "failed (set train.cuda_graphs: false to run without graphs): ",
          e.what_without_backtrace()));
    }
    for (at::Tensor& p : params) p.mutable_grad().reset();
    graphs[slot] = std::move(captured);
    return absl::OkStatus();
  }

  // Note [Fused AdamW]: the optimizer tail of a step in one multi-tensor kernel family,
  // gdr::fused_adamw_step_ (ops/fused_adamw/fused_adamw_op.h): per element, the gradient clip (grad *=
  // grad_coef, written back so last_grads holds the clipped gradients), the AdamW update of
  // the FP32 master and its moments, and, in mixed precision, the store of the new master
  // rounded to BF16 into the model's parameter. On CUDA that is one launch (the step is
  // host-bound and this was ~225 launches: _foreach_mul_, _foreach_add_ on per-master step
  // counters, _fused_adamw_, _foreach_copy_) and reads the gradients once; it gives the bits
  // of that ATen sequence, which is what it runs on the CPU. It works on the state
  // torch::optim::AdamW keeps (the integer step of each AdamWParamState is the step count
  // the kernel takes, as a float), so snapshots, checkpoints and resume do not depend on the
  // implementation. Elementwise, hence deterministic. grad_coef: 1 when not clipping.
  void fused_adamw_step(double lr, double grad_coef) {
    const OptimizerConfig& o = config.optimizer;
    // Masters grouped by the step they take (one group in practice: every state is created
    // on the first step and saved and loaded together).
    struct Group {
      std::vector<at::Tensor> masters, grads, avgs, sqs, bf16_params;
    };
    std::map<int64_t, Group> groups;
    for (size_t i = 0; i < masters.size(); ++i) {
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

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::create(const RunConfig& config,
                                                         std::shared_ptr<ProcessGroup> group) {
  if (group != nullptr && group->world_size() > 1) {
    if (absl::Status s =
            check_same_on_all_ranks(*group, "config hash", sha256_hex(config.config_text));
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = apply_deterministic_mode(config.model); !s.ok()) return s;
  apply_gdr_core_settings(config.model);
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
  absl::StatusOr<TokenWindows> data =
      TokenWindows::open(config.data, static_cast<uint64_t>(config.train.seed));
  if (!data.ok()) return data.status();

  auto impl = std::unique_ptr<Impl>(new Impl{config, std::move(*data)});
  impl->device = device;
  impl->group = std::move(group);
  if (device.is_cuda() && config.train.cuda_graphs) {
    impl->graph_capture = cuda_graph_capture();
    if (impl->graph_capture == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat(config.source,
                       ": train.cuda_graphs: true needs a binary linked with //gdr:cuda_graph_cuda "
                       "(tools/train_cuda is); set train.cuda_graphs: false"));
    }
  }
  try {
    impl->model = QwenForCausalLM(config.model);
    init_qwen_weights(*impl->model, static_cast<uint64_t>(config.train.seed));
    impl->model->to(device, impl->mixed() ? at::kBFloat16 : at::kFloat);
    for (const auto& item : impl->model->named_parameters()) {
      impl->names.push_back(item.key());
      impl->params.push_back(item.value());
      impl->masters.push_back(impl->mixed() ? item.value().detach().to(at::kFloat).clone()
                                            : item.value());
    }
    torch::optim::AdamWOptions options(config.optimizer.lr);
    options.betas({config.optimizer.beta1, config.optimizer.beta2})
        .eps(config.optimizer.eps)
        .weight_decay(config.optimizer.weight_decay);
    impl->optimizer = std::make_unique<torch::optim::AdamW>(impl->masters, options);
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(config.source, ": ", e.what_without_backtrace()));
  }
  if (impl->world() > 1) {
    if (absl::Status s = check_same_on_all_ranks(*impl->group, "initial parameter checksum",
                                                 tensors_checksum(impl->masters));
        !s.ok()) {
      return s;
    }
  }
  return std::unique_ptr<Trainer>(new Trainer(std::move(impl)));
}

absl::StatusOr<StepStats> Trainer::train_step() {
  // Torch reports failures (e.g. an op with no deterministic path in deterministic mode)
  // as exceptions; they become errors naming the step.
  try {
    return train_step_or_throw();
  } catch (const c10::Error& e) {
    return absl::InternalError(
        absl::StrCat("step ", impl_->step + 1, ": ", e.what_without_backtrace()));
  }
}

absl::StatusOr<StepStats> Trainer::train_step_or_throw() {
  Impl& m = *impl_;
  const auto start = std::chrono::steady_clock::now();
  const int64_t accum = m.config.train.grad_accum;
  const int64_t batch = m.config.data.micro_batch_size;
  const int64_t window = m.data.window_length();
  StepStats stats;
  stats.step = m.step + 1;
  for (at::Tensor& p : m.params) p.mutable_grad().reset();
  for (at::Tensor& p : m.masters) p.mutable_grad().reset();

  const int world = m.world();
  // Global microbatches k = 0 .. world * accum - 1 of this step; rank r trains on
  // k = r * accum .. r * accum + accum - 1 (see Trainer::create). Every rank reads them all,
  // so the data position stays the same on every rank.
  std::vector<std::vector<int64_t>> mine;
  for (int64_t k = 0; k < world * accum; ++k) {
    std::vector<int64_t> b = m.data.next_batch(batch);
    if (k / accum == m.rank()) mine.push_back(std::move(b));
  }
  // Note [Token id check]: every id must index the embedding and the loss's vocabulary.
  // Checked here on the host, where it costs nothing, because on the GPU an
  // out-of-range id is a device-side assert in the embedding (the process dies with no
  // useful message) and the fused loss does not check its targets (Note [Cross-entropy
  // target check]).
  const int64_t vocab = m.config.model.vocab_size;
  for (size_t k = 0; k < mine.size(); ++k) {
    for (size_t i = 0; i < mine[k].size(); ++i) {
      const int64_t id = mine[k][i];
      if (id < 0 || id >= vocab) {
        return absl::InvalidArgumentError(absl::StrCat(
            "step ", stats.step, ": token id ", id, " at position ", i, " of microbatch ",
            m.rank() * accum + static_cast<int64_t>(k) + 1, " is outside the vocabulary [0, ",
            vocab, ") of model.vocab_size; check that the data (",
            m.config.data.source == DataSource::kEmbedded ? m.config.data.path
                                                          : m.config.data.prefix,
            ") was tokenized for this model"));
      }
    }
  }
  // Each microbatch's FP32 gradient is a leaf of the reduction tree (Note [Gradient
  // reduction tree] in gdr/distributed.h); with accum <= 2 and one rank this is exactly
  // autograd's accumulation.
  PairwiseSum tree;
  // Losses stay on the device until the step's end: one host sync per step, not one per
  // microbatch, so the host can queue the next microbatch while the GPU finishes this one.
  std::vector<at::Tensor> losses_on_device;
  // All of this rank's token windows in one upload. On CUDA from pinned memory without
  // blocking: a copy from pageable memory (what Tensor::to does with a std::vector's
  // tensor) synchronises the stream first, so every microbatch used to start with the GPU
  // drained and idle while the host queued its first kernels.
  at::Tensor step_ids = at::empty({static_cast<int64_t>(mine.size()), batch, window}, at::kLong);
  for (size_t k = 0; k < mine.size(); ++k) {
    std::copy(mine[k].begin(), mine[k].end(),
              step_ids.data_ptr<int64_t>() + static_cast<int64_t>(k) * batch * window);
  }
  if (m.device.is_cuda()) step_ids = step_ids.pin_memory().to(m.device, /*non_blocking=*/true);
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
  // issue 7.) Eager runs with several ranks hand over from the last backward's hooks.
  const bool overlap =
      world > 1 && m.config.train.overlap_grad_reduction && m.graph_capture == nullptr;
  const bool overlap_graphed =
      m.config.train.overlap_grad_reduction && m.graph_capture != nullptr && mine.size() >= 2;
  std::unique_ptr<OverlappedReduction> overlapped;
  std::unique_ptr<RangeAllReduce> ranged;
  std::vector<at::Tensor> finished;  // overlap_graphed: the local sums, in params order
  for (size_t k = 0; k < mine.size(); ++k) {
    const at::Tensor ids = step_ids[static_cast<int64_t>(k)];
    const bool hand_over = overlap && k + 1 == mine.size();
    stats.tokens += batch * (window - 1);
    if (!hand_over && m.graph_capture != nullptr && m.eager_microbatches > 0) {
      // Note [Microbatch graphs]
      const size_t slots = std::min(mine.size(), PairwiseSum::kDeferredLeaves);
      const size_t slot = k % slots;
      if (m.graphs.empty()) {
        // All positions at once, in position order: the order every step replays them in
        // (Note [Microbatch graphs]).
        m.graphs.resize(slots);
        const size_t last_slot = (mine.size() - 1) % slots;
        for (size_t s = 0; s < slots; ++s) {
          if (absl::Status status =
                  m.capture_microbatch(s, ids, world * accum, overlap_graphed && s == last_slot);
              !status.ok()) {
            m.graphs.clear();
            return absl::InternalError(absl::StrCat("step ", stats.step, ": ", status.message()));
          }
        }
      }
      // grad_accum is fixed for the run, so the positions captured are the positions used.
      TORCH_INTERNAL_ASSERT(m.graphs.size() == slots, "microbatch graphs for ", m.graphs.size(),
                            " positions, but the step has ", slots);
      MicrobatchGraph& g = *m.graphs[slot];
      g.ids.copy_(ids, /*non_blocking=*/true);
      g.work->replay();
      ++stats.graph_replays;
      losses_on_device.push_back(g.loss.detach().reshape({1}).clone());
      if (overlap_graphed && !g.ranges.empty() && k + 1 == mine.size()) {
        if (world == 2) ranged = std::make_unique<RangeAllReduce>(*m.group);
        finished.resize(g.leaf.size());
        for (size_t r = 0; r < g.ranges.size(); ++r) {
          g.work->on_side_stream_after(g.range_marks[r], [&] {
            std::vector<at::Tensor> range;
            for (size_t j : g.ranges[r]) {
              // In place into the sum buffer, which the sums tile (PairwiseSum::add_kept),
              // so a range is one slice of it.
              finished[j] = tree.finish_with_last(j, g.leaf[j]);
              range.insert(range.begin(), finished[j]);
            }
            if (ranged != nullptr) ranged->start(range);
          });
        }
        g.work->join_side_stream();
        continue;
      }
      // Kept, not copied: graph `slot` replays again only after the tree has summed this
      // leaf's group (Note [Microbatch graphs]).
      tree.add_kept(g.leaf);
      continue;
    }
    ++m.eager_microbatches;
    const at::Tensor loss = m.model->loss(ids, ids);
    std::vector<unsigned> hooks;
    if (hand_over) {
      std::vector<std::vector<int64_t>> shapes;
      for (const at::Tensor& p : m.masters) shapes.push_back(p.sizes().vec());
      overlapped = std::make_unique<OverlappedReduction>(*m.group, shapes, m.masters[0].options());
      for (size_t i = 0; i < m.params.size(); ++i) {
        hooks.push_back(m.params[i].register_hook([&m, &tree, &overlapped, i](at::Tensor grad) {
          overlapped->set(i, tree.finish_with_last(i, m.mixed() ? grad.to(at::kFloat) : grad));
        }));
      }
    }
    (loss / static_cast<double>(world * accum)).backward();
    for (size_t i = 0; i < hooks.size(); ++i) m.params[i].remove_hook(hooks[i]);
    losses_on_device.push_back(loss.detach().reshape({1}));
    if (hand_over) {
      for (at::Tensor& p : m.params) p.mutable_grad().reset();
      continue;
    }
    std::vector<at::Tensor> leaf;
    for (at::Tensor& p : m.params) {
      leaf.push_back(m.mixed() ? p.grad().to(at::kFloat) : p.grad());
      p.mutable_grad().reset();
    }
    tree.add(std::move(leaf));
  }
  {
    // Note [Host-bound steps]: the loss copy below is the step's first wait on the device.
    // The host time up to it is spent queueing work (autograd, dispatch, launches); the
    // wait is what the GPU still had to do. A wait near zero means the GPU finished before
    // the host had queued everything: the step is host-bound, and faster kernels will not
    // shorten it (metrics.jsonl: host_queue_s, gpu_wait_s).
    const auto sync_start = std::chrono::steady_clock::now();
    stats.host_queue_s = std::chrono::duration<double>(sync_start - start).count();
    // float -> double is exact, so these are the values loss.item<double>() would give.
    const at::Tensor host = at::cat(losses_on_device).to(at::kCPU, at::kDouble);
    stats.gpu_wait_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - sync_start).count();
    const double* p = host.data_ptr<double>();
    stats.microbatch_losses.assign(p, p + host.numel());
  }
  std::vector<at::Tensor> grads;
  const auto reduce_start = std::chrono::steady_clock::now();
  if (ranged != nullptr) {
    if (absl::Status s = ranged->finish(); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("step ", stats.step, ": ", s.message()));
    }
    grads = std::move(finished);
  } else if (!finished.empty()) {
    grads = std::move(finished);
  } else if (overlapped != nullptr) {
    absl::StatusOr<std::vector<at::Tensor>> reduced = overlapped->finish();
    if (!reduced.ok()) {
      return absl::UnavailableError(
          absl::StrCat("step ", stats.step, ": ", reduced.status().message()));
    }
    grads = std::move(*reduced);
  } else {
    grads = tree.finish();
  }
  for (size_t i = 0; i < m.masters.size(); ++i) m.masters[i].mutable_grad() = grads[i];
  if (world > 1) {
    std::vector<std::vector<double>> losses;
    // Overlapped: the gradients are reduced already; only the losses are gathered.
    const std::vector<at::Tensor> to_reduce =
        overlapped != nullptr || ranged != nullptr ? std::vector<at::Tensor>{} : grads;
    if (absl::Status s = m.group->all_reduce_sum(to_reduce, stats.microbatch_losses, &losses);
        !s.ok()) {
      return absl::UnavailableError(absl::StrCat("step ", stats.step, ": ", s.message()));
    }
    stats.reduce_time_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - reduce_start).count();
    stats.microbatch_losses.clear();  // all of them, in global order
    for (int r = 0; r < world; ++r) {
      for (double l : losses[r]) stats.microbatch_losses.push_back(l);
    }
    stats.tokens *= world;
  }
  // Global L2 norm: per-tensor FP32 norms, then the norm of those, in a fixed order. One
  // multi-tensor op (on CUDA a few launches of per-chunk partials summed in chunk order:
  // no atomics, so deterministic) instead of one reduction launch per tensor, which cost
  // ~2 ms per 0.8B step in 321 launches; on the CPU it is the per-tensor norm.
  const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2);
  stats.grad_norm = at::stack(norms).norm().item<double>();
  double loss_sum = 0;
  for (double l : stats.microbatch_losses) loss_sum += l;
  stats.loss = loss_sum / static_cast<double>(stats.microbatch_losses.size());
  stats.lr = learning_rate_at(m.config, stats.step);

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
  if (!nonfinite.empty() && m.config.train.on_nonfinite == OnNonfinite::kStop) {
    return absl::AbortedError(absl::StrCat("step ", stats.step, ": ", nonfinite,
                                           "; stopping (train.on_nonfinite: stop)"));
  }

  const double clip = m.config.optimizer.grad_clip;
  // One scale factor computed on the host: the same bits however the grads are laid out.
  double coef = 1.0;
  if (nonfinite.empty() && clip > 0) coef = std::min(1.0, clip / (stats.grad_norm + 1e-6));
  m.last_losses = stats.microbatch_losses;

  if (nonfinite.empty()) {
    if (m.config.optimizer.impl == OptimizerImpl::kFused) {
      // Clips the grads (they alias the masters' .grad), updates the masters and, in mixed
      // precision, writes the BF16 params (Note [Fused AdamW]).
      m.fused_adamw_step(stats.lr, coef);
    } else {
      at::NoGradGuard no_grad;
      if (coef < 1.0) at::_foreach_mul_(grads, coef);  // grads alias the masters' .grad
      for (auto& group : m.optimizer->param_groups()) {
        static_cast<torch::optim::AdamWOptions&>(group.options()).lr(stats.lr);
      }
      m.optimizer->step();
      if (m.mixed()) at::_foreach_copy_(m.params, m.masters);
    }
  } else {
    stats.skipped = true;
  }
  // The gradients the optimizer consumed, kept for write_snapshot (the optimizer reads them
  // and does not write them, so no copy is needed).
  m.last_grads = std::move(grads);
  for (at::Tensor& p : m.params) p.mutable_grad().reset();
  for (at::Tensor& p : m.masters) p.mutable_grad().reset();
  m.step = stats.step;
  stats.step_time_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats.tokens_per_s = stats.step_time_s > 0 ? stats.tokens / stats.step_time_s : 0;
  return stats;
}

io::NamedTensors Trainer::master_parameters() const {
  io::NamedTensors out;
  for (size_t i = 0; i < impl_->names.size(); ++i) {
    out.emplace_back(impl_->names[i], impl_->masters[i].detach());
  }
  return out;
}

io::NamedTensors Trainer::optimizer_tensors() const {
  io::NamedTensors out;
  for (size_t i = 0; i < impl_->names.size(); ++i) {
    const torch::optim::AdamWParamState* st = impl_->adam_state(impl_->masters[i]);
    if (st == nullptr) continue;
    const std::string& name = impl_->names[i];
    out.emplace_back(name + ".exp_avg", st->exp_avg());
    out.emplace_back(name + ".exp_avg_sq", st->exp_avg_sq());
    out.emplace_back(name + ".step", at::scalar_tensor(st->step(), at::kLong));
  }
  return out;
}

Checkpoint Trainer::capture() const {
  Checkpoint c;
  c.model = master_parameters();
  c.optimizer = optimizer_tensors();
  c.state.step = impl_->step;
  c.state.data_position = impl_->data.position();
  c.state.rng_cpu_hex = hex_encode(cpu_rng_state());
  c.state.config_text = impl_->config.config_text;
  return c;
}

absl::Status Trainer::save_checkpoint(const std::string& step_dir) const {
  return write_checkpoint(step_dir, capture());
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
    if (sq == opt.end() || step == opt.end() || avg->second.sizes() != m.masters[i].sizes() ||
        sq->second.sizes() != m.masters[i].sizes() || avg->second.scalar_type() != at::kFloat ||
        sq->second.scalar_type() != at::kFloat || step->second.numel() != 1) {
      return absl::DataLossError(absl::StrCat(*step_dir, "/optimizer.safetensors: ", name,
                                              ": expected FP32 exp_avg and exp_avg_sq shaped "
                                              "like the parameter and a scalar step"));
    }
    states[i] = std::make_unique<torch::optim::AdamWParamState>();
    states[i]->step(step->second.item<int64_t>());
    states[i]->exp_avg(avg->second.to(m.device).clone());
    states[i]->exp_avg_sq(sq->second.to(m.device).clone());
  }

  at::NoGradGuard no_grad;
  m.optimizer->state().clear();
  for (size_t i = 0; i < m.names.size(); ++i) {
    m.masters[i].copy_(weights.at(m.names[i]));
    if (m.mixed()) m.params[i].copy_(m.masters[i]);
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
    return check_same_on_all_ranks(*m.group, "resumed parameter checksum",
                                   tensors_checksum(m.masters));
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
//   snapshot.json: step, losses and data position as text for people to read.
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
  for (auto& [name, t] : master_parameters()) tensors.emplace_back("param/" + name, t);
  for (size_t i = 0; i < m.last_grads.size(); ++i) {
    tensors.emplace_back("grad/" + m.names[i], m.last_grads[i]);
  }
  for (auto& [name, t] : optimizer_tensors()) tensors.emplace_back("adam/" + name, t);
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
    log << format_run_header(impl_->config, parameters, impl_->world(), impl_->step + 1)
        << std::endl;
  }
  while (impl_->step < tc.steps) {
    absl::StatusOr<StepStats> stats = train_step();
    if (!stats.ok()) return stats.status();
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
    const bool periodic = tc.checkpoint_every > 0 && stats->step % tc.checkpoint_every == 0;
    if (rank0 && !tc.checkpoint_dir.empty() && (periodic || stats->step == tc.steps)) {
      const std::string dir = checkpoint_step_dir(tc.checkpoint_dir, stats->step);
      const auto save_start = std::chrono::steady_clock::now();
      if (absl::Status s = save_checkpoint(dir); !s.ok()) return s;
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

int64_t Trainer::step() const { return impl_->step; }
const DataPosition& Trainer::data_position() const { return impl_->data.position(); }
const RunConfig& Trainer::config() const { return impl_->config; }
QwenForCausalLMImpl& Trainer::model() { return *impl_->model; }

}  // namespace gdr
