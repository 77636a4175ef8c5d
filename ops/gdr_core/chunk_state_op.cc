// The chunk state pass op: schema, argument checks, the CPU implementation (the
// reference of the hand-derived backward) and autograd. The CUDA implementation
// registers itself from gdr_core_cuda.cc (linked only into CUDA binaries).
#include "ops/gdr_core/chunk_state_op.h"
#include "ops/policy/autograd_policy.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mv.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <atomic>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

namespace gdr {
namespace chunk_state_internal {
namespace {

void check_tensor(const char* op, const char* name, const at::Tensor& t,
                  const std::vector<int64_t>& expected, const char* layout,
                  const at::Tensor& reference) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined; expected a tensor of shape ",
              at::IntArrayRef(expected), " (", layout, ")");
  TORCH_CHECK(t.sizes() == at::IntArrayRef(expected), op, ": expected ", name, " of shape ",
              at::IntArrayRef(expected), " (", layout, ") but got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == reference.scalar_type(), op, ": expected ", name, " of dtype ",
              reference.scalar_type(), " (one dtype for all inputs) but got ", t.scalar_type());
  TORCH_CHECK(t.device() == reference.device(), op, ": expected ", name, " on ", reference.device(),
              " (one device for all inputs) but got ", t.device());
}

void check_dtype(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.defined(), op, ": ", name, " is undefined");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble, op, ": expected ",
              name, " of dtype Float or Double but got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 5, op, ": expected ", name,
              " with 5 dimensions [B, H, N, C, d] but got shape ", t.sizes());
}

}  // namespace

void check_forward_inputs(const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd,
                          const at::Tensor& p, const at::Tensor& kend, const at::Tensor& g_last,
                          const std::optional<at::Tensor>& initial_state) {
  constexpr const char* op = "chunk_state_pass";
  check_dtype(op, "u", u);
  check_dtype(op, "w", w);
  const int64_t B = u.size(0), H = u.size(1), N = u.size(2), C = u.size(3), dv = u.size(4);
  const int64_t dk = w.size(4);
  TORCH_CHECK(N > 0 && C > 0 && dv > 0 && dk > 0, op,
              ": expected non-empty chunks, rows and head dims but got u ", u.sizes(), " and w ",
              w.sizes());
  check_tensor(op, "w", w, {B, H, N, C, dk}, "[B, H, N, C, dk]", u);
  check_tensor(op, "qd", qd, {B, H, N, C, dk}, "[B, H, N, C, dk]", u);
  check_tensor(op, "p", p, {B, H, N, C, C}, "[B, H, N, C, C]", u);
  check_tensor(op, "kend", kend, {B, H, N, C, dk}, "[B, H, N, C, dk]", u);
  check_tensor(op, "g_last", g_last, {B, H, N}, "[B, H, N]", u);
  if (present(initial_state)) {
    check_tensor(op, "initial_state", *initial_state, {B, H, dk, dv}, "[B, H, dk, dv]", u);
  }
}

void check_backward_inputs(const std::optional<at::Tensor>& grad_o,
                           const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                           const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                           const at::Tensor& g_last, const at::Tensor& states,
                           const at::Tensor& v_new) {
  constexpr const char* op = "chunk_state_pass_backward";
  check_dtype(op, "w", w);
  check_dtype(op, "v_new", v_new);
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), C = w.size(3), dk = w.size(4);
  const int64_t dv = v_new.size(4);
  check_tensor(op, "v_new", v_new, {B, H, N, C, dv}, "[B, H, N, C, dv]", w);
  check_tensor(op, "qd", qd, {B, H, N, C, dk}, "[B, H, N, C, dk]", w);
  check_tensor(op, "p", p, {B, H, N, C, C}, "[B, H, N, C, C]", w);
  check_tensor(op, "kend", kend, {B, H, N, C, dk}, "[B, H, N, C, dk]", w);
  check_tensor(op, "g_last", g_last, {B, H, N}, "[B, H, N]", w);
  check_tensor(op, "states", states, {B, H, N, dk, dv}, "[B, H, N, dk, dv]", w);
  if (present(grad_o)) check_tensor(op, "grad_o", *grad_o, {B, H, N, C, dv}, "[B, H, N, C, dv]", w);
  if (present(grad_final_state)) {
    check_tensor(op, "grad_final_state", *grad_final_state, {B, H, dk, dv}, "[B, H, dk, dv]", w);
  }
}

