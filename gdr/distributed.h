// Distributed data parallelism on libtorch's c10d: ranks from torchrun's environment, a
// TCPStore rendezvous and a Gloo (CPU) or NCCL (CUDA) process group, and the few collectives the
// trainer needs, each with a fixed reduction order.
//
// Environment (as torchrun sets it): RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.
// None of them set (or WORLD_SIZE=1) means one process and no process group. Optional:
// GDR_DIST_TIMEOUT_S (seconds, default 60): every store wait and every collective gives up
// after it, so a dead or hung peer ends the others with an error instead of a hang. (It must
// also cover the longest time one rank works alone: rank 0 writing a checkpoint while the
// others wait in the next step's reduction.) A process that dies closes its sockets, so
// the others usually fail at once; a hung one is caught by the timeout.
//
// Note [Gradient reduction tree]: the gradient of a step is a sum over the step's
// N = W * M microbatches (M = train.grad_accum) in global order k = 0 .. N-1, each leaf the
// gradient of loss_k / N, added up by one fixed tree: PairwiseSum (below) over the leaves
// in order. Rank r holds the contiguous leaves r*M .. r*M + M-1 and sums them with the same
// PairwiseSum; all_reduce_sum then combines the W partial sums with PairwiseSum in rank
// order. When M is a power of two the rank subtrees are exactly subtrees of the global tree,
// so the result does not depend on how the N microbatches are split over ranks: DP=1 with
// grad_accum N and DP=W with grad_accum N/W give the same bits (tests/gdr/distributed_test.sh
// checks DP=1 x 4 against DP=2 x 2). Never a transport-ordered all-reduce: gradients are
// flattened in parameter order into FP32 buckets (boundaries a pure function of the shapes),
// each bucket is all-gathered, and every rank adds the W copies by the tree itself, so all
// ranks compute the same bits and reruns are byte-identical. Costs: (1 + W) x 64 MiB per
// queued bucket (up to kBucketsInFlight queued, so transfers run back to back), up to
// kDeferredLeaves - 1 leaf copies (16-bit when the leaves are) plus log2(M / 4) + 1 FP32
// partial sums while accumulating (Note [Deferred gradient leaves] in distributed.cc). With NCCL
// the all-gather is NCCL's (pure data movement, so NCCL_ALGO does not matter) and the tree runs on
// the GPU. Two ranks skip the all-gather: one all-reduce gives the same bits (Note [Two-rank
// all-reduce] in distributed.cc). Overlap with the backward: OverlappedReduction and RangeAllReduce
// below; sharded optimizer state (train.shard_optimizer_state): ProcessGroup::broadcast and
// Note [Sharded optimizer state] in gdr/trainer.cc.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace c10d {
class Backend;
}  // namespace c10d

namespace gdr {

struct DistEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  std::chrono::milliseconds timeout{60000};
};

// Reads the variables above through `get` (std::getenv by default; tests pass their own).
// InvalidArgument naming the variable for a non-integer, WORLD_SIZE < 1, RANK outside
// [0, WORLD_SIZE), a missing RANK or MASTER_PORT when WORLD_SIZE > 1, a port outside
// 1..65535, or GDR_DIST_TIMEOUT_S <= 0.
using EnvGetter = const char* (*)(const char*);
absl::StatusOr<DistEnv> read_dist_env(EnvGetter get = nullptr);

class ProcessGroup {
 public:
  // Rendezvous through a TCPStore at master_addr:master_port (rank 0 serves it) and a Gloo
  // process group over it. Unavailable (naming the address and timeout) when peers do not
  // arrive in time. `cuda`: a NCCL process group instead (the process binds CUDA device
  // LOCAL_RANK first); Unimplemented when the binary does not link //gdr:distributed_nccl.
  static absl::StatusOr<std::unique_ptr<ProcessGroup>> create(const DistEnv& env, bool cuda);
  ~ProcessGroup();

  int rank() const { return env_.rank; }
  int world_size() const { return env_.world_size; }

  // Every rank publishes `value` under `key`; all ranks get all values, in rank order.
  // Through the store: for small start-up data (config text, checksums), not tensors.
  absl::StatusOr<std::vector<std::string>> exchange(const std::string& key,
                                                    const std::string& value);

