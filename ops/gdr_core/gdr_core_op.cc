// The gated delta rule core: argument checks, the chunked training algorithm and the
// token-by-token reference, both as compositions of ATen ops so autograd differentiates
// them (see ops/gdr_core/gdr_core_op.h for the contract).
#include "ops/gdr_core/gdr_core_op.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/eye.h>
#include <ATen/ops/linalg_solve_triangular.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "kernels/gdr_core/chunk_prep.h"
#include "kernels/gdr_core/chunk_state.h"
#include "ops/gdr_core/chunk_prep_op.h"
#include "ops/gdr_core/chunk_state_op.h"
#include "ops/packed/packed_documents.h"

namespace gdr {
namespace {

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

// FP64 only when a caller asked for it (reference tests); otherwise FP32, never lower:
// the decay products and the triangular solve lose too much in 16-bit types.
at::ScalarType compute_dtype(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta) {
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) {
    if (t->scalar_type() == at::kDouble) return at::kDouble;
  }
  return at::kFloat;
}

void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& g, const at::Tensor& beta,
                  const std::optional<at::Tensor>& initial_state) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined() && g.defined() && beta.defined(), op,
              ": q, k, v, g and beta must all be defined");
  TORCH_CHECK(q.dim() == 4 && q.size(2) > 0, op,
              ": expected q of shape [B, T, Hk, dk] with Hk > 0 but got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": expected k of shape ", q.sizes(),
              " (same as q) but got ", k.sizes());
  TORCH_CHECK(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1), op,
              ": expected v of shape [", q.size(0), ", ", q.size(1),
              ", H, dv] (B, T of q) but got ", v.sizes());
  TORCH_CHECK(
      v.size(2) > 0 && v.size(2) % q.size(2) == 0, op,
      ": expected v's head count H to be a multiple of q and k's head count Hk but got H = ",
      v.size(2), ", Hk = ", q.size(2));
  const at::IntArrayRef bth = v.sizes().slice(0, 3);
  TORCH_CHECK(g.sizes() == bth, op, ": expected g of shape ", bth, " but got ", g.sizes());
  TORCH_CHECK(beta.sizes() == bth, op, ": expected beta of shape ", bth, " but got ", beta.sizes());
  TORCH_CHECK(q.size(1) > 0, op, ": expected at least one token but got T = 0");
  for (const at::Tensor* t : {&q, &k, &v, &g, &beta}) {
    TORCH_CHECK(is_float_dtype(t->scalar_type()), op,
                ": expected floating-point inputs (Float, BFloat16, Half, Double) but got ",
                t->scalar_type());
    TORCH_CHECK(t->device() == q.device(), op, ": expected all inputs on ", q.device(),
                " (q's device) but got one on ", t->device());
  }
  TORCH_CHECK(k.scalar_type() == q.scalar_type(), op, ": expected q and k of one dtype but got ",
              q.scalar_type(), " and ", k.scalar_type());
  if (initial_state.has_value() && initial_state->defined()) {
    const at::Tensor& s = *initial_state;
    TORCH_CHECK(s.dim() == 4 && s.size(0) == q.size(0) && s.size(1) == v.size(2) &&
                    s.size(2) == q.size(3) && s.size(3) == v.size(3),
                op, ": expected initial_state of shape [", q.size(0), ", ", v.size(2), ", ",
                q.size(3), ", ", v.size(3), "] ([B, H, dk, dv]) but got ", s.sizes());
    TORCH_CHECK(s.device() == q.device(), op, ": expected initial_state on ", q.device(),
                " but got ", s.device());
  }
}

at::Tensor initial_state_or_zeros(const std::optional<at::Tensor>& initial_state, int64_t B,
                                  int64_t H, int64_t dk, int64_t dv,
                                  const at::TensorOptions& options) {
  if (initial_state.has_value() && initial_state->defined()) {
    return initial_state->to(options.dtype());
  }
  return at::zeros({B, H, dk, dv}, options);
}