// ---------------------------------------------------------------------------
// The scan-based implementation (the CUDA op's; see the header)

namespace {

void check_kernel_shape(const char* op, const at::Tensor& reference, int64_t C, int64_t dk,
                        int64_t dv) {
  TORCH_CHECK(reference.scalar_type() == at::kFloat, op,
              ": the CUDA implementation expects Float inputs but got ", reference.scalar_type());
  TORCH_CHECK(C == kernels::kChunkStateChunk, op, ": the CUDA implementation expects chunks of ",
              kernels::kChunkStateChunk, " rows (C) but got C = ", C);
  TORCH_CHECK(kernels::chunk_state_scan_supports(dk, dv), op,
              ": the CUDA implementation expects dk in {64, 128, 256} and dv a multiple of ",
              kernels::kChunkStateTileDv, " but got dk = ", dk, ", dv = ", dv);
}

// A [B, H, N, C, d] tensor as a kernel operand (unit stride in d, b and h merged into one
// index). Views such as narrow() slices of the solve's [U | W] output need no copy; other
// layouts are made contiguous into `holder`, which must outlive the launch.
kernels::ChunkOperand chunk_operand(const at::Tensor& t, at::Tensor& holder) {
  const int64_t B = t.size(0), H = t.size(1);
  const bool merge = B == 1 || H == 1 || t.stride(0) == H * t.stride(1);
  holder = (t.stride(4) == 1 && merge) ? t : t.contiguous();
  const int64_t stride_bh = holder.size(1) == 1 ? holder.stride(0) : holder.stride(1);
  return {holder.data_ptr<float>(), stride_bh, holder.stride(2), holder.stride(3)};
}

// [B, H, N, r, c] -> [B*H*N, r, c] for batched matmuls.
at::Tensor batched(const at::Tensor& t) { return t.reshape({-1, t.size(-2), t.size(-1)}); }

// A [batch, r, c] tensor with unit column stride as a GEMM operand (a batch of one gets
// batch stride 0, so a size-1 dimension's arbitrary stride does not cost the kernel its
// 16-byte copies). Must outlive the launch, as the chunk operands' holders.
kernels::ChunkGemmOperand gemm_operand(const at::Tensor& t3) {
  return {t3.data_ptr<float>(), t3.size(0) == 1 ? 0 : t3.stride(0), t3.stride(1)};
}

// One product op(a) op(b) of [batch, r, c] tensors: op(a) = a, or a^T with transpose_a.
struct GemmTerm {
  at::Tensor a, b;
};

// alpha * the sum over the terms (in order) of op(a) op(b), as a contiguous [batch, M, N]
// tensor computed by `gemm` (the batched products of the scan-based implementation; see
// the header): `out` when given (contiguous, that shape), else a fresh one. Undefined,
// with nothing launched, when `gemm` is empty or kernels::chunk_gemm_supports refuses the
// shapes (batched_product then runs ATen).
at::Tensor gemm_product(const ChunkGemmLauncher& gemm, bool transpose_a, bool transpose_b,
                        std::initializer_list<GemmTerm> terms, float alpha = 1.0f,
                        at::Tensor out = {}) {
  if (!gemm || terms.size() == 0 || terms.size() > kernels::kChunkGemmMaxProducts) return {};
  const GemmTerm& first = *terms.begin();
  const int64_t batch = first.a.size(0);
  const int64_t m = transpose_a ? first.a.size(2) : first.a.size(1);
  const int64_t n = transpose_b ? first.b.size(1) : first.b.size(2);
  const int64_t max_int = std::numeric_limits<int>::max();
  if (m > max_int || n > max_int) return {};
  kernels::ChunkGemmArgs args;
  args.batch = batch;
  args.m = static_cast<int>(m);
  args.n = static_cast<int>(n);
  args.transpose_a = transpose_a;
  args.transpose_b = transpose_b;
  args.products = static_cast<int>(terms.size());
  // Operands with unit column stride: views where the layout allows (all the state pass
  // hands over), else contiguous copies held here until the launch.
  std::vector<at::Tensor> held;
  int p = 0;
  for (const GemmTerm& term : terms) {
    const at::Tensor a = term.a.stride(2) == 1 ? term.a : term.a.contiguous();
    const at::Tensor b = term.b.stride(2) == 1 ? term.b : term.b.contiguous();
    held.push_back(a);
    held.push_back(b);
    const int64_t k = transpose_a ? a.size(1) : a.size(2);
    TORCH_INTERNAL_ASSERT(
        a.size(0) == batch && b.size(0) == batch && (transpose_a ? a.size(2) : a.size(1)) == m &&
        (transpose_b ? b.size(2) : b.size(1)) == k && (transpose_b ? b.size(1) : b.size(2)) == n);
    if (k > max_int) return {};
    args.product[p].a = gemm_operand(a);
    args.product[p].b = gemm_operand(b);
    args.product[p].k = static_cast<int>(k);
    ++p;
  }
  args.alpha = alpha;
  args.beta = 0.0f;
  if (!kernels::chunk_gemm_supports(args)) return {};
  if (out.defined()) {
    TORCH_INTERNAL_ASSERT(out.sizes() == at::IntArrayRef({batch, m, n}) && out.is_contiguous());
  } else {
    out = at::empty({batch, m, n}, first.a.options());
  }
  args.c = out.data_ptr<float>();
  args.c_stride_batch = out.stride(0);
  args.c_stride_row = out.stride(1);
  gemm(args);
  return out;
}

// The same sum through `gemm` where it runs, else ATen's batched matmuls: at::bmm (or
// at::bmm_out into `out`) for the first term (baddbmm_ with beta = 0 when alpha != 1),
// baddbmm_ for each further one. Into `out` when given, else a fresh tensor.
at::Tensor batched_product(const ChunkGemmLauncher& gemm, bool transpose_a, bool transpose_b,
                           std::initializer_list<GemmTerm> terms, float alpha = 1.0f,
                           at::Tensor into = {}) {
  at::Tensor out = gemm_product(gemm, transpose_a, transpose_b, terms, alpha, into);
  if (out.defined()) return out;
  auto op_a = [&](const at::Tensor& a) { return transpose_a ? a.transpose(1, 2) : a; };
  auto op_b = [&](const at::Tensor& b) { return transpose_b ? b.transpose(1, 2) : b; };
  bool first = true;
  for (const GemmTerm& term : terms) {
    const at::Tensor a = op_a(term.a), b = op_b(term.b);
    if (first && alpha == 1.0f) {
      out = into.defined() ? at::bmm_out(into, a, b) : at::bmm(a, b);
    } else if (first) {
      out = into.defined() ? into : at::empty({a.size(0), a.size(1), b.size(2)}, a.options());
      out.baddbmm_(a, b, /*beta=*/0.0, /*alpha=*/alpha);
    } else {
      out.baddbmm_(a, b, /*beta=*/1.0, /*alpha=*/alpha);
    }
    first = false;
  }
  return out;
}

// The count behind backward_side_stream_runs() (ops/gdr_core/chunk_state_op.h).
std::atomic<int64_t> g_backward_side_stream_runs{0};

}  // namespace

