// Segment-parallel gated delta rule: the plan rule and the ATen reference of the three
// passes (see ops/gdr_core/segment_parallel.h for the contract).
#include "ops/gdr_core/segment_parallel.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/eye.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <vector>

namespace gdr {

// Note [Segment-parallel gated delta rule]
// Why: the chunked core walks the chunks of one (batch, head) in order, so B * H sequential
// walks is all the parallelism there is; at B * H = 16 and T = 16384-65536 most of an H100's
// 132 SMs idle. Cutting T into segments that run in parallel fills them, as FlashQLA's
// auto_cp does (its segments start from an approximate state the decay makes good enough;
// here the combine is exact).
//
// The math. The state S is [dk, dv] (rows: key dims). Token t,
//   S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
// is affine in S_{t-1} with the dk x dk matrix on the LEFT (in the [dv, dk] orientation of
// some other codes it is S A on the right). So over any run of tokens, S_end = A S_start + B
// with A the product of the per-token matrices (later tokens on the left), depending on k,
// g, beta only, and B the end state from S_start = 0. Per chunk, step 7 of the spec,
//   S' = exp(G_last) S + K_to_end^T (U - W S) = (exp(G_last) I - K_to_end^T W) S + K_to_end^T U,
// so the WY / UT factors already give the chunk's map: A_n = exp(G_last_n) I - K_to_end_n^T W_n
// and B_n = K_to_end_n^T U_n. A segment's (A_seg, B_seg) is the walk of step 7 applied to
// X = [A | B] (dk x (dk + dv)) from X = [I | 0]: X' = exp(G_last) X + K_to_end^T ([0 | U] - W X).
//
// The three passes (gated_delta_rule_segmented; plan_gdr_segments picks the cut):
//   1. every segment but the last, in parallel: (A_i, B_i) as above (gdr_segment_transition);
//   2. sequentially, in segment order, FP32 (FP64 in the tests): S_0 = initial state,
//      S_{i+1} = A_i S_i + B_i (gdr_combine_segment_states): n - 1 small GEMMs
//      (dk x dk times dk x dv) per (batch, head);
//   3. every segment in parallel: the chunked core from its true initial state S_i, giving
//      o and (last segment) the final state.
// Padding: T is padded to num_segments * segment_len with g = beta = q = k = v = 0 tokens,
// which leave the state unchanged (decay 1, no write); their o rows are dropped.
//
// Cost. Pass 1 walks each segment with dk + dv state columns instead of dv and pass 3
// walks it again: about (dk + dv) / dv + 1 = 3x the state-update FLOPs of the plain walk for
// dk = dv (the prep, U / W / K_to_end, is shared in a kernel; this reference recomputes it).
// Memory: A_i and B_i, (dk^2 + dk dv) FP32 per (batch, head, segment), 128 KiB at
// dk = dv = 128 (16 MiB at B * H = 16, 8 segments). The combine is n sequential steps of
// 2 dk^2 dv FLOPs. It pays when the walk is latency bound, i.e. B * H * 3 < num_SMs roughly:
// n segments cut the sequential depth from N chunks to about 2 N / n (pass 1 then pass 3)
// + n combine steps, a gain from n = 3 on; with B * H * n <= num_SMs (one wave) the extra
// FLOPs run on SMs that would idle. Where B * H already (nearly) fills the GPU it only adds
// work, so the plan keeps one segment there (plan_gdr_segments in segment_parallel.h).
//
// Determinism. The plan is a pure function of (B, T, H, chunk, num_sms), never of timings,
// and the combine runs in one fixed order, so the bits depend on the shapes and the device's
// SM count only (fix num_sms in deterministic mode to make them device independent).
// Segmented and unsegmented results differ by rounding (the combine reassociates the
// chunk products), so switching plans changes bits, like changing the chunk size.
//
// The CUDA version must: share one prep between passes 1 and 3 (U, W, K_to_end, G_last per
// chunk do not depend on the state); run pass 1 as the state-pass kernel with dk + dv
// columns (or A and B as two column blocks) with one CTA per (batch, head, segment, column
// block); keep the combine in FP32 in segment order (one small kernel, or the pass-3 CTAs
// of segment i waiting on a flag in order; never atomics); read S_i in pass 3 as the
// initial state; and for the backward walk the combine in reverse (dS_i = A_i^T dS_{i+1} +
// segment i's pass-3 gradient of its initial state, dA_i = dS_{i+1} S_i^T, dB_i = dS_{i+1})
// and the segments in parallel, with the same plan.
// This reference is differentiated by autograd of the composite.

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

at::ScalarType compute_dtype_of(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (t->scalar_type() == at::kDouble) return at::kDouble;
  }
  return at::kFloat;
}