// Note [Chunk output layout]
// The state pass leaves O in the chunk layout [B, H, N, C, dv] (FP32, padded tail rows);
// the caller wants o [B, T, H, dv] in v's dtype. As ATen views (reshape -> narrow ->
// transpose -> to) that costs a cast in the forward for 16-bit v, hands the model a
// transposed (strided) o, and in the backward a cast, a zero fill of the whole padded
// gradient and a strided copy into it (narrow's backward), then a contiguous() copy for
// the batched matmuls. This function does the same values in one pass each way
// (gdr::chunks_to_tokens / gdr::tokens_to_chunks, on CUDA one kernel each,
// kernels/gdr_core/chunk_layout.h): forward, one cast-and-transpose copy into a contiguous o;
// backward, one copy of grad_o (any layout and floating dtype) into the chunk layout with
// the padded tail rows zeroed (their gradient must be exactly zero: the state pass
// backward multiplies them by zeros of P and Qd, and 0 * garbage could be NaN). Copies
// are exact, so the numbers are those of the view chain.
class ChunksToTokens : public torch::autograd::Function<ChunksToTokens> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& o_chunks,
                            int64_t tokens, at::ScalarType dtype) {
    ctx->saved_data["chunks"] = o_chunks.size(2);
    ctx->saved_data["chunk"] = o_chunks.size(3);
    ctx->saved_data["dtype"] = static_cast<int64_t>(o_chunks.scalar_type());
    ctx->set_materialize_grads(false);
    return chunks_to_tokens(o_chunks, tokens, dtype);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const int64_t N = ctx->saved_data["chunks"].toInt(), C = ctx->saved_data["chunk"].toInt();
    const auto dtype = static_cast<at::ScalarType>(ctx->saved_data["dtype"].toInt());
    return {tokens_to_chunks(grad, N, C, dtype), at::Tensor(), at::Tensor()};
  }
};

std::atomic<int> g_last_step7{static_cast<int>(GdrCoreImpl::kComposite)};
std::atomic<bool> g_op_on_cpu_for_testing{false};
std::atomic<int> g_last_prep{static_cast<int>(GdrCorePrep::kAten)};
std::atomic<bool> g_prep_op_on_cpu_for_testing{false};

// Steps 1-6 by the chunk_prep op: only where its CUDA kernels apply (see the header), or
// on CPU (its reference implementation, any dtype, shape and chunk size) when a test
// asked for it.
bool use_chunk_prep_kernel(const at::Tensor& q, at::ScalarType ct, int64_t C, int64_t dk,
                           int64_t dv) {
  if (!q.is_cuda()) {
    return g_prep_op_on_cpu_for_testing.load() &&
           current_execution_policy().gdr_core_prep == GdrCorePrep::kKernel;
  }
  if (current_execution_policy().gdr_core_prep != GdrCorePrep::kKernel) return false;
  if (ct != at::kFloat || C != kernels::kChunkPrepChunk || !kernels::chunk_prep_supports(dk, dv)) {
    return false;
  }
  TORCH_CHECK(chunk_prep_has_cuda_kernel(),
              "gated_delta_rule_chunked: the GDR core prep implementation is 'kernel' but this "
              "binary has no CUDA implementation of gdr::chunk_prep; link //ops:cuda_ops or set "
              "kernels.gdr_core_prep: aten");
  return true;
}

// Step 7 by the chunk_state_pass op: only where its CUDA kernel applies (see the header),
// or on CPU (any shape and dtype: the op's CPU implementation) when a test asked for it.
bool use_chunk_state_kernel(const at::Tensor& q, at::ScalarType ct, int64_t C, int64_t dk,
                            int64_t dv) {
  if (!q.is_cuda()) {
    return g_op_on_cpu_for_testing.load() &&
           current_execution_policy().gdr_core_impl == GdrCoreImpl::kKernel;
  }
  if (current_execution_policy().gdr_core_impl != GdrCoreImpl::kKernel) return false;
  if (ct != at::kFloat || C != kernels::kChunkStateChunk ||
      !kernels::chunk_state_scan_supports(dk, dv)) {
    return false;
  }
  TORCH_CHECK(chunk_state_pass_has_cuda_kernel(),
              "gated_delta_rule_chunked: the GDR core implementation is 'kernel' but this binary "
              "has no CUDA implementation of gdr::chunk_state_pass; link //ops:cuda_ops or set "
              "kernels.gdr_core_impl: composite");
  return true;
}

}  // namespace

GdrCoreImpl gdr_core_last_step7() { return static_cast<GdrCoreImpl>(g_last_step7.load()); }

void set_gdr_core_op_on_cpu_for_testing(bool enabled) { g_op_on_cpu_for_testing.store(enabled); }

GdrCorePrep gdr_core_last_prep() { return static_cast<GdrCorePrep>(g_last_prep.load()); }