int64_t backward_side_stream_runs() {
  return g_backward_side_stream_runs.load(std::memory_order_relaxed);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> forward_via_scan(
    const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd, const at::Tensor& p,
    const at::Tensor& kend, const at::Tensor& g_last,
    const std::optional<at::Tensor>& initial_state, const ScanLauncher& scan,
    const ChunkGemmLauncher& gemm) {
  check_forward_inputs(u, w, qd, p, kend, g_last, initial_state);
  const int64_t B = u.size(0), H = u.size(1), N = u.size(2), C = u.size(3), dv = u.size(4);
  const int64_t dk = w.size(4);
  check_kernel_shape("chunk_state_pass", u, C, dk, dv);
  const auto options = u.options();

  const at::Tensor log_decay = g_last.contiguous();  // the kernel takes exp itself
  const at::Tensor initial = present(initial_state) ? initial_state->contiguous() : at::Tensor();
  at::Tensor states = at::empty({B, H, N, dk, dv}, options);
  at::Tensor v_new = at::empty({B, H, N, C, dv}, options);
  at::Tensor final_state = at::empty({B, H, dk, dv}, options);
  at::Tensor u_holder, w_holder, kend_holder;

  // V_n = U_n - W_n S_n;  S_{n+1} = exp(Glast_n) S_n + Kend_n^T V_n.
  kernels::ChunkStateScanArgs args;
  args.batch_heads = B * H;
  args.chunks = N;
  args.dk = static_cast<int>(dk);
  args.dv = static_cast<int>(dv);
  args.reverse = false;
  args.base = chunk_operand(u, u_holder);
  args.left = chunk_operand(w, w_holder);
  args.left_sign = -1.0f;
  args.right = chunk_operand(kend, kend_holder);
  args.right_sign = 1.0f;
  args.g_last = log_decay.data_ptr<float>();
  args.carry_in = initial.defined() ? initial.data_ptr<float>() : nullptr;
  args.rows_out = v_new.data_ptr<float>();
  args.carries_out = states.data_ptr<float>();
  args.carry_final = final_state.data_ptr<float>();
  scan(args);

  // O_n = Qd_n S_n + P_n V_n for every chunk at once (one two-product GEMM: all of Qd S's
  // k, then all of P V's).
  const at::Tensor o = batched_product(
      gemm, false, false, {{batched(qd), batched(states)}, {batched(p), batched(v_new)}});
  return {o.view({B, H, N, C, dv}), final_state, states, v_new};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
backward_via_scan(const std::optional<at::Tensor>& grad_o,
                  const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                  const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                  const at::Tensor& g_last, const at::Tensor& states, const at::Tensor& v_new,
                  const ScanLauncher& scan, const ChunkGemmLauncher& gemm, SideStream* side) {
  check_backward_inputs(grad_o, grad_final_state, w, qd, p, kend, g_last, states, v_new);
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), C = w.size(3), dk = w.size(4);
  const int64_t dv = v_new.size(4);
  check_kernel_shape("chunk_state_pass_backward", w, C, dk, dv);
  const auto options = w.options();

  const at::Tensor dO = present(grad_o) ? *grad_o : at::zeros({B, H, N, C, dv}, options);
  const at::Tensor dO3 = batched(dO);
  // The carry-independent parts of dV_n (P_n^T dO_n) and of g_n (Qd_n^T dO_n), all chunks
  // at once, so the sequential walk only does the two carry products.
  const at::Tensor pt_do =
      batched_product(gemm, true, false, {{batched(p), dO3}}).view({B, H, N, C, dv});
  const at::Tensor qt_do =
      batched_product(gemm, true, false, {{batched(qd), dO3}});  // [BHN, dk, dv]
  const at::Tensor log_decay = g_last.contiguous();              // the kernel takes exp itself
  const at::Tensor states_c = states.contiguous();
  const at::Tensor S3 = batched(states_c), V3 = batched(v_new);
  // dQd = dO S^T and dP = dO V^T need neither the scan nor the products above: with
  // `side` they run beside the scan (Note [State pass side stream] in the header), into
  // outputs allocated here, on the caller's stream; every tensor they read is a local of
  // this function or an argument, alive until the join below.
  at::Tensor dqd3 = at::empty({B * H * N, C, dk}, options);
  at::Tensor dp3 = at::empty({B * H * N, C, C}, options);
  auto carry_free_products = [&] {
    batched_product(gemm, false, true, {{dO3, S3}}, 1.0f, dqd3);
    batched_product(gemm, false, true, {{dO3, V3}}, 1.0f, dp3);
  };
  const at::Tensor grad_final =
      present(grad_final_state) ? grad_final_state->contiguous() : at::Tensor();
  at::Tensor carries = at::empty({B, H, N, dk, dv}, options);  // g_{n+1}, entering chunk n
  at::Tensor du = at::empty({B, H, N, C, dv}, options);
  at::Tensor d_initial = at::empty({B, H, dk, dv}, options);
  // dGlast_n = exp(Glast_n) sum(S_n .* g_{n+1}) as per-thread partials of the scan (it
  // holds g_{n+1}), summed below in ATen's fixed order: no extra pass over states and
  // carries.
  at::Tensor dot_partials = at::empty({B, H, N, kernels::chunk_state_dot_partials(dv)}, options);
  at::Tensor base_holder, kend_holder, w_holder;

  // dV_n = P_n^T dO_n + Kend_n g_{n+1};  g_n = a_n g_{n+1} + Qd_n^T dO_n - W_n^T dV_n.
  kernels::ChunkStateScanArgs args;
  args.batch_heads = B * H;
  args.chunks = N;
  args.dk = static_cast<int>(dk);
  args.dv = static_cast<int>(dv);
  args.reverse = true;
  args.base = chunk_operand(pt_do, base_holder);
  args.left = chunk_operand(kend, kend_holder);
  args.left_sign = 1.0f;
  args.right = chunk_operand(w, w_holder);
  args.right_sign = -1.0f;
  args.extra = qt_do.data_ptr<float>();
  args.g_last = log_decay.data_ptr<float>();
  args.carry_in = grad_final.defined() ? grad_final.data_ptr<float>() : nullptr;
  args.rows_out = du.data_ptr<float>();
  args.carries_out = carries.data_ptr<float>();
  args.carry_final = d_initial.data_ptr<float>();
  args.dot_with = states_c.data_ptr<float>();
  args.dot_out = dot_partials.data_ptr<float>();
  // Joins the side stream on every exit after the fork, so that no exception can free the
  // side work's operands while it may still read them.
  struct JoinOnExit {
    SideStream* side = nullptr;
    ~JoinOnExit() {
      if (side == nullptr) return;
      try {
        side->join();
      } catch (...) {  // already unwinding (or about to rethrow the same CUDA error)
      }
    }
    void join() {
      SideStream* s = side;
      side = nullptr;
      s->join();
    }
  } joiner;
  if (side != nullptr) {
    side->fork();
    joiner.side = side;
  }
  scan(args);
  if (side != nullptr) {
    side->run(carry_free_products);
    g_backward_side_stream_runs.fetch_add(1, std::memory_order_relaxed);
  }

  const at::Tensor G3 = batched(carries);
  const at::Tensor dV3 = batched(du);
  // dW = -dV S^T in one GEMM (alpha = -1).
  at::Tensor dw =
      batched_product(gemm, false, true, {{dV3, S3}}, /*alpha=*/-1.0f).view({B, H, N, C, dk});
  at::Tensor dkend = batched_product(gemm, false, true, {{V3, G3}}).view({B, H, N, C, dk});
  // The scan's partial dots summed per (b, h, n): a matrix-vector product with ones (one
  // cuBLAS GEMV, deterministic) instead of at::sum over the last dim, whose reduce kernel is
  // slower on these 528 rows of 2048 in the 0.8B step (measured: docs/benchmarks.md, Other
  // kernels in the 0.8B step).
  const int64_t parts = dot_partials.size(-1);
  at::Tensor dg_last =
      at::mv(dot_partials.view({-1, parts}), at::ones({parts}, dot_partials.options()))
          .view({B, H, N});
  if (side != nullptr) {
    joiner.join();
  } else {
    carry_free_products();
  }
  return {du,      dw,       dqd3.view({B, H, N, C, dk}), dp3.view({B, H, N, C, C}), dkend,
          dg_last, d_initial};
}

}  // namespace chunk_state_internal

