#include "gdr/microbatch_graphs.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "gdr/distributed.h"

namespace gdr {
namespace {

// 256 MiB of FP32 gradients: the granularity of the overlapped sum and of the ranged
// two-rank all-reduce. NCCL moves 256 MiB ranges faster than 64 MiB ones (measured:
// docs/benchmarks.md, Data parallelism on two H200s).
constexpr int64_t kRangeElements = int64_t{64} << 20;

// See Note [Graph marks]: counts down a range's parameters as autograd stores their gradients
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

constexpr size_t kNoMark = static_cast<size_t>(-1);

// See Note [Graph marks]: splits the parameters into g's ranges of about kRangeElements
// gradient elements, last parameter first, and hooks each range's parameters so that the
// range's mark is set (into g.range_marks) once backward has stored all their gradients.
// `pending` holds the hooks' counts: keep it until the backward has run.
void hook_range_marks(const std::vector<at::Tensor>& params, CapturedWork& work, MicrobatchGraph& g,
                      std::vector<size_t>& pending) {
  int64_t elements = 0;
  for (size_t j = params.size(); j-- > 0;) {
    if (elements == 0) g.ranges.emplace_back();
    g.ranges.back().push_back(j);
    elements += params[j].numel();
    if (elements >= kRangeElements) elements = 0;
  }
  g.range_marks.assign(g.ranges.size(), kNoMark);
  pending.resize(g.ranges.size());
  for (size_t r = 0; r < g.ranges.size(); ++r) {
    pending[r] = g.ranges[r].size();
    for (size_t j : g.ranges[r]) {
      torch::autograd::impl::set_post_acc_grad_hooks(
          params[j], std::make_unique<MarkWhenRangeStored>(work, pending[r], g.range_marks[r]));
    }
  }
}

}  // namespace

std::vector<at::Tensor> MicrobatchGraph::sum_ranges_when_final(PairwiseSum& tree,
                                                               RangeAllReduce* ranged) {
  std::vector<at::Tensor> finished(leaf.size());
  for (size_t r = 0; r < ranges.size(); ++r) {
    work->on_side_stream_after(range_marks[r], [&] {
      std::vector<at::Tensor> range;
      for (size_t j : ranges[r]) {
        // In place into the sum buffer, which the sums tile (PairwiseSum::add_kept),
        // so a range is one slice of it.
        finished[j] = tree.finish_with_last(j, leaf[j]);
        range.insert(range.begin(), finished[j]);
      }
      if (ranged != nullptr) ranged->start(range);
    });
  }
  work->join_side_stream();
  return finished;
}

MicrobatchGraphs::MicrobatchGraphs(CudaGraphCapture capture, std::vector<at::Tensor> params,
                                   std::vector<std::string> names, LossFn loss)
    : capture_(capture),
      params_(std::move(params)),
      names_(std::move(names)),
      loss_(std::move(loss)) {}

MicrobatchGraphs::~MicrobatchGraphs() = default;

size_t MicrobatchGraphs::positions(size_t microbatches) {
  return std::min(microbatches, PairwiseSum::kDeferredLeaves);
}

absl::Status MicrobatchGraphs::capture(const at::Tensor& ids, size_t microbatches, int64_t divisor,
                                       bool marks) {
  // All positions at once, in position order: the order every step replays them in
  // (Note [Microbatch graphs]).
  const size_t slots = positions(microbatches);
  graphs_.resize(slots);
  const size_t last_slot = (microbatches - 1) % slots;
  for (size_t s = 0; s < slots; ++s) {
    if (absl::Status status = capture_position(s, ids, divisor, marks && s == last_slot);
        !status.ok()) {
      graphs_.clear();
      return status;
    }
  }
  return absl::OkStatus();
}

MicrobatchGraph& MicrobatchGraphs::replay(size_t k, size_t microbatches, const at::Tensor& ids) {
  const size_t slots = positions(microbatches);
  // grad_accum is fixed for the run, so the positions captured are the positions used.
  TORCH_INTERNAL_ASSERT(graphs_.size() == slots, "microbatch graphs for ", graphs_.size(),
                        " positions, but the step has ", slots);
  MicrobatchGraph& g = *graphs_[k % slots];
  g.ids.copy_(ids, /*non_blocking=*/true);
  g.work->replay();
  return g;
}

const CapturedWork* MicrobatchGraphs::pool_owner() const {
  return !graphs_.empty() && graphs_[0] != nullptr ? graphs_[0]->work.get() : nullptr;
}

// Captures one microbatch (forward, loss, backward of loss / divisor) on `ids`'s shape
// into graphs_[slot]; the parameters' .grad are left empty.
// With `marks`, a mark follows each range of parameters' gradients (Note [Graph marks]).
absl::Status MicrobatchGraphs::capture_position(size_t slot, const at::Tensor& ids, int64_t divisor,
                                                bool marks) {
  auto captured = std::make_unique<MicrobatchGraph>();
  captured->ids = at::empty_like(ids);
  captured->ids.copy_(ids, /*non_blocking=*/true);
  try {
    captured->work = capture_(
        [&](CapturedWork& work) {
          const at::Tensor loss = loss_(captured->ids);
          // Note [Graph marks]
          std::vector<size_t> pending;  // per range: gradients not yet stored
          if (marks) hook_range_marks(params_, work, *captured, pending);
          (loss / static_cast<double>(divisor)).backward();
          for (at::Tensor& p : params_) torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
          captured->loss = loss.detach();
          for (size_t i = 0; i < params_.size(); ++i) {
            const at::Tensor grad = params_[i].grad();
            TORCH_CHECK(grad.defined(), "parameter ", names_[i],
                        " got no gradient in the captured microbatch");
            captured->leaf.push_back(grad);
          }
          for (size_t r = 0; r < captured->range_marks.size(); ++r) {
            TORCH_CHECK(captured->range_marks[r] != kNoMark, "gradient range ", r,
                        " got no mark in the captured microbatch");
          }
        },
        pool_owner());
  } catch (const c10::Error& e) {
    for (at::Tensor& p : params_) {
      p.mutable_grad().reset();
      torch::autograd::impl::set_post_acc_grad_hooks(p, nullptr);
    }
    return absl::FailedPreconditionError(absl::StrCat(
        "train.cuda_graphs: capturing a microbatch's forward and backward into a CUDA graph "
        "failed (set train.cuda_graphs: false to run without graphs): ",
        e.what_without_backtrace()));
  }
  for (at::Tensor& p : params_) p.mutable_grad().reset();
  graphs_[slot] = std::move(captured);
  return absl::OkStatus();
}

}  // namespace gdr
