// Segment-parallel (intra-sequence parallel) gated delta rule: the segment plan and the
// ATen reference of the three passes (Note [Segment-parallel gated delta rule] in
// ops/gdr_core/segment_parallel.cc). The CUDA kernels are future work; this is the algorithm
// and the reference they will be tested against.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>

#include "ops/gdr_core/gdr_core_op.h"

namespace gdr {

// A sequence of T tokens cut into num_segments segments of segment_len tokens (the last
// one holds the rest): segment_len is a multiple of chunk and
// (num_segments - 1) * segment_len < T <= num_segments * segment_len, so no segment is
// empty. num_segments == 1 is the unsegmented core.
struct GdrSegmentPlan {
  int64_t chunk = kGdrChunkSize;
  int64_t segment_len = kGdrChunkSize;
  int64_t num_segments = 1;
};

// No segment shorter than this many chunks (the per-segment fixed costs, the combine step
// and a kernel's pipeline fill, must be amortised; FlashQLA's auto_cp uses the same floor).
constexpr int64_t kGdrMinSegmentChunks = 4;

// Fewer segments than this do not pay: pass 1 and pass 3 each walk a segment, so n segments
// cut the sequential depth from N chunks to about 2 N / n (+ n combine steps), a gain only
// for n >= 3 (Note [Segment-parallel gated delta rule]).
constexpr int64_t kGdrMinSegments = 3;

// The plan rule, a pure function of the shapes (no timing, so the bits never depend on the
// run). With N = ceil(T / chunk) chunks and B * H independent (batch, head) walks, one CTA
// each, and at most one wave of (batch, head, segment) walks, n_max = floor(num_sms / (B * H)):
//   - n_max < kGdrMinSegments (B * H > num_sms / 3: the heads nearly fill the GPU): one
//     segment (FlashQLA's auto_cp stops near the same line, B * H > 40 on sm_90, but sizes
//     its segments by a latency model, ~3 sqrt(B H N / num_sms) chunks, a power of two);
//   - else segments of c = max(kGdrMinSegmentChunks, ceil(N / n_max)) chunks, ceil(N / c) of
//     them (the last one the shorter, never empty), or one segment if that is fewer than
//     kGdrMinSegments (so T of at most 2 * kGdrMinSegmentChunks chunks always runs whole).
// E.g. B * H = 16, T = 16384, chunk 64, 132 SMs: 8 segments of 2048 tokens; B * H = 1,
// T = 65536: 128 segments of 512 tokens.
GdrSegmentPlan plan_gdr_segments(int64_t B, int64_t T, int64_t H, int64_t chunk, int64_t num_sms);

// The plan with segments of segment_len tokens (a positive multiple of chunk): for tests and
// callers that choose it themselves.
GdrSegmentPlan gdr_segment_plan_of_length(int64_t T, int64_t segment_len, int64_t chunk);

// Pass 1 for whole sequences: the state map of the tokens of k, v, g, beta
// ([B, T, Hk, dk], [B, T, H, dv], [B, T, H], [B, T, H]) as an affine map of the initial
// state, final = A S0 + Bs for every S0 [B, H, dk, dv]: returns (A [B, H, dk, dk],
// Bs [B, H, dk, dv]) in the compute dtype (FP64 when any input is, else FP32). A depends
// on k, g, beta only; Bs is the final state from S0 = 0. Built from the chunked form's
// per-chunk factors (chunk_prep_composite), qk_norm as in gated_delta_rule.
std::tuple<at::Tensor, at::Tensor> gdr_segment_transition(const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& g,
                                                          const at::Tensor& beta, int64_t chunk,
                                                          GdrQkNorm qk_norm = GdrQkNorm::kNone);

// Pass 2: A [B, n, H, dk, dk], Bs [B, n, H, dk, dv] (segments 0 .. n-1 in order), S0
// [B, H, dk, dv] -> the state at every segment boundary, [B, n + 1, H, dk, dv]: entry 0 is
// S0 and entry i + 1 is A_i (entry i) + Bs_i, one step after the other in segment order, in
// the dtype of A.
at::Tensor gdr_combine_segment_states(const at::Tensor& A, const at::Tensor& Bs,
                                      const at::Tensor& S0);

// The gated delta rule through the plan: the contract of gated_delta_rule_chunked
// (ops/gdr_core/gdr_core_op.h; its chunk size is plan.chunk) with the same o and final state
// up to rounding. Pass 1 runs every segment but the last in parallel (batched), pass 2
// combines in segment order, pass 3 runs gated_delta_rule_chunked over all segments batched,
// each from its true initial state. One segment is gated_delta_rule_chunked itself.
// Differentiable through libtorch autograd of the composite (no hand-written backward yet).
std::tuple<at::Tensor, at::Tensor> gated_delta_rule_segmented(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, const GdrSegmentPlan& plan,
    const std::optional<at::Tensor>& initial_state = std::nullopt, bool output_final_state = false,
    GdrQkNorm qk_norm = GdrQkNorm::kNone);

}  // namespace gdr