  // In place: each tensor becomes the sum over ranks, added by PairwiseSum in rank order
  // (Note [Gradient reduction tree]). Tensors must be FP32 on the group's device (CPU for Gloo,
  // CUDA for NCCL), and be the same shapes in the same order on every rank. `extra` (e.g. per-rank
  // losses) is gathered alongside: on return
  // (*gathered_extra)[r] is rank r's `extra`. Errors (a peer died, timed out) are
  // Unavailable naming the rank and the cause.
  // `bucket_elements` (default kBucketElements) is for tests of the bucketing.
  absl::Status all_reduce_sum(const std::vector<at::Tensor>& tensors,
                              const std::vector<double>& extra = {},
                              std::vector<std::vector<double>>* gathered_extra = nullptr,
                              int64_t bucket_elements = kBucketElements);

  // In place: every rank's `tensors` become root's (bit for bit: the bytes are moved, whatever
  // the dtype). The tensors must be contiguous, on the group's device, and the same shapes and
  // dtypes in the same order on every rank. Consecutive tensors are packed into byte buckets
  // of up to `bucket_bytes` (one collective each; a tensor larger than that goes alone, in
  // place). Sharded optimizer state (Note [Sharded optimizer state] in gdr/trainer.cc) sends
  // each owner's updated parameters with it. Unavailable, naming the rank, when a peer died or
  // timed out.
  absl::Status broadcast(const std::vector<at::Tensor>& tensors, int root,
                         int64_t bucket_bytes = 4 * kBucketElements);

  // Elements per FP32 bucket (64 MiB), and how many buckets' all-gathers may be queued
  // at once (memory: (1 + W) x 64 MiB each).
  static constexpr int64_t kBucketElements = int64_t{16} << 20;
  static constexpr int kBucketsInFlight = 8;

  // Tests only: with two ranks, reduce by the all-gather buckets too instead of Note
  // [Two-rank all-reduce]'s one all-reduce, so both paths can be checked against each other.
  void set_two_rank_all_reduce_for_testing(bool enabled);

 private:
  friend class OverlappedReduction;
  friend class RangeAllReduce;
  c10d::Backend& backend() const;  // Gloo or NCCL, for the reductions in distributed.cc
  struct Impl;
  ProcessGroup(DistEnv env, std::unique_ptr<Impl> impl);
  DistEnv env_;
  std::unique_ptr<Impl> impl_;
};

// Note [Two-rank all-reduce], started range by range: with two ranks, in-place all-reduces
// of consecutive ranges of the gradients' flat buffer, each started as soon as its range is
// final, so the transfers of earlier ranges run while later ranges are still being summed
// on the GPU (the trainer's last graphed microbatch, Note [Microbatch graphs]). The same
// bits as all_reduce_sum: each element is the one addition of the two ranks' values.
class RangeAllReduce {
 public:
  explicit RangeAllReduce(ProcessGroup& group);  // the group must have two ranks
  // Starts the all-reduce of `tensors` (FP32 on the group's device), in place: one
  // collective over the range they tile when they are consecutive views of one buffer (no
  // copy), else over a concatenated copy that finish() copies back.
  void start(const std::vector<at::Tensor>& tensors);
  // Waits for every started all-reduce. Unavailable, naming the rank, when a peer died or
  // timed out.
  absl::Status finish();
  ~RangeAllReduce();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Note [Overlapped gradient reduction] (train.overlap_grad_reduction): all_reduce_sum's
// reduction, started while the step's last microbatch is still in its backward. As each
// parameter's local sum becomes final (the trainer's hook on the last backward), it is
// copied into its FP32 bucket; a bucket's all-gather starts once the bucket and every
// bucket after it are complete, so buckets always start in the same order (last first, as
// backward produces them) on every rank, whatever order the hooks fire in. finish() waits
// and adds each bucket's W copies by the same rank-order tree as all_reduce_sum, so the
// result has the same bits as the non-overlapped path.
class OverlappedReduction {
 public:
  // `shapes`: the reduced tensors' shapes in parameter order, FP32 with `options` (the
  // group's device). Buckets as all_reduce_sum's.
  OverlappedReduction(ProcessGroup& group, const std::vector<std::vector<int64_t>>& shapes,
                      const at::TensorOptions& options,
                      int64_t bucket_elements = ProcessGroup::kBucketElements);
  // Tensor i's local sum is final (FP32, shapes[i]); call once per tensor. May start
  // all-gathers. Throws (c10::Error) on a shape mismatch or a repeated index.
  void set(size_t i, const at::Tensor& local_sum);
  // Starts any bucket not started yet (every tensor must have been set), waits for all,
  // and returns the reduced tensors in parameter order. Unavailable, naming the rank, when
  // a peer died or timed out; FailedPrecondition when a tensor was never set.
  absl::StatusOr<std::vector<at::Tensor>> finish();

