// Fused causal-LM cross-entropy, forward and backward, read from the logits in place:
//   loss = sum_n [y_n != ignore] (logsumexp(x_n) - x_n[y_n]) / count,
//   count = #{n : y_n != ignore}
// over the scored rows n = (b, t), t < T - 1, of logits [B, T, V], with target
// y_n = labels[b, t + 1] (the causal shift; the last position of every sequence is not
// scored). Plain C++ (no CUDA or torch headers): the launch rules are host code,
// testable without a GPU.
//
// Layout contract: logits [B, T, V] with unit vocab stride and any batch / token strides
// (elements), so a narrow() of a wider tensor needs no copy; labels [B, T] int64 with any
// strides. Logits in FP32, FP16 or BF16 (LogitsDtype); math is FP32. Outputs: row_loss and
// row_lse FP32 [B, T - 1] contiguous (row n = b * (T - 1) + t); loss and count FP32
// scalars; grad_logits [B, T, V] contiguous in the logits dtype (zero on the last
// position and on ignored rows, so the full logits shape comes back and no pad is needed).
// Every launcher runs on the stream it is given.
//
// Note [Cross-entropy determinism]: every output is deterministic by construction (no
// atomics). A row is owned by one block whose thread count is a pure function of V
// (cross_entropy_block_threads); each thread folds its fixed share of the row (elements
// in ascending order) into an online (max, sum-exp) pair, the pairs are combined by a
// warp xor butterfly (commutative, so every lane ends with the same bits) and then by
// thread 0 over the warps in warp order. The mean is a second kernel on the same stream:
// one block, thread i sums rows i, i + kCrossEntropyReduceThreads, ... in order, then a
// fixed shared-memory tree; its order depends on the row count alone. The backward is
// elementwise. The bits are thus a function of the inputs, V, the dtype and whether the
// rows are 16-byte aligned (vectorised loads change which thread owns which element).
//
// Out-of-range targets: a target outside [0, V) that is not ignore_index never reads
// outside the row: its row loss is NaN (so the mean is NaN) and its gradient row is NaN.
// The op checks the labels on the host before launching (ops/cross_entropy/cross_entropy_op.h).
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

enum class LogitsDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// What the three kernels share: the logits, the labels and the row geometry.
struct CrossEntropyProblem {
  LogitsDtype dtype = LogitsDtype::kFloat32;
  int64_t batch = 0;   // B
  int64_t tokens = 0;  // T >= 2
  int64_t vocab = 0;   // V >= 1
  const void* logits = nullptr;
  int64_t logits_batch_stride = 0;  // elements
  int64_t logits_token_stride = 0;  // elements; the vocab stride is 1
  const int64_t* labels = nullptr;
  int64_t labels_batch_stride = 0;
  int64_t labels_token_stride = 0;
  int64_t ignore_index = -100;
};

// B * (T - 1): the rows that are scored.
int64_t cross_entropy_scored_rows(const CrossEntropyProblem& p);

// Threads of the forward and backward blocks (one block per row): a power of two in
// [32, kCrossEntropyMaxThreads], about one 16-byte pack per thread per pass for short
// rows. A pure function of V (Note [Cross-entropy determinism]).
constexpr int kCrossEntropyMaxThreads = 512;
int cross_entropy_block_threads(int64_t vocab);

// Packs loaded before any is consumed, per thread and loop trip: memory-level
// parallelism for long rows. It does not change which thread owns which element.
constexpr int kCrossEntropyUnroll = 4;

// The ordered mean: one block of this many threads.
constexpr int kCrossEntropyReduceThreads = 512;

// True when the problem can be launched: T >= 2, V >= 1, B >= 0, the rows fit the grid.
bool cross_entropy_supports(const CrossEntropyProblem& p);

struct CrossEntropyForwardArgs {
  CrossEntropyProblem problem;
  float* row_loss = nullptr;  // [B, T - 1]; 0 on ignored rows, NaN on out-of-range targets
  float* row_lse = nullptr;   // [B, T - 1]; 0 on ignored rows
};

// One block per scored row. Returns 0 (cudaSuccess) or the CUDA error code of the launch.
int launch_cross_entropy_forward(const CrossEntropyForwardArgs& args, CUstream_st* stream);

// loss[0] = sum(row_loss) / count, count[0] = number of rows whose target is not
// ignore_index (as FP32, ATen's total_weight); 0 / 0 = NaN when every row is ignored,
// like ATen's Mean reduction. One block; reads the labels again for the count.
int launch_cross_entropy_reduce(const CrossEntropyProblem& problem, const float* row_loss,
                                float* loss, float* count, CUstream_st* stream);

struct CrossEntropyBackwardArgs {
  CrossEntropyProblem problem;
  const float* row_lse = nullptr;    // [B, T - 1], from the forward
  const float* grad_loss = nullptr;  // device scalar: the upstream gradient g
  const float* count = nullptr;      // device scalar, from the reduce
  void* grad_logits = nullptr;       // [B, T, V] contiguous, logits dtype
};

// grad[b, t, v] = g / count * (exp(x[v] - lse) - [v == y]) on scored rows with a counted
// target, 0 elsewhere. One block per row of [B, T, V].
int launch_cross_entropy_backward(const CrossEntropyBackwardArgs& args, CUstream_st* stream);

}  // namespace gdr::kernels