namespace {

using chunk_state_internal::present;

// ---------------------------------------------------------------------------
// CPU implementation: the formulas of ops/gdr_core/chunk_state_op.h, one chunk at a time.

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_state_forward_cpu(
    const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd, const at::Tensor& p,
    const at::Tensor& kend, const at::Tensor& g_last,
    const std::optional<at::Tensor>& initial_state) {
  chunk_state_internal::check_forward_inputs(u, w, qd, p, kend, g_last, initial_state);
  const int64_t B = u.size(0), H = u.size(1), N = u.size(2), dv = u.size(4), dk = w.size(4);
  at::Tensor S =
      present(initial_state) ? initial_state->clone() : at::zeros({B, H, dk, dv}, u.options());
  at::Tensor o = at::empty(u.sizes(), u.options());
  at::Tensor v_new = at::empty(u.sizes(), u.options());
  at::Tensor states = at::empty({B, H, N, dk, dv}, u.options());
  const at::Tensor decay = g_last.exp().unsqueeze(-1).unsqueeze(-1);  // [B, H, N, 1, 1]
  for (int64_t n = 0; n < N; ++n) {
    states.select(2, n).copy_(S);
    const at::Tensor V = u.select(2, n) - w.select(2, n).matmul(S);
    v_new.select(2, n).copy_(V);
    o.select(2, n).copy_(qd.select(2, n).matmul(S) + p.select(2, n).matmul(V));
    S = S * decay.select(2, n) + kend.select(2, n).transpose(-1, -2).matmul(V);
  }
  return {o, S, states, v_new};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_state_backward_cpu(const std::optional<at::Tensor>& grad_o,
                         const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                         const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                         const at::Tensor& g_last, const at::Tensor& states,
                         const at::Tensor& v_new) {
  chunk_state_internal::check_backward_inputs(grad_o, grad_final_state, w, qd, p, kend, g_last,
                                              states, v_new);
  const int64_t B = w.size(0), H = w.size(1), N = w.size(2), C = w.size(3), dk = w.size(4);
  const int64_t dv = v_new.size(4);
  const auto options = w.options();
  const at::Tensor dO = present(grad_o) ? *grad_o : at::zeros({B, H, N, C, dv}, options);
  at::Tensor dS =
      present(grad_final_state) ? grad_final_state->clone() : at::zeros({B, H, dk, dv}, options);
  at::Tensor du = at::empty({B, H, N, C, dv}, options);
  at::Tensor dw = at::empty({B, H, N, C, dk}, options);
  at::Tensor dqd = at::empty({B, H, N, C, dk}, options);
  at::Tensor dp = at::empty({B, H, N, C, C}, options);
  at::Tensor dkend = at::empty({B, H, N, C, dk}, options);
  at::Tensor dg_last = at::empty({B, H, N}, options);
  const at::Tensor decay = g_last.exp();  // [B, H, N]
  for (int64_t n = N - 1; n >= 0; --n) {
    const at::Tensor S = states.select(2, n);
    const at::Tensor V = v_new.select(2, n);
    const at::Tensor dO_n = dO.select(2, n);
    const at::Tensor a = decay.select(2, n);  // [B, H]
    const at::Tensor dV =
        p.select(2, n).transpose(-1, -2).matmul(dO_n) + kend.select(2, n).matmul(dS);
    du.select(2, n).copy_(dV);
    dw.select(2, n).copy_(-dV.matmul(S.transpose(-1, -2)));
    dqd.select(2, n).copy_(dO_n.matmul(S.transpose(-1, -2)));
    dp.select(2, n).copy_(dO_n.matmul(V.transpose(-1, -2)));
    dkend.select(2, n).copy_(V.matmul(dS.transpose(-1, -2)));
    dg_last.select(2, n).copy_(a * (S * dS).sum({-2, -1}));
    dS = dS * a.unsqueeze(-1).unsqueeze(-1) + qd.select(2, n).transpose(-1, -2).matmul(dO_n) -
         w.select(2, n).transpose(-1, -2).matmul(dV);
  }
  return {du, dw, dqd, dp, dkend, dg_last, dS};
}

// ---------------------------------------------------------------------------
// Autograd

using ForwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const std::optional<at::Tensor>&);
using BackwardSignature =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&,
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
        const at::Tensor&, const at::Tensor&);

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::chunk_state_pass", "")
                             .typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::chunk_state_pass_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