void check_plan(const char* op, const GdrSegmentPlan& plan, int64_t T) {
  TORCH_CHECK(plan.chunk > 0 && plan.segment_len > 0 && plan.segment_len % plan.chunk == 0, op,
              ": expected a segment length that is a positive multiple of the chunk size but got "
              "segment_len = ",
              plan.segment_len, ", chunk = ", plan.chunk);
  TORCH_CHECK(plan.num_segments == ceil_div(T, plan.segment_len), op, ": the plan has ",
              plan.num_segments, " segments of ", plan.segment_len, " tokens but T = ", T,
              " needs ", ceil_div(T, plan.segment_len));
}

// x [B, T, ...] -> [B * n, L, ...], zero padded from T to n * L tokens.
at::Tensor to_segments(const at::Tensor& x, int64_t n, int64_t L) {
  const int64_t pad = n * L - x.size(1);
  at::Tensor y = x;
  if (pad > 0) {
    std::vector<int64_t> spec(2 * (x.dim() - 2), 0);  // the dims after T: no padding
    spec.push_back(0);
    spec.push_back(pad);
    y = at::constant_pad_nd(x, spec, 0.0);
  }
  std::vector<int64_t> shape{x.size(0) * n, L};
  for (int64_t d = 2; d < x.dim(); ++d) shape.push_back(x.size(d));
  return y.reshape(shape);
}

}  // namespace

GdrSegmentPlan gdr_segment_plan_of_length(int64_t T, int64_t segment_len, int64_t chunk) {
  TORCH_CHECK(T > 0, "gdr_segment_plan_of_length: expected T > 0 but got ", T);
  TORCH_CHECK(chunk > 0 && segment_len > 0 && segment_len % chunk == 0,
              "gdr_segment_plan_of_length: expected a segment length that is a positive multiple "
              "of the chunk size but got segment_len = ",
              segment_len, ", chunk = ", chunk);
  return {chunk, segment_len, ceil_div(T, segment_len)};
}

GdrSegmentPlan plan_gdr_segments(int64_t B, int64_t T, int64_t H, int64_t chunk, int64_t num_sms) {
  TORCH_CHECK(B > 0 && T > 0 && H > 0 && chunk > 0 && num_sms > 0,
              "plan_gdr_segments: expected positive B, T, H, chunk and num_sms but got B = ", B,
              ", T = ", T, ", H = ", H, ", chunk = ", chunk, ", num_sms = ", num_sms);
  const int64_t N = ceil_div(T, chunk);
  const GdrSegmentPlan whole{chunk, N * chunk, 1};
  // B * H > num_sms (checked without forming the product, which could overflow) or within a
  // factor of kGdrMinSegments of it: the heads alone (nearly) fill the GPU.
  if (B > num_sms || H > num_sms || B * H > num_sms / kGdrMinSegments) return whole;
  const int64_t n_max = num_sms / (B * H);
  const int64_t chunks_per_segment = std::max(kGdrMinSegmentChunks, ceil_div(N, n_max));
  const int64_t n = ceil_div(N, chunks_per_segment);
  if (n < kGdrMinSegments) return whole;
  return {chunk, chunks_per_segment * chunk, n};
}

std::tuple<at::Tensor, at::Tensor> gdr_segment_transition(const at::Tensor& k, const at::Tensor& v,
                                                          const at::Tensor& g,
                                                          const at::Tensor& beta, int64_t chunk,
                                                          GdrQkNorm qk_norm) {
  // The prep's q slot gets k (its Q_decayed and P are not used here).
  const auto [U, W, Q_decayed, P, K_to_end, G_last] =
      chunk_prep_composite(k, k, v, g, beta, 1.0, chunk, qk_norm);
  (void)Q_decayed;
  (void)P;
  const int64_t B = U.size(0), H = U.size(1), N = U.size(2), dk = W.size(-1), dv = U.size(-1);
  const auto options = U.options();
  // X = [A | B] from [I | 0], then step 7's walk on all dk + dv columns.
  at::Tensor X = at::cat(
      {at::eye(dk, options).expand({B, H, dk, dk}), at::zeros({B, H, dk, dv}, options)}, -1);
  for (int64_t n = 0; n < N; ++n) {
    const at::Tensor W_n = W.select(2, n);  // [B, H, C, dk]
    const at::Tensor rhs = at::cat({at::zeros({B, H, U.size(3), dk}, options), U.select(2, n)},
                                   -1);  // [B, H, C, dk + dv]
    const at::Tensor decay = G_last.select(2, n).exp().unsqueeze(-1).unsqueeze(-1);
    X = X * decay + K_to_end.select(2, n).transpose(-1, -2).matmul(rhs - W_n.matmul(X));
  }
  return {X.narrow(-1, 0, dk), X.narrow(-1, dk, dv)};
}