void set_gdr_core_prep_op_on_cpu_for_testing(bool enabled) {
  g_prep_op_on_cpu_for_testing.store(enabled);
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule(const at::Tensor& q, const at::Tensor& k,
                                                    const at::Tensor& v, const at::Tensor& g,
                                                    const at::Tensor& beta, double scale,
                                                    const std::optional<at::Tensor>& initial_state,
                                                    bool output_final_state, GdrQkNorm qk_norm) {
  return gated_delta_rule_chunked(q, k, v, g, beta, scale, initial_state, output_final_state,
                                  kGdrChunkSize, qk_norm);
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule_varlen(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, const std::vector<int64_t>& cu_seqlens,
    const std::optional<at::Tensor>& initial_state, bool output_final_state, GdrQkNorm qk_norm) {
  const char* op = "gated_delta_rule_varlen";
  TORCH_CHECK(q.dim() == 4 && q.size(0) == 1, op,
              ": expected packed q of shape [1, T, Hk, dk] but got ", q.sizes());
  TORCH_CHECK(v.dim() == 4 && v.size(0) == 1 && v.size(1) == q.size(1), op,
              ": expected packed v of shape [1, ", q.size(1), ", H, dv] (T of q) but got ",
              v.sizes());
  const int64_t T = q.size(1), H = v.size(2), dk = q.size(3);
  check_cu_seqlens(op, cu_seqlens, T);
  const int64_t N = static_cast<int64_t>(cu_seqlens.size()) - 1;
  const bool has_initial = initial_state.has_value() && initial_state->defined();
  if (has_initial) {
    const at::Tensor& s = *initial_state;
    TORCH_CHECK(s.dim() == 4 && s.size(0) == N && s.size(1) == H && s.size(2) == dk &&
                    s.size(3) == v.size(-1),
                op, ": expected initial_state of shape [", N, ", ", H, ", ", dk, ", ", v.size(-1),
                "] ([documents, H, dk, dv]) but got ", s.sizes());
  }
  // One split per input (Note [Packed documents] in ops/packed/packed_documents.h).
  const std::vector<at::Tensor> qs = split_documents(op, q, 1, cu_seqlens),
                                ks = split_documents(op, k, 1, cu_seqlens),
                                vs = split_documents(op, v, 1, cu_seqlens),
                                gs = split_documents(op, g, 1, cu_seqlens),
                                betas = split_documents(op, beta, 1, cu_seqlens);
  std::vector<at::Tensor> initial_states;
  if (has_initial) initial_states = initial_state->split(1, 0);
  std::vector<at::Tensor> outputs, finals;
  for (int64_t i = 0; i < N; ++i) {
    std::optional<at::Tensor> s0;
    if (has_initial) s0 = initial_states[i];
    if (qs[i].size(1) == 0) {
      if (output_final_state) {
        finals.push_back(has_initial
                             ? s0->to(compute_dtype(q, k, v, g, beta))
                             : at::zeros({1, H, dk, v.size(-1)},
                                         q.options().dtype(compute_dtype(q, k, v, g, beta))));
      }
      continue;
    }
    auto [o, final_state] = gated_delta_rule(qs[i], ks[i], vs[i], gs[i], betas[i], scale, s0,
                                             output_final_state, qk_norm);
    outputs.push_back(o);
    if (output_final_state) finals.push_back(final_state);
  }
  TORCH_CHECK(!outputs.empty(), op, ": expected at least one token but got T = 0");
  return {at::cat(outputs, /*dim=*/1), output_final_state ? at::cat(finals, 0) : at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule_recurrent(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
    bool output_final_state, GdrQkNorm qk_norm) {
  check_inputs("gated_delta_rule_recurrent", q, k, v, g, beta, initial_state);
  const int64_t B = q.size(0), T = q.size(1), H = v.size(2), dk = q.size(3), dv = v.size(3);
  const auto options = q.options().dtype(compute_dtype(q, k, v, g, beta));
  const at::ScalarType ct = options.dtype().toScalarType();
  const auto [q_rows, k_rows] = chunk_prep_qk(q, k, H, qk_norm == GdrQkNorm::kL2, ct);

  // [B, H, T, d] so that a token is one select along dim 2.
  const at::Tensor qc = q_rows.transpose(1, 2) * scale;
  const at::Tensor kc = k_rows.transpose(1, 2);
  const at::Tensor vc = v.to(ct).transpose(1, 2);
  const at::Tensor gc = g.to(ct).transpose(1, 2);
  const at::Tensor bc = beta.to(ct).transpose(1, 2);

  at::Tensor S = initial_state_or_zeros(initial_state, B, H, dk, dv, options);
  std::vector<at::Tensor> outputs;
  outputs.reserve(T);
  for (int64_t t = 0; t < T; ++t) {
    const at::Tensor q_t = qc.select(2, t);  // [B, H, dk]
    const at::Tensor k_t = kc.select(2, t);  // [B, H, dk]
    const at::Tensor v_t = vc.select(2, t);  // [B, H, dv]
    const at::Tensor decay = gc.select(2, t).exp().unsqueeze(-1).unsqueeze(-1);
    const at::Tensor beta_t = bc.select(2, t).unsqueeze(-1);  // [B, H, 1]
    S = S * decay;
    const at::Tensor predicted = k_t.unsqueeze(-2).matmul(S).squeeze(-2);  // S^T k: [B, H, dv]
    const at::Tensor u = beta_t * (v_t - predicted);
    S = S + k_t.unsqueeze(-1).matmul(u.unsqueeze(-2));
    outputs.push_back(q_t.unsqueeze(-2).matmul(S).squeeze(-2));  // S^T q: [B, H, dv]
  }
  at::Tensor o = at::stack(outputs, /*dim=*/1).to(v.scalar_type());  // [B, T, H, dv]
  return {o, output_final_state ? S : at::Tensor()};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_prep_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, double scale, int64_t chunk_size,
                     GdrQkNorm qk_norm) {
  check_inputs("chunk_prep_composite", q, k, v, g, beta, std::nullopt);
  TORCH_CHECK(chunk_size > 0, "chunk_prep_composite: expected chunk_size > 0 but got ", chunk_size);
  const int64_t B = q.size(0), T = q.size(1), H = v.size(2), dk = q.size(3), dv = v.size(3);
  const int64_t C = chunk_size;
  const int64_t N = (T + C - 1) / C;
  const int64_t pad = N * C - T;
  const auto options = q.options().dtype(compute_dtype(q, k, v, g, beta));
  const at::ScalarType ct = options.dtype().toScalarType();

  // Step 1: [B, H, N, C, d] with zero padding; padded rows have g = 0 (no decay) and
  // beta = k = 0 (no write), so they change neither the outputs kept nor the state.
  auto to_chunks = [&](const at::Tensor& x) {  // x: [B, T, H, d]
    at::Tensor y = x.to(ct).transpose(1, 2);   // [B, H, T, d]
    if (pad > 0) y = at::constant_pad_nd(y, {0, 0, 0, pad}, 0.0);
    return y.reshape({B, H, N, C, y.size(-1)});
  };
  auto scalars_to_chunks = [&](const at::Tensor& x) {  // x: [B, T, H]
    at::Tensor y = x.to(ct).transpose(1, 2);           // [B, H, T]
    if (pad > 0) y = at::constant_pad_nd(y, {0, pad}, 0.0);
    return y.reshape({B, H, N, C});
  };
  const auto [q_rows, k_rows] = chunk_prep_qk(q, k, H, qk_norm == GdrQkNorm::kL2, ct);
  const at::Tensor Q = to_chunks(q_rows) * scale;
  const at::Tensor K = to_chunks(k_rows);
  const at::Tensor V = to_chunks(v);
  const at::Tensor beta_c = scalars_to_chunks(beta).unsqueeze(-1);  // [B, H, N, C, 1]

  // Step 2.
  const at::Tensor Kb = K * beta_c;
  const at::Tensor Vb = V * beta_c;
  const at::Tensor G = scalars_to_chunks(g).cumsum(-1);  // inclusive, [B, H, N, C]
  const at::Tensor G_col = G.unsqueeze(-1);              // [B, H, N, C, 1]

  // Step 3: L[i, j] = exp(G_i - G_j) for i >= j. The upper triangle is zeroed before exp
  // (G_i - G_j > 0 there and could overflow), so neither value nor gradient sees inf.
  const at::Tensor lower = at::ones({C, C}, options.dtype(at::kBool)).tril();
  const at::Tensor diff = (G_col - G.unsqueeze(-2)).masked_fill(lower.logical_not(), 0.0);
  const at::Tensor L = diff.exp() * lower.to(ct);

  // Step 4/5: (I + M) [U | W] = [Vb | Kb * exp(G)] by a unit lower triangular solve, which
  // is T = (I + M)^-1 applied without forming it.
  const at::Tensor M = (Kb.matmul(K.transpose(-1, -2)) * L).tril(-1);
  const at::Tensor A = M + at::eye(C, options);
  const at::Tensor UW = at::linalg_solve_triangular(A, at::cat({Vb, Kb * G_col.exp()}, -1),
                                                    /*upper=*/false, /*left=*/true,
                                                    /*unitriangular=*/true);
  const at::Tensor U = UW.narrow(-1, 0, dv);
  const at::Tensor W = UW.narrow(-1, dv, dk);

  // Step 6: intra-chunk attention with the diagonal kept.
  const at::Tensor P = Q.matmul(K.transpose(-1, -2)) * L;

  const at::Tensor Q_decayed = Q * G_col.exp();
  const at::Tensor G_last = G.narrow(-1, C - 1, 1);  // [B, H, N, 1]
  const at::Tensor K_to_end = K * (G_last.unsqueeze(-1) - G_col).exp();
  return {U, W, Q_decayed, P, K_to_end, G_last.squeeze(-1)};
}

std::tuple<at::Tensor, at::Tensor> gated_delta_rule_chunked(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, const std::optional<at::Tensor>& initial_state,
    bool output_final_state, int64_t chunk_size, GdrQkNorm qk_norm) {
  check_inputs("gated_delta_rule_chunked", q, k, v, g, beta, initial_state);
  TORCH_CHECK(chunk_size > 0, "gated_delta_rule_chunked: expected chunk_size > 0 but got ",
              chunk_size);
  const int64_t B = q.size(0), T = q.size(1), H = v.size(2), dk = q.size(3), dv = v.size(3);
  const bool l2 = qk_norm == GdrQkNorm::kL2;
  const int64_t C = chunk_size;
  const int64_t N = (T + C - 1) / C;
  const auto options = q.options().dtype(compute_dtype(q, k, v, g, beta));
  const at::ScalarType ct = options.dtype().toScalarType();

  // Steps 1-6.
  at::Tensor U, W, Q_decayed, P, K_to_end, G_last;  // G_last: [B, H, N]
  if (use_chunk_prep_kernel(q, ct, C, dk, dv)) {
    g_last_prep.store(static_cast<int>(GdrCorePrep::kKernel));
    std::tie(U, W, Q_decayed, P, K_to_end, G_last) = chunk_prep(q, k, v, g, beta, scale, C, l2);
  } else {
    g_last_prep.store(static_cast<int>(GdrCorePrep::kAten));
    std::tie(U, W, Q_decayed, P, K_to_end, G_last) =
        chunk_prep_composite(q, k, v, g, beta, scale, C, qk_norm);
  }

  // Step 7: the only sequential part, one [dk, dv] state per (batch, head).
  if (use_chunk_state_kernel(q, ct, C, dk, dv)) {
    g_last_step7.store(static_cast<int>(GdrCoreImpl::kKernel));
    std::optional<at::Tensor> S0;
    if (initial_state.has_value() && initial_state->defined()) S0 = initial_state->to(ct);
    auto [o_chunks, S_final, states, v_new] =
        chunk_state_pass(U, W, Q_decayed, P, K_to_end, G_last, S0);
    // [B, T, H, dv] in v's dtype, contiguous (Note [Chunk output layout]).
    at::Tensor o = ChunksToTokens::apply(o_chunks, T, v.scalar_type());
    return {o, output_final_state ? S_final : at::Tensor()};
  }
  g_last_step7.store(static_cast<int>(GdrCoreImpl::kComposite));
  at::Tensor S = initial_state_or_zeros(initial_state, B, H, dk, dv, options);
  std::vector<at::Tensor> outputs;
  outputs.reserve(N);
  for (int64_t n = 0; n < N; ++n) {
    const at::Tensor Vn = U.select(2, n) - W.select(2, n).matmul(S);  // [B, H, C, dv]
    outputs.push_back(Q_decayed.select(2, n).matmul(S) + P.select(2, n).matmul(Vn));
    S = S * G_last.select(2, n).exp().unsqueeze(-1).unsqueeze(-1) +
        K_to_end.select(2, n).transpose(-1, -2).matmul(Vn);
  }
  at::Tensor o = at::stack(outputs, /*dim=*/2).reshape({B, H, N * C, dv});
  o = o.narrow(2, 0, T).transpose(1, 2).to(v.scalar_type());  // [B, T, H, dv]
  return {o, output_final_state ? S : at::Tensor()};
}

namespace chunk_layout_internal {

at::Tensor chunks_to_tokens_aten(const at::Tensor& o_chunks, int64_t tokens, at::ScalarType dtype) {
  const int64_t B = o_chunks.size(0), H = o_chunks.size(1), N = o_chunks.size(2),
                C = o_chunks.size(3), dv = o_chunks.size(4);
  at::Tensor o = at::empty({B, tokens, H, dv}, o_chunks.options().dtype(dtype));
  o.copy_(o_chunks.reshape({B, H, N * C, dv}).narrow(2, 0, tokens).transpose(1, 2));
  return o;
}

at::Tensor tokens_to_chunks_aten(const at::Tensor& grad_o, int64_t chunks, int64_t chunk,
                                 at::ScalarType dtype) {
  const int64_t B = grad_o.size(0), T = grad_o.size(1), H = grad_o.size(2), dv = grad_o.size(3);
  at::Tensor d = at::empty({B, H, chunks, chunk, dv}, grad_o.options().dtype(dtype));
  at::Tensor rows = d.view({B, H, chunks * chunk, dv});
  rows.narrow(2, 0, T).copy_(grad_o.transpose(1, 2));
  if (chunks * chunk > T) rows.narrow(2, T, chunks * chunk - T).zero_();
  return d;
}

void check_chunks_to_tokens(const at::Tensor& o_chunks, int64_t tokens) {
  TORCH_CHECK(o_chunks.dim() == 5,
              "chunks_to_tokens: expected o_chunks of shape [B, H, N, C, dv] but got ",
              o_chunks.sizes());
  TORCH_CHECK(tokens > 0 && tokens <= o_chunks.size(2) * o_chunks.size(3),
              "chunks_to_tokens: expected 0 < tokens <= N * C = ",
              o_chunks.size(2) * o_chunks.size(3), " but got tokens = ", tokens);
}

void check_tokens_to_chunks(const at::Tensor& grad_o, int64_t chunks, int64_t chunk) {
  TORCH_CHECK(grad_o.dim() == 4,
              "tokens_to_chunks: expected grad_o of shape [B, T, H, dv] but got ", grad_o.sizes());
  TORCH_CHECK(chunks > 0 && chunk > 0 && chunks * chunk >= grad_o.size(1),
              "tokens_to_chunks: expected chunks * chunk >= T = ", grad_o.size(1),
              " but got chunks = ", chunks, ", chunk = ", chunk);
}

}  // namespace chunk_layout_internal

namespace {

at::Tensor chunks_to_tokens_cpu(const at::Tensor& o_chunks, int64_t tokens, at::ScalarType dtype) {
  chunk_layout_internal::check_chunks_to_tokens(o_chunks, tokens);
  return chunk_layout_internal::chunks_to_tokens_aten(o_chunks, tokens, dtype);
}

at::Tensor tokens_to_chunks_cpu(const at::Tensor& grad_o, int64_t chunks, int64_t chunk,
                                at::ScalarType dtype) {
  chunk_layout_internal::check_tokens_to_chunks(grad_o, chunks, chunk);
  return chunk_layout_internal::tokens_to_chunks_aten(grad_o, chunks, chunk, dtype);
}

}  // namespace

at::Tensor chunks_to_tokens(const at::Tensor& o_chunks, int64_t tokens, at::ScalarType dtype) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::chunks_to_tokens", "")
                             .typed<at::Tensor(const at::Tensor&, int64_t, at::ScalarType)>();
  return op.call(o_chunks, tokens, dtype);
}

at::Tensor tokens_to_chunks(const at::Tensor& grad_o, int64_t chunks, int64_t chunk,
                            at::ScalarType dtype) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gdr::tokens_to_chunks", "")
          .typed<at::Tensor(const at::Tensor&, int64_t, int64_t, at::ScalarType)>();
  return op.call(grad_o, chunks, chunk, dtype);
}

// No autograd of their own: ChunksToTokens (above) is the differentiable function.
TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def("chunks_to_tokens(Tensor o_chunks, int tokens, ScalarType dtype) -> Tensor");
  m.def("tokens_to_chunks(Tensor grad_o, int chunks, int chunk, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("chunks_to_tokens", &chunks_to_tokens_cpu);
  m.impl("tokens_to_chunks", &tokens_to_chunks_cpu);
}

}  // namespace gdr