class ChunkStatePassFunction : public torch::autograd::Function<ChunkStatePassFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& u, const at::Tensor& w,
                                                const at::Tensor& qd, const at::Tensor& p,
                                                const at::Tensor& kend, const at::Tensor& g_last,
                                                const std::optional<at::Tensor>& initial_state) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    save_execution_policy(ctx);
    auto [o, final_state, states, v_new] =
        forward_op().call(u, w, qd, p, kend, g_last, initial_state);
    // Saved as detached aliases: they are outputs of this function only as non-
    // differentiable by-products, and the backward needs them as plain data.
    ctx->save_for_backward({w, qd, p, kend, g_last, states.detach(), v_new.detach()});
    ctx->saved_data["has_initial_state"] = present(initial_state);
    ctx->mark_non_differentiable({states, v_new});
    // An unused output (o or final_state) then arrives as an undefined gradient, which
    // the backward op treats as zeros without materialising them.
    ctx->set_materialize_grads(false);
    return {o, final_state, states, v_new};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
    const auto saved = ctx->get_saved_variables();
    std::optional<at::Tensor> grad_o, grad_final_state;
    if (grads[0].defined()) grad_o = grads[0];
    if (grads[1].defined()) grad_final_state = grads[1];
    auto [du, dw, dqd, dp, dkend, dg_last, d_initial] =
        backward_op().call(grad_o, grad_final_state, saved[0], saved[1], saved[2], saved[3],
                           saved[4], saved[5], saved[6]);
    const bool has_initial_state = ctx->saved_data["has_initial_state"].toBool();
    return {du, dw, dqd, dp, dkend, dg_last, has_initial_state ? d_initial : at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_state_autograd(
    const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd, const at::Tensor& p,
    const at::Tensor& kend, const at::Tensor& g_last,
    const std::optional<at::Tensor>& initial_state) {
  auto outputs = ChunkStatePassFunction::apply(u, w, qd, p, kend, g_last, initial_state);
  return {outputs[0], outputs[1], outputs[2], outputs[3]};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def(
      "chunk_state_pass(Tensor u, Tensor w, Tensor qd, Tensor p, Tensor kend, Tensor g_last, "
      "Tensor? initial_state) -> (Tensor o, Tensor final_state, Tensor states, Tensor v_new)");
  m.def(
      "chunk_state_pass_backward(Tensor? grad_o, Tensor? grad_final_state, Tensor w, Tensor qd, "
      "Tensor p, Tensor kend, Tensor g_last, Tensor states, Tensor v_new) -> (Tensor du, Tensor "
      "dw, Tensor dqd, Tensor dp, Tensor dkend, Tensor dg_last, Tensor d_initial_state)");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("chunk_state_pass", &chunk_state_forward_cpu);
  m.impl("chunk_state_pass_backward", &chunk_state_backward_cpu);
}

TORCH_LIBRARY_IMPL(gdr, Autograd, m) { m.impl("chunk_state_pass", &chunk_state_autograd); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_state_pass(
    const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd, const at::Tensor& p,
    const at::Tensor& kend, const at::Tensor& g_last,
    const std::optional<at::Tensor>& initial_state) {
  return forward_op().call(u, w, qd, p, kend, g_last, initial_state);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_state_pass_backward(const std::optional<at::Tensor>& grad_o,
                          const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                          const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                          const at::Tensor& g_last, const at::Tensor& states,
                          const at::Tensor& v_new) {
  return backward_op().call(grad_o, grad_final_state, w, qd, p, kend, g_last, states, v_new);
}

bool chunk_state_pass_has_cuda_kernel() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("gdr::chunk_state_pass", "")
      .hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

}  // namespace gdr