  ~OverlappedReduction();

 private:
  void start_ready_buckets();  // last-first, stopping at the first incomplete bucket
  struct State;
  std::unique_ptr<State> state_;
};

// Pairwise summation of lists of tensors (e.g. one gradient per parameter), the fixed tree of
// See Note [Gradient reduction tree]: leaves are pushed in order; whenever the two newest
// partial sums cover equally many leaves they are merged (older += newer), as in a binary
// counter; finish() merges what is left, newest into older. For 2^j leaves this is the
// complete binary tree. Every merge is one FP32 add (16-bit leaves widen exactly). The
// adds are deferred and fused (Note [Deferred gradient leaves] in distributed.cc): the
// newest leaves are kept as they are and evaluated together with the partial sums in one
// pass per tensor (ops/tree_sum/tree_sum_op.h), which gives the same bits as adding them one by
// one.
class PairwiseSum {
 public:
  // Leaves kept unmerged at most; a full group of them is summed into one FP32 partial sum.
  static constexpr size_t kDeferredLeaves = 4;

  // Takes ownership of the tensors (they may become the sum's storage).
  void add(std::vector<at::Tensor> leaf);
  // add() of a leaf the caller keeps and leaves unchanged until its deferred group is
  // summed: at the add that completes the group of kDeferredLeaves (leaves
  // kDeferredLeaves * j .. kDeferredLeaves * j + kDeferredLeaves - 1 in add order), else
  // at finish() / finish_with_last() (the trainer's per-position graph leaves, Note
  // [Microbatch graphs]). No copy. The leaf may be BF16/FP16: widening is exact and every
  // merge adds in FP32, so the bits are those of add() of the leaf widened to FP32. The
  // sums of a PairwiseSum fed by add_kept come out as views of one FP32 buffer, in order
  // (Note [Two-rank all-reduce]).
  void add_kept(const std::vector<at::Tensor>& leaf);
  // Tensor i of the sum, with `last` as tensor i of one more leaf: exactly the adds that
  // add() of that leaf and then finish() would make for index i, in the same order (so the
  // same bits), done for this index alone (Note [Overlapped gradient reduction]) in one
  // pass. Writes into the kept storage of index i; call at most once per index, and use
  // neither add() nor finish() afterwards.
  at::Tensor finish_with_last(size_t i, at::Tensor last);
  // The sum; empty when nothing was added.
  std::vector<at::Tensor> finish();

 private:
  void merge_equal_levels();
  void allocate_sums_like(const std::vector<at::Tensor>& leaf);
  void collapse_deferred();
  // Where tensor i of the sum goes: the oldest FP32 partial sum, else the buffer
  // add_kept allocated, else the oldest deferred leaf when it is FP32, else a new tensor.
  at::Tensor destination(size_t i, const at::Tensor& like) const;
  // Tensor i of the sum of stack_, deferred_ and (when defined) `last`, in one pass.
  at::Tensor sum_of_index(size_t i, const at::Tensor& last) const;

  std::vector<std::pair<int64_t, std::vector<at::Tensor>>> stack_;  // (leaves, FP32 partial sum)
  std::vector<std::vector<at::Tensor>> deferred_;  // single leaves after stack_, in order
  std::vector<at::Tensor> sums_;                   // add_kept's FP32 output buffer (views)
};

// The owner of each of a model's parameters under sharded optimizer state (Note [Sharded
// optimizer state] in gdr/trainer.cc), a pure function of the sizes (numel, in named_parameters
// order) and the world size, so every rank computes the same plan: greedy, each parameter in
// order to the rank with the fewest owned elements so far, ties to the lowest rank. Every
// parameter has exactly one owner; the ranks' element counts differ by at most the largest
// parameter.
std::vector<int> optimizer_state_owners(const std::vector<int64_t>& numels, int world);

// Start-up agreement, every rank calling with its own value: OK when all ranks' values are
// equal, else FailedPrecondition on every rank, "<what> differs between ranks: rank 0 <v0>,
// rank R <vR>" (the first rank that differs from rank 0).
absl::Status check_same_on_all_ranks(ProcessGroup& group, const std::string& what,
                                     const std::string& value);

}  // namespace gdr
