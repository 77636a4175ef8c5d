// The trainer's CUDA graphs of whole microbatches (Note [Microbatch graphs]): the capture of
// one graph per position in the step, all sharing one memory pool, their replay, and the
// overlapped sum of the step's last replayed microbatch range by range (Note [Graph marks]).
// Built on the hook of gdr/cuda_graph.h, so it needs only CPU libtorch; the binary must link
// //gdr:cuda_graph_cuda for a capture to exist.
//
// Contract (what the trainer must do, and what it gets):
//   - Construct MicrobatchGraphs only for a CUDA model, with the capture that
//     cuda_graph_capture() returned (not null).
//   - Run at least one microbatch eagerly before capture(), so that the capture records
//     warmed-up work (autotune caches, cuBLAS handles, autograd threads).
//   - capture() once, at the first graphed microbatch, with the step's number of
//     microbatches n; every later step must have the same n (grad_accum is fixed for a run).
//   - replay() in step order: microbatch k replays position k mod positions(n). The graph's
//     loss and leaf are valid until that graph replays again, or until an earlier-captured
//     graph replays (they share a pool): hand the leaf to PairwiseSum::add_kept, which sums
//     it before either happens when the positions replay in order, or, for the step's last
//     microbatch of a graph captured with marks, to sum_ranges_when_final().
//   - The parameters' .grad are left empty by capture(); replays never touch them.
//   - Errors: capture() returns FailedPrecondition naming train.cuda_graphs when capture
//     fails (an op synchronised with the host); other failures throw c10::Error.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "gdr/cuda_graph.h"

namespace gdr {

class PairwiseSum;
class RangeAllReduce;

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
// with two ranks, see MicrobatchGraph::sum_ranges_when_final). Capture fails (with an error
// naming train.cuda_graphs) when an op synchronises with the host; keep forward and
// backward free of .item() and pageable copies. The graph's memory pool holds one
// microbatch's activations for the run's lifetime (the 0.8B peak falls anyway, as the eager
// microbatches' allocations go away: docs/benchmarks_log.md). With data.document_masking
// every microbatch slices its rows at its own document starts (Note [Document masking] in
// models/qwen/document_bounds.h), so its launches differ from batch to batch: the trainer
// turns graphs off for such runs, says so after the policy line, and runs every microbatch
// eagerly; runs without masking are unchanged.
//
// One graph per position k mod PairwiseSum::kDeferredLeaves in the step (so up to four),
// all sharing one memory pool (the activations of one microbatch; CudaGraphCapture's
// share_memory_with), each with its own gradient leaf. The gradient tree keeps the leaves
// of a deferred group as they are (PairwiseSum::add_kept) and sums the group in one pass
// when it is complete, at position k = 4j + 3, or at the step's end; the next replay of
// graph k mod 4 comes after that on the same stream, so a leaf is read before it is
// overwritten. With a single graph every leaf would have to be copied out before the next
// replay: 3 of the 4 leaves per 0.8B step (their cost: docs/benchmarks.md, Decisions).
// All the position graphs are captured together, in position order, at the first graphed
// microbatch (step 1's second, after the eager warm-up one), because a shared pool is only
// safe when graphs replay in the order they were captured: a later capture may place its
// leaf in memory an earlier graph uses for temporaries (its freed activations, or a cuBLAS
// workspace), so graph j < i must not replay between graph i's replay and the tree's read
// of leaf i. In position order it never does: the replay after graph i that reaches a
// lower position starts the next group, and the tree has summed leaf i's group before it.
// (Capturing graph 0 last, at step 2, puts leaf 0 into graph 1's activations: NaN
// gradients.) The last position's graph carries the marks.
struct MicrobatchGraph {
  at::Tensor ids;   // the graph's input: [batch, window] token ids
  at::Tensor loss;  // its outputs, overwritten by every replay
  // The microbatch's gradient leaf (Note [Gradient reduction tree]): the parameters'
  // gradients as backward left them (BF16 for bf16 training), in params order.
  // PairwiseSum::add_kept and finish_with_last widen them as they add them (one pass over
  // the gradients instead of a widening copy and then an add; the bits of the eager path's
  // grad.to(kFloat) leaves). Widening outside the graph, per tensor, would take ~300
  // launches per replay and fill the stream's launch queue.
  std::vector<at::Tensor> leaf;
  // See Note [Graph marks]: the parameters in ranges of about kRangeElements gradient elements,
  // last parameter first (each range's indices descending), and for each range the mark
  // after which its gradients are final in a replay. Empty when captured without marks
  // (train.overlap_grad_reduction off, or one microbatch per step).
  std::vector<std::vector<size_t>> ranges;
  std::vector<size_t> range_marks;
  std::unique_ptr<CapturedWork> work;

  // Right after replay() of the step's last microbatch, on a graph captured with marks
  // (ranges not empty), instead of adding the leaf to `tree`: returns the step's local
  // gradient sums, in params order. For each range, last parameters first, a side stream
  // waits for the range's mark, finishes the range's sums with this graph's leaf as the
  // last leaf (PairwiseSum::finish_with_last) and, when `ranged` is not null, starts the
  // range's all-reduce; the current stream then joins the side stream.
  std::vector<at::Tensor> sum_ranges_when_final(PairwiseSum& tree, RangeAllReduce* ranged);
};

// The graphs of one training run, indexed by position in the step.
class MicrobatchGraphs {
 public:
  // Queues one microbatch's forward and loss on `ids` ([batch, window] token ids) and
  // returns the scalar loss, differentiable with respect to `params`.
  using LossFn = std::function<at::Tensor(const at::Tensor& ids)>;

  // `params` (named `names`, for errors) are the model's parameters in the order the leaves
  // list their gradients; `capture` is cuda_graph_capture() (not null).
  MicrobatchGraphs(CudaGraphCapture capture, std::vector<at::Tensor> params,
                   std::vector<std::string> names, LossFn loss);
  ~MicrobatchGraphs();

  // Graphs in a step of `microbatches` microbatches: min(microbatches, kDeferredLeaves).
  static size_t positions(size_t microbatches);

  bool captured() const { return !graphs_.empty(); }

  // Captures every position of a step of `microbatches` microbatches, in position order,
  // each on `ids`'s shape (forward, loss, backward of loss / divisor); with `marks`, the
  // last microbatch's position carries the marks of Note [Graph marks]. On failure no
  // graph is kept and the parameters' .grad and hooks are cleared.
  absl::Status capture(const at::Tensor& ids, size_t microbatches, int64_t divisor, bool marks);

  // Copies `ids` into the input of microbatch k's graph (position k mod positions) and
  // queues its replay on the current stream; returns that graph, whose loss and leaf the
  // replay overwrites.
  MicrobatchGraph& replay(size_t k, size_t microbatches, const at::Tensor& ids);

 private:
  // Captures one microbatch into graphs_[slot]; see capture().
  absl::Status capture_position(size_t slot, const at::Tensor& ids, int64_t divisor, bool marks);
  // The capture whose memory pool the next capture shares: the first position's, which is
  // captured first; null for that first capture.
  const CapturedWork* pool_owner() const;

  CudaGraphCapture capture_;
  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  LossFn loss_;
  // Indexed by position in the step mod PairwiseSum::kDeferredLeaves; empty until captured.
  std::vector<std::unique_ptr<MicrobatchGraph>> graphs_;
};

}  // namespace gdr