at::Tensor gdr_combine_segment_states(const at::Tensor& A, const at::Tensor& Bs,
                                      const at::Tensor& S0) {
  TORCH_CHECK(A.dim() == 5 && Bs.dim() == 5 && A.size(-1) == A.size(-2) &&
                  Bs.sizes().slice(0, 4) == A.sizes().slice(0, 4),
              "gdr_combine_segment_states: expected A [B, n, H, dk, dk] and Bs [B, n, H, dk, dv] "
              "but got ",
              A.sizes(), " and ", Bs.sizes());
  TORCH_CHECK(S0.dim() == 4 && S0.size(0) == A.size(0) && S0.size(1) == A.size(2) &&
                  S0.size(2) == A.size(3) && S0.size(3) == Bs.size(4),
              "gdr_combine_segment_states: expected S0 [B, H, dk, dv] matching A and Bs but got ",
              S0.sizes());
  std::vector<at::Tensor> states{S0.to(A.scalar_type())};
  states.reserve(A.size(1) + 1);
  for (int64_t i = 0; i < A.size(1); ++i) {  // fixed order: segment 0 first
    states.push_back(A.select(1, i).matmul(states.back()) + Bs.select(1, i));
  }
  return at::stack(states, 1);
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule_segmented(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, const GdrSegmentPlan& plan,
    const std::optional<at::Tensor>& initial_state, bool output_final_state, GdrQkNorm qk_norm) {
  const char* op = "gated_delta_rule_segmented";
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4 && q.size(0) == v.size(0) && q.size(1) == v.size(1) &&
                  q.size(1) > 0,
              op, ": expected q [B, T, Hk, dk] and v [B, T, H, dv] with T > 0 but got ", q.sizes(),
              " and ", v.sizes());
  const int64_t B = q.size(0), T = q.size(1), H = v.size(2), dk = q.size(3), dv = v.size(3);
  check_plan(op, plan, T);
  const int64_t n = plan.num_segments, L = plan.segment_len;
  if (n == 1) {
    return gated_delta_rule_chunked(q, k, v, g, beta, scale, initial_state, output_final_state,
                                    plan.chunk, qk_norm);
  }
  const at::ScalarType ct = compute_dtype_of({&q, &k, &v, &g, &beta});
  const auto options = q.options().dtype(ct);
  const bool has_initial = initial_state.has_value() && initial_state->defined();
  if (has_initial) {
    TORCH_CHECK(initial_state->dim() == 4 && initial_state->size(0) == B &&
                    initial_state->size(1) == H && initial_state->size(2) == dk &&
                    initial_state->size(3) == dv,
                op, ": expected initial_state of shape [", B, ", ", H, ", ", dk, ", ", dv,
                "] ([B, H, dk, dv]) but got ", initial_state->sizes());
  }

  // Pass 1: segments 0 .. n-2 (all full, no padding), batched as B * (n - 1) sequences.
  const int64_t head = (n - 1) * L;
  auto first_segments = [&](const at::Tensor& x) {
    return to_segments(x.narrow(1, 0, head), n - 1, L);
  };
  auto [A, Bs] = gdr_segment_transition(first_segments(k), first_segments(v), first_segments(g),
                                        first_segments(beta), plan.chunk, qk_norm);

  // Pass 2: the state entering every segment, in segment order.
  const at::Tensor S0 = has_initial ? initial_state->to(ct) : at::zeros({B, H, dk, dv}, options);
  const at::Tensor starts = gdr_combine_segment_states(A.reshape({B, n - 1, H, dk, dk}),
                                                       Bs.reshape({B, n - 1, H, dk, dv}), S0)
                                .reshape({B * n, H, dk, dv});

  // Pass 3: every segment from its true initial state.
  auto [o, finals] = gated_delta_rule_chunked(
      to_segments(q, n, L), to_segments(k, n, L), to_segments(v, n, L), to_segments(g, n, L),
      to_segments(beta, n, L), scale, starts, output_final_state, plan.chunk, qk_norm);
  o = o.reshape({B, n * L, H, dv}).narrow(1, 0, T);
  if (!output_final_state) return {o, at::Tensor()};
  return {o, finals.reshape({B, n, H, dk, dv}).select(1, n - 1)};
}

}  // namespace gdr
