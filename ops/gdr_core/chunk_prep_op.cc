// The chunk prep op: schema, argument checks, the CPU implementation (plain loops, the
// reference of the hand-derived backward), the kernel-based implementation the CUDA op
// runs, and autograd. The CUDA implementation registers itself from gdr_core_cuda.cc
// (linked only into CUDA binaries).
#include "ops/gdr_core/chunk_prep_op.h"
#include "ops/policy/autograd_policy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace gdr {
namespace {

bool is_float_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

void check_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size) {
  TORCH_CHECK(q.defined() && k.defined() && v.defined() && g.defined() && beta.defined(), op,
              ": q, k, v, g and beta must all be defined");
  TORCH_CHECK(q.dim() == 4 && q.size(1) > 0 && q.size(2) > 0 && q.size(3) > 0, op,
              ": expected q of shape [B, T, Hk, dk] with T, Hk, dk > 0 but got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": expected k of shape ", q.sizes(),
              " (same as q) but got ", k.sizes());
  TORCH_CHECK(v.dim() == 4 && v.size(0) == q.size(0) && v.size(1) == q.size(1) && v.size(2) > 0 &&
                  v.size(3) > 0,
              op, ": expected v of shape [", q.size(0), ", ", q.size(1),
              ", H, dv] (B, T of q) but got ", v.sizes());
  TORCH_CHECK(
      v.size(2) % q.size(2) == 0, op,
      ": expected v's head count H to be a multiple of q and k's head count Hk but got H = ",
      v.size(2), ", Hk = ", q.size(2));
  const at::IntArrayRef bth = v.sizes().slice(0, 3);
  TORCH_CHECK(g.sizes() == bth, op, ": expected g of shape ", bth, " but got ", g.sizes());
  TORCH_CHECK(beta.sizes() == bth, op, ": expected beta of shape ", bth, " but got ", beta.sizes());
  TORCH_CHECK(is_float_dtype(q.scalar_type()) && k.scalar_type() == q.scalar_type(), op,
              ": expected q and k of one floating dtype but got ", q.scalar_type(), " and ",
              k.scalar_type());
  TORCH_CHECK(is_float_dtype(v.scalar_type()), op,
              ": expected v of a floating dtype (Float, BFloat16, Half, Double) but got ",
              v.scalar_type());
  for (const at::Tensor* t : {&g, &beta}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kDouble, op,
                ": expected g and beta of dtype Float or Double but got ", t->scalar_type());
  }
  for (const at::Tensor* t : {&k, &v, &g, &beta}) {
    TORCH_CHECK(t->device() == q.device(), op, ": expected all inputs on ", q.device(),
                " (q's device) but got one on ", t->device());
  }
  TORCH_CHECK(chunk_size > 0, op, ": expected chunk_size > 0 but got ", chunk_size);
}

at::ScalarType compute_dtype(const at::Tensor& q, const at::Tensor& v, const at::Tensor& g,
                             const at::Tensor& beta) {
  for (const at::Tensor* t : {&q, &v, &g, &beta}) {
    if (t->scalar_type() == at::kDouble) return at::kDouble;
  }
  return at::kFloat;
}

bool present(const std::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// ---------------------------------------------------------------------------
// CPU implementation: the formulas of ops/gdr_core/chunk_prep_op.h, one chunk at a time.

struct Dims {
  int64_t B, T, H, N, C, dk, dv;
};

// H: value heads (q and k as the CPU loops read them are chunk_prep_qk's, repeated).
Dims dims_of(const at::Tensor& q, const at::Tensor& v, int64_t C) {
  const int64_t T = q.size(1);
  return {q.size(0), T, v.size(2), (T + C - 1) / C, C, q.size(3), v.size(3)};
}

// The backward of chunk_prep_qk for x = q or k: dxn [B, T, H, dk] (contiguous, compute
// dtype) is the gradient of the rows the steps used; returns dx in x's shape and dtype.
// The value heads of a key head are summed first (repeat_interleave's backward), then
// the L2 norm's backward dx = r (dxn - xn <xn, dxn>) (Note [Chunk prep backward]).
at::Tensor qk_backward_composite(const at::Tensor& dxn, const at::Tensor& x, bool l2_normalize) {
  const int64_t B = x.size(0), T = x.size(1), Hk = x.size(2), dk = x.size(3);
  const int64_t group = dxn.size(2) / Hk;
  at::Tensor d = group > 1 ? dxn.view({B, T, Hk, group, dk}).sum(3) : dxn;
  if (l2_normalize) {
    const at::Tensor xf = x.to(dxn.scalar_type());
    const at::Tensor r = (xf.pow(2).sum(-1, /*keepdim=*/true) + kQkL2NormEps).rsqrt();
    const at::Tensor xn = xf * r;
    d = r * (d - xn * (xn * d).sum(-1, /*keepdim=*/true));
  }
  return d.to(x.scalar_type());
}

// One chunk's inputs gathered into row-major [C][d] arrays, zero past the sequence end,
// and its decays. Shared by the CPU forward and backward.
template <typename S>
struct ChunkData {
  std::vector<S> Q, K, V, G, beta, eG, L, KK, QK;
  int64_t rows = 0;

  ChunkData(const Dims& d, const S* q, const S* k, const S* v, const S* g, const S* be,
            double scale, int64_t b, int64_t h, int64_t n)
      : Q(d.C * d.dk, 0),
        K(d.C * d.dk, 0),
        V(d.C * d.dv, 0),
        G(d.C, 0),
        beta(d.C, 0),
        eG(d.C),
        L(d.C * d.C, 0),
        KK(d.C * d.C, 0),
        QK(d.C * d.C, 0) {
    const int64_t C = d.C, t0 = n * C;
    rows = std::min(C, d.T - t0);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t row = (b * d.T + t0 + i) * d.H + h;
      for (int64_t c = 0; c < d.dk; ++c) {
        Q[i * d.dk + c] = q[row * d.dk + c] * static_cast<S>(scale);
        K[i * d.dk + c] = k[row * d.dk + c];
      }
      for (int64_t c = 0; c < d.dv; ++c) V[i * d.dv + c] = v[row * d.dv + c];
      G[i] = g[row];
      beta[i] = be[row];
    }
    for (int64_t i = 1; i < C; ++i) G[i] += G[i - 1];
    for (int64_t i = 0; i < C; ++i) eG[i] = std::exp(G[i]);
    for (int64_t i = 0; i < C; ++i) {
      for (int64_t j = 0; j <= i; ++j) {
        L[i * C + j] = std::exp(G[i] - G[j]);
        S kk = 0, qk = 0;
        for (int64_t c = 0; c < d.dk; ++c) {
          kk += K[i * d.dk + c] * K[j * d.dk + c];
          qk += Q[i * d.dk + c] * K[j * d.dk + c];
        }
        KK[i * C + j] = kk;
        QK[i * C + j] = qk;
      }
    }
  }
};

template <typename S>
void forward_cpu_kernel(const Dims& d, double scale, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                        at::Tensor& u, at::Tensor& w, at::Tensor& qd, at::Tensor& p,
                        at::Tensor& kend, at::Tensor& g_last) {
  const int64_t C = d.C, dk = d.dk, dv = d.dv, cols = dv + dk;
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.H; ++h) {
      for (int64_t n = 0; n < d.N; ++n) {
        const ChunkData<S> x(d, q.data_ptr<S>(), k.data_ptr<S>(), v.data_ptr<S>(), g.data_ptr<S>(),
                             beta.data_ptr<S>(), scale, b, h, n);
        const int64_t blk = (b * d.H + h) * d.N + n;
        S* u_ = u.data_ptr<S>() + blk * C * dv;
        S* w_ = w.data_ptr<S>() + blk * C * dk;
        S* qd_ = qd.data_ptr<S>() + blk * C * dk;
        S* p_ = p.data_ptr<S>() + blk * C * C;
        S* kend_ = kend.data_ptr<S>() + blk * C * dk;
        const S gl = x.G[C - 1];
        g_last.data_ptr<S>()[blk] = gl;
        for (int64_t i = 0; i < C; ++i) {
          for (int64_t j = 0; j < C; ++j)
            p_[i * C + j] = j <= i ? x.QK[i * C + j] * x.L[i * C + j] : 0;
          for (int64_t c = 0; c < dk; ++c) {
            qd_[i * dk + c] = x.Q[i * dk + c] * x.eG[i];
            kend_[i * dk + c] = x.K[i * dk + c] * std::exp(gl - x.G[i]);
          }
        }
        // Forward substitution: X_i = R_i - sum_{j<i} M_ij X_j.
        std::vector<S> X(C * cols);
        for (int64_t i = 0; i < C; ++i) {
          for (int64_t c = 0; c < cols; ++c) {
            S r = c < dv ? x.beta[i] * x.V[i * dv + c] : x.beta[i] * x.K[i * dk + c - dv] * x.eG[i];
            for (int64_t j = 0; j < i; ++j) {
              r -= x.beta[i] * x.KK[i * C + j] * x.L[i * C + j] * X[j * cols + c];
            }
            X[i * cols + c] = r;
            if (c < dv) {
              u_[i * dv + c] = r;
            } else {
              w_[i * dk + c - dv] = r;
            }
          }
        }
      }
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_prep_forward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, double scale,
                       int64_t chunk_size, bool l2_normalize_qk) {
  check_inputs("chunk_prep", q, k, v, g, beta, chunk_size);
  const at::ScalarType ct = compute_dtype(q, v, g, beta);
  const Dims d = dims_of(q, v, chunk_size);
  const auto options = q.options().dtype(ct);
  at::Tensor u = at::empty({d.B, d.H, d.N, d.C, d.dv}, options);
  at::Tensor w = at::empty({d.B, d.H, d.N, d.C, d.dk}, options);
  at::Tensor qd = at::empty_like(w), kend = at::empty_like(w);
  at::Tensor p = at::empty({d.B, d.H, d.N, d.C, d.C}, options);
  at::Tensor g_last = at::empty({d.B, d.H, d.N}, options);
  const auto [qe, ke] = chunk_prep_qk(q, k, d.H, l2_normalize_qk, ct);
  const at::Tensor qc = qe.contiguous(), kc = ke.contiguous(), vc = v.to(ct).contiguous(),
                   gc = g.to(ct).contiguous(), bc = beta.to(ct).contiguous();
  if (ct == at::kDouble) {
    forward_cpu_kernel<double>(d, scale, qc, kc, vc, gc, bc, u, w, qd, p, kend, g_last);
  } else {
    forward_cpu_kernel<float>(d, scale, qc, kc, vc, gc, bc, u, w, qd, p, kend, g_last);
  }
  return {u, w, qd, p, kend, g_last};
}

template <typename S>
void backward_cpu_kernel(const Dims& d, double scale, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                         const at::Tensor& u, const at::Tensor& w, const at::Tensor& dU,
                         const at::Tensor& dW, const at::Tensor& dQd, const at::Tensor& dP,
                         const at::Tensor& dKend, const at::Tensor& dGl, at::Tensor& dq,
                         at::Tensor& dk_out, at::Tensor& dv_out, at::Tensor& dg,
                         at::Tensor& dbeta) {
  const int64_t C = d.C, dk = d.dk, dv = d.dv, cols = dv + dk;
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t h = 0; h < d.H; ++h) {
      for (int64_t n = 0; n < d.N; ++n) {
        const ChunkData<S> x(d, q.data_ptr<S>(), k.data_ptr<S>(), v.data_ptr<S>(), g.data_ptr<S>(),
                             beta.data_ptr<S>(), scale, b, h, n);
        const int64_t blk = (b * d.H + h) * d.N + n;
        const S* u_ = u.data_ptr<S>() + blk * C * dv;
        const S* w_ = w.data_ptr<S>() + blk * C * dk;
        const S* du_ = dU.data_ptr<S>() + blk * C * dv;
        const S* dw_ = dW.data_ptr<S>() + blk * C * dk;
        const S* dqd_ = dQd.data_ptr<S>() + blk * C * dk;
        const S* dp_ = dP.data_ptr<S>() + blk * C * C;
        const S* dkend_ = dKend.data_ptr<S>() + blk * C * dk;
        const S gl = x.G[C - 1];
        auto M = [&](int64_t i, int64_t j) { return x.beta[i] * x.KK[i * C + j] * x.L[i * C + j]; };
        auto X = [&](int64_t j, int64_t c) {
          return c < dv ? u_[j * dv + c] : w_[j * dk + c - dv];
        };

        // dR = A^-T dX by back substitution.
        std::vector<S> dR(C * cols);
        for (int64_t i = C - 1; i >= 0; --i) {
          for (int64_t c = 0; c < cols; ++c) {
            S y = c < dv ? du_[i * dv + c] : dw_[i * dk + c - dv];
            for (int64_t j = i + 1; j < C; ++j) y -= M(j, i) * dR[j * cols + c];
            dR[i * cols + c] = y;
          }
        }
        // dM = -dR X^T below the diagonal; E, dKK, dQK.
        std::vector<S> dM(C * C, 0), E(C * C, 0), dKK(C * C, 0), dQK(C * C, 0);
        for (int64_t i = 0; i < C; ++i) {
          for (int64_t j = 0; j <= i; ++j) {
            if (j < i) {
              S acc = 0;
              for (int64_t c = 0; c < cols; ++c) acc += dR[i * cols + c] * X(j, c);
              dM[i * C + j] = -acc;
              dKK[i * C + j] = dM[i * C + j] * x.beta[i] * x.L[i * C + j];
              E[i * C + j] = x.L[i * C + j] * (dM[i * C + j] * x.beta[i] * x.KK[i * C + j] +
                                               dp_[i * C + j] * x.QK[i * C + j]);
            }
            dQK[i * C + j] = dp_[i * C + j] * x.L[i * C + j];
          }
        }
        std::vector<S> dG(C, 0), F(C, 0);
        for (int64_t i = 0; i < C; ++i) {
          const bool real = i < x.rows;
          const int64_t row = (b * d.T + n * C + i) * d.H + h;
          S su = 0, sk = 0, sq = 0, sf = 0, sb = 0, e = 0;
          for (int64_t c = 0; c < dv; ++c) su += x.V[i * dv + c] * dR[i * cols + c];
          for (int64_t c = 0; c < dk; ++c) {
            sk += x.K[i * dk + c] * dR[i * cols + dv + c];
            sq += dqd_[i * dk + c] * x.Q[i * dk + c];
            sf += dkend_[i * dk + c] * x.K[i * dk + c];
          }
          for (int64_t j = 0; j < C; ++j) {
            sb += dM[i * C + j] * x.KK[i * C + j] * x.L[i * C + j];
            e += E[i * C + j] - E[j * C + i];
          }
          F[i] = std::exp(gl - x.G[i]) * sf;
          dG[i] = x.beta[i] * x.eG[i] * sk + x.eG[i] * sq - F[i] + e;
          if (real) dbeta.data_ptr<S>()[row] = su + x.eG[i] * sk + sb;
          for (int64_t c = 0; c < dk && real; ++c) {
            S acc_k = 0, acc_q = 0;
            for (int64_t j = 0; j < C; ++j) {
              acc_k += (dKK[i * C + j] + dKK[j * C + i]) * x.K[j * dk + c] +
                       dQK[j * C + i] * x.Q[j * dk + c];
              acc_q += dQK[i * C + j] * x.K[j * dk + c];
            }
            dk_out.data_ptr<S>()[row * dk + c] = acc_k +
                                                 x.beta[i] * x.eG[i] * dR[i * cols + dv + c] +
                                                 dkend_[i * dk + c] * std::exp(gl - x.G[i]);
            dq.data_ptr<S>()[row * dk + c] =
                (acc_q + dqd_[i * dk + c] * x.eG[i]) * static_cast<S>(scale);
          }
          for (int64_t c = 0; c < dv && real; ++c) {
            dv_out.data_ptr<S>()[row * dv + c] = x.beta[i] * dR[i * cols + c];
          }
        }
        S f_total = 0;
        for (int64_t i = 0; i < C; ++i) f_total += F[i];
        dG[C - 1] += dGl.data_ptr<S>()[blk] + f_total;
        S acc = 0;
        for (int64_t i = C - 1; i >= 0; --i) {
          acc += dG[i];
          if (i < x.rows) dg.data_ptr<S>()[(b * d.T + n * C + i) * d.H + h] = acc;
        }
      }
    }
  }
}

at::Tensor grad_or_zeros(const std::optional<at::Tensor>& grad, at::IntArrayRef sizes,
                         const at::TensorOptions& options) {
  return present(grad) ? grad->to(options.dtype()).contiguous() : at::zeros(sizes, options);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_prep_backward_cpu(
    const std::optional<at::Tensor>& grad_u, const std::optional<at::Tensor>& grad_w,
    const std::optional<at::Tensor>& grad_qd, const std::optional<at::Tensor>& grad_p,
    const std::optional<at::Tensor>& grad_kend, const std::optional<at::Tensor>& grad_g_last,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& u, const at::Tensor& w, double scale,
    int64_t chunk_size, bool l2_normalize_qk) {
  check_inputs("chunk_prep_backward", q, k, v, g, beta, chunk_size);
  const at::ScalarType ct = compute_dtype(q, v, g, beta);
  const Dims d = dims_of(q, v, chunk_size);
  const auto options = q.options().dtype(ct);
  const std::vector<int64_t> chunk_v = {d.B, d.H, d.N, d.C, d.dv},
                             chunk_k = {d.B, d.H, d.N, d.C, d.dk};
  TORCH_CHECK(u.sizes() == at::IntArrayRef(chunk_v) && w.sizes() == at::IntArrayRef(chunk_k),
              "chunk_prep_backward: expected u ", at::IntArrayRef(chunk_v), " and w ",
              at::IntArrayRef(chunk_k), " (the forward's outputs) but got ", u.sizes(), " and ",
              w.sizes());
  const at::Tensor dU = grad_or_zeros(grad_u, chunk_v, options);
  const at::Tensor dW = grad_or_zeros(grad_w, chunk_k, options);
  const at::Tensor dQd = grad_or_zeros(grad_qd, chunk_k, options);
  const at::Tensor dP = grad_or_zeros(grad_p, {d.B, d.H, d.N, d.C, d.C}, options);
  const at::Tensor dKend = grad_or_zeros(grad_kend, chunk_k, options);
  const at::Tensor dGl = grad_or_zeros(grad_g_last, {d.B, d.H, d.N}, options);
  const auto [qe, ke] = chunk_prep_qk(q, k, d.H, l2_normalize_qk, ct);
  const at::Tensor qc = qe.contiguous(), kc = ke.contiguous(), vc = v.to(ct).contiguous(),
                   gc = g.to(ct).contiguous(), bc = beta.to(ct).contiguous(),
                   uc = u.to(ct).contiguous(), wc = w.to(ct).contiguous();
  // dq, dk of the rows the steps use ([B, T, H, dk]); qk_backward_composite maps them back.
  at::Tensor dq = at::empty(qc.sizes(), options), dk = at::empty(kc.sizes(), options);
  at::Tensor dv = at::empty(v.sizes(), options), dg = at::empty(g.sizes(), options);
  at::Tensor dbeta = at::empty(beta.sizes(), options);
  if (ct == at::kDouble) {
    backward_cpu_kernel<double>(d, scale, qc, kc, vc, gc, bc, uc, wc, dU, dW, dQd, dP, dKend, dGl,
                                dq, dk, dv, dg, dbeta);
  } else {
    backward_cpu_kernel<float>(d, scale, qc, kc, vc, gc, bc, uc, wc, dU, dW, dQd, dP, dKend, dGl,
                               dq, dk, dv, dg, dbeta);
  }
  return {qk_backward_composite(dq, q, l2_normalize_qk),
          qk_backward_composite(dk, k, l2_normalize_qk), dv.to(v.scalar_type()),
          dg.to(g.scalar_type()), dbeta.to(beta.scalar_type())};
}

// ---------------------------------------------------------------------------
// Autograd

using ForwardSignature =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
        const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
        const at::Tensor&, double, int64_t, bool);
using BackwardSignature = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
    const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, double, int64_t, bool);

const c10::TypedOperatorHandle<ForwardSignature>& forward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::chunk_prep", "")
                             .typed<ForwardSignature>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSignature>& backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::chunk_prep_backward", "")
                             .typed<BackwardSignature>();
  return op;
}

class ChunkPrepFunction : public torch::autograd::Function<ChunkPrepFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& v, const at::Tensor& g,
                                                const at::Tensor& beta, double scale,
                                                int64_t chunk_size, bool l2_normalize_qk) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    save_execution_policy(ctx);
    auto [u, w, qd, p, kend, g_last] =
        forward_op().call(q, k, v, g, beta, scale, chunk_size, l2_normalize_qk);
    // u and w are saved rather than recomputed in the backward: the backward needs X =
    // [U | W] for dM, and the state pass keeps w alive anyway.
    ctx->save_for_backward({q, k, v, g, beta, u, w});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["chunk_size"] = chunk_size;
    ctx->saved_data["l2_normalize_qk"] = l2_normalize_qk;
    ctx->set_materialize_grads(false);
    return {u, w, qd, p, kend, g_last};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
    const auto saved = ctx->get_saved_variables();
    std::optional<at::Tensor> opt[6];
    for (int i = 0; i < 6; ++i) {
      if (grads[i].defined()) opt[i] = grads[i];
    }
    auto [dq, dk, dv, dg, dbeta] = backward_op().call(
        opt[0], opt[1], opt[2], opt[3], opt[4], opt[5], saved[0], saved[1], saved[2], saved[3],
        saved[4], saved[5], saved[6], ctx->saved_data["scale"].toDouble(),
        ctx->saved_data["chunk_size"].toInt(), ctx->saved_data["l2_normalize_qk"].toBool());
    return {dq, dk, dv, dg, dbeta, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_prep_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, double scale, int64_t chunk_size,
                    bool l2_normalize_qk) {
  auto out = ChunkPrepFunction::apply(q, k, v, g, beta, scale, chunk_size, l2_normalize_qk);
  return {out[0], out[1], out[2], out[3], out[4], out[5]};
}

// ---------------------------------------------------------------------------
// The kernel-based implementation (the CUDA op's; see the header)

void check_kernel_inputs(const char* op, const at::Tensor& q, const at::Tensor& v,
                         const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size) {
  TORCH_CHECK(q.scalar_type() != at::kDouble && v.scalar_type() != at::kDouble, op,
              ": the CUDA implementation expects q, k, v of dtype Float, BFloat16 or Half but "
              "got q, k ",
              q.scalar_type(), " and v ", v.scalar_type());
  TORCH_CHECK(g.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat, op,
              ": the CUDA implementation expects g and beta of dtype Float but got ",
              g.scalar_type(), " and ", beta.scalar_type());
  TORCH_CHECK(chunk_size == kernels::kChunkPrepChunk, op,
              ": the CUDA implementation expects chunks of ", kernels::kChunkPrepChunk,
              " rows but got chunk_size = ", chunk_size);
  const int64_t dk = q.size(3), dv = v.size(3);
  TORCH_CHECK(kernels::chunk_prep_supports(dk, dv), op,
              ": the CUDA implementation expects dk in {64, 128, 256} and dv a multiple of 16 "
              "within the shared-memory limit (dv <= 400, 208, 624 at dk = 64, 128, 256) but got "
              "dk = ",
              dk, ", dv = ", dv);
}

// One input as the kernels read it: Float or BFloat16 (Half goes through Float) with unit
// stride in the head dim; any other strides are passed to the kernel, so views need no copy.
at::Tensor kernel_operand(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return t.to(at::kFloat).contiguous();
  return t.stride(-1) == 1 || t.size(-1) == 1 ? t : t.contiguous();
}

kernels::ChunkPrepInput kernel_input(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? kernels::ChunkPrepInput::kBFloat16
                                          : kernels::ChunkPrepInput::kFloat;
}

struct KernelOperands {
  at::Tensor q, k, v;
};

// q, k, v as the kernels read them. The kernels are built for the type pairs of
// kernels::chunk_prep_supports_inputs; Float q, k with BFloat16 v (no caller of ours) runs
// on a Float copy of v.
KernelOperands kernel_operands(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  KernelOperands x{kernel_operand(q), kernel_operand(k), kernel_operand(v)};
  if (!kernels::chunk_prep_supports_inputs(kernel_input(x.q), kernel_input(x.v))) {
    x.v = x.v.to(at::kFloat);
  }
  return x;
}

// Note [Gradients in the inputs' layout]: the model hands the core q, k and v as the
// consecutive column slices of one [B, T, 2 * H * dk + H * dv] buffer (the split of the
// causal conv's output, Note [Split, not narrow] in models/qwen/layers.cc), and the
// split's backward concatenates dq, dk and dv into that layout again (a cat pass over
// [B, T, 6144] per GDN layer and microbatch; measured: docs/benchmarks.md, Decisions).
// When the inputs are laid out so (and each value head has its own key head, so the kernel
// writes dq and dk itself), the backward kernel writes dq, dk, dv as the same slices of one
// new buffer (ChunkPrepBackwardArgs::grad_token_stride), and split_last_dim's backward
// (models/qwen/layers.cc) returns that buffer without a copy. The values are the same; only
// where they are stored changes.
// The row width S of that buffer when q, k, v (as the kernel reads them: x) are exactly
// its consecutive column slices, else 0.
int64_t split_row_width(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const KernelOperands& x) {
  if (!x.q.is_same(q) || !x.k.is_same(k) || !x.v.is_same(v)) return 0;  // cast copies
  if (q.scalar_type() != v.scalar_type() || !q.storage().is_alias_of(k.storage()) ||
      !q.storage().is_alias_of(v.storage())) {
    return 0;
  }
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), dk = q.size(3), dv = v.size(3);
  if (k.size(2) != H || v.size(2) != H) return 0;
  const int64_t S = 2 * H * dk + H * dv;
  for (const at::Tensor* t : {&q, &k, &v}) {
    const int64_t d = t->size(3);
    if (t->stride(3) != 1 || (H > 1 && t->stride(2) != d) || (T > 1 && t->stride(1) != S) ||
        (B > 1 && t->stride(0) != T * S)) {
      return 0;
    }
  }
  if (k.storage_offset() != q.storage_offset() + H * dk ||
      v.storage_offset() != k.storage_offset() + H * dk) {
    return 0;
  }
  return S;
}

kernels::TokenStrides token_strides(const at::Tensor& t) {
  return {t.stride(0), t.stride(1), t.stride(2)};
}

template <typename Args>
void set_inputs(Args& args, const KernelOperands& x, const at::Tensor& g, const at::Tensor& beta) {
  args.q = x.q.data_ptr();
  args.k = x.k.data_ptr();
  args.v = x.v.data_ptr();
  args.g = g.data_ptr<float>();
  args.beta = beta.data_ptr<float>();
  args.q_strides = token_strides(x.q);
  args.k_strides = token_strides(x.k);
  args.v_strides = token_strides(x.v);
  args.g_strides = token_strides(g);
  args.beta_strides = token_strides(beta);
}

kernels::ChunkPrepShape kernel_shape(const KernelOperands& x, double scale, int64_t chunk_size,
                                     bool l2_normalize_qk) {
  kernels::ChunkPrepShape s;
  s.batch = x.q.size(0);
  s.tokens = x.q.size(1);
  s.heads = x.v.size(2);
  s.chunks = (s.tokens + chunk_size - 1) / chunk_size;
  s.head_group = x.v.size(2) / x.q.size(2);
  s.dk = static_cast<int>(x.q.size(3));
  s.dv = static_cast<int>(x.v.size(3));
  s.scale = static_cast<float>(scale);
  s.l2_normalize_qk = l2_normalize_qk;
  s.qk_input = kernel_input(x.q);
  s.v_input = kernel_input(x.v);
  return s;
}

const float* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<float>() : nullptr;
}

// Note [Head group gradient sum]
// With H = G Hk value heads, the G value heads of one key head are G different blocks of
// the backward kernel, so none of them can add up the key head's dq, dk. Each writes its
// own FP32 row instead (partials [B, T, H, dk], every slot written once, no atomics), and
// here every key head's rows are summed in value-head order, ((p_0 + p_1) + p_2) + ...,
// by G - 1 elementwise adds on the current stream: each output element is one thread's
// fixed sequence of FP32 adds, the same bits on every run whatever the launch shapes, and
// the result is cast once to q's dtype (a BF16 q gets one rounding, as through autograd's
// FP32 repeat_interleave backward).
at::Tensor sum_head_groups(const at::Tensor& partials, int64_t key_heads, at::ScalarType dtype) {
  const int64_t B = partials.size(0), T = partials.size(1), H = partials.size(2),
                dk = partials.size(3), group = H / key_heads;
  const at::Tensor p = partials.view({B, T, key_heads, group, dk});
  at::Tensor sum = p.select(3, 0).contiguous();
  for (int64_t j = 1; j < group; ++j) sum.add_(p.select(3, j));
  return sum.to(dtype);
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> chunk_prep_qk(const at::Tensor& q, const at::Tensor& k,
                                                 int64_t value_heads, bool l2_normalize,
                                                 at::ScalarType dtype) {
  TORCH_CHECK(
      q.dim() == 4 && k.sizes() == q.sizes() && q.size(2) > 0 && value_heads % q.size(2) == 0,
      "chunk_prep_qk: expected q and k of one shape [B, T, Hk, dk] with value_heads = ",
      value_heads, " a multiple of Hk but got q ", q.sizes(), " and k ", k.sizes());
  const int64_t group = value_heads / q.size(2);
  auto rows = [&](const at::Tensor& x) {
    at::Tensor y = x.to(dtype);
    if (l2_normalize) y = y * (y.pow(2).sum(-1, /*keepdim=*/true) + kQkL2NormEps).rsqrt();
    // Value head h reads key head h / group.
    return group > 1 ? y.repeat_interleave(group, /*dim=*/2) : y;
  };
  return {rows(q), rows(k)};
}

namespace chunk_prep_internal {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
forward_via_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta, double scale, int64_t chunk_size,
                   bool l2_normalize_qk, const ForwardLauncher& launch) {
  constexpr const char* op = "chunk_prep";
  check_inputs(op, q, k, v, g, beta, chunk_size);
  check_kernel_inputs(op, q, v, g, beta, chunk_size);
  const KernelOperands x = kernel_operands(q, k, v);
  kernels::ChunkPrepForwardArgs args;
  args.shape = kernel_shape(x, scale, chunk_size, l2_normalize_qk);
  const int64_t B = args.shape.batch, H = args.shape.heads, N = args.shape.chunks;
  const int64_t C = chunk_size, dk = args.shape.dk, dv = args.shape.dv;
  const auto options = q.options().dtype(at::kFloat);
  at::Tensor u = at::empty({B, H, N, C, dv}, options);
  at::Tensor w = at::empty({B, H, N, C, dk}, options);
  at::Tensor qd = at::empty_like(w), kend = at::empty_like(w);
  at::Tensor p = at::empty({B, H, N, C, C}, options);
  at::Tensor g_last = at::empty({B, H, N}, options);
  set_inputs(args, x, g, beta);
  args.u = u.data_ptr<float>();
  args.w = w.data_ptr<float>();
  args.qd = qd.data_ptr<float>();
  args.p = p.data_ptr<float>();
  args.kend = kend.data_ptr<float>();
  args.g_last = g_last.data_ptr<float>();
  launch(args);
  return {u, w, qd, p, kend, g_last};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_via_kernel(
    const std::optional<at::Tensor>& grad_u, const std::optional<at::Tensor>& grad_w,
    const std::optional<at::Tensor>& grad_qd, const std::optional<at::Tensor>& grad_p,
    const std::optional<at::Tensor>& grad_kend, const std::optional<at::Tensor>& grad_g_last,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& u, const at::Tensor& w, double scale,
    int64_t chunk_size, bool l2_normalize_qk, const BackwardLauncher& launch) {
  constexpr const char* op = "chunk_prep_backward";
  check_inputs(op, q, k, v, g, beta, chunk_size);
  check_kernel_inputs(op, q, v, g, beta, chunk_size);
  const KernelOperands x = kernel_operands(q, k, v);
  kernels::ChunkPrepBackwardArgs args;
  args.shape = kernel_shape(x, scale, chunk_size, l2_normalize_qk);
  const int64_t B = args.shape.batch, T = args.shape.tokens, H = args.shape.heads;
  const int64_t N = args.shape.chunks, C = chunk_size, dk = args.shape.dk, dv = args.shape.dv;
  auto check_chunk = [&](const at::Tensor& t, const char* name,
                         std::vector<int64_t> sizes) -> at::Tensor {
    TORCH_CHECK(t.sizes() == at::IntArrayRef(sizes), op, ": expected ", name, " of shape ",
                at::IntArrayRef(sizes), " but got ", t.sizes());
    TORCH_CHECK(t.scalar_type() == at::kFloat && t.device() == q.device(), op, ": expected ", name,
                " of dtype Float on ", q.device(), " but got ", t.scalar_type(), " on ",
                t.device());
    return t.contiguous();
  };
  auto grad = [&](const std::optional<at::Tensor>& t, const char* name,
                  std::vector<int64_t> sizes) {
    return present(t) ? check_chunk(*t, name, std::move(sizes)) : at::Tensor();
  };
  const at::Tensor uc = check_chunk(u, "u", {B, H, N, C, dv});
  const at::Tensor wc = check_chunk(w, "w", {B, H, N, C, dk});
  const at::Tensor du = grad(grad_u, "grad_u", {B, H, N, C, dv});
  const at::Tensor dw = grad(grad_w, "grad_w", {B, H, N, C, dk});
  const at::Tensor dqd = grad(grad_qd, "grad_qd", {B, H, N, C, dk});
  const at::Tensor dp = grad(grad_p, "grad_p", {B, H, N, C, C});
  const at::Tensor dkend = grad(grad_kend, "grad_kend", {B, H, N, C, dk});
  const at::Tensor dgl = grad(grad_g_last, "grad_g_last", {B, H, N});
  // dq, dk, dv come out of the kernel in the operands' types (no cast pass) when every value
  // head has its own key head; otherwise dq, dk are FP32 partials per value head (Note
  // [Head group gradient sum]). dg, dbeta FP32.
  const bool partials = args.shape.head_group > 1;
  const auto options = q.options().dtype(at::kFloat);
  const auto qk_options = partials ? options : x.q.options();
  at::Tensor dq, dkk, dvv;
  // Note [Gradients in the inputs' layout]
  if (const int64_t stride = split_row_width(q, k, v, x); !partials && stride > 0) {
    const at::Tensor rows = at::empty({B, T, stride}, x.q.options());
    dq = rows.narrow(2, 0, H * dk).view({B, T, H, dk});
    dkk = rows.narrow(2, H * dk, H * dk).view({B, T, H, dk});
    dvv = rows.narrow(2, 2 * H * dk, H * dv).view({B, T, H, dv});
    args.grad_token_stride = stride;
  } else {
    dq = at::empty({B, T, H, dk}, qk_options);
    dkk = at::empty({B, T, H, dk}, qk_options);
    dvv = at::empty(v.sizes(), x.v.options());
  }
  at::Tensor dg = at::empty(g.sizes(), options);
  at::Tensor dbeta = at::empty(beta.sizes(), options);
  set_inputs(args, x, g, beta);
  args.u = uc.data_ptr<float>();
  args.w = wc.data_ptr<float>();
  args.grad_u = data_or_null(du);
  args.grad_w = data_or_null(dw);
  args.grad_qd = data_or_null(dqd);
  args.grad_p = data_or_null(dp);
  args.grad_kend = data_or_null(dkend);
  args.grad_g_last = data_or_null(dgl);
  args.dq = dq.data_ptr();
  args.dk = dkk.data_ptr();
  args.dv = dvv.data_ptr();
  args.dg = dg.data_ptr<float>();
  args.dbeta = dbeta.data_ptr<float>();
  launch(args);
  if (partials) {
    dq = sum_head_groups(dq, q.size(2), q.scalar_type());
    dkk = sum_head_groups(dkk, k.size(2), k.scalar_type());
  }
  // The casts are no-ops except for Half inputs and Float q, k with BFloat16 v (computed
  // through Float).
  return {dq.to(q.scalar_type()), dkk.to(k.scalar_type()), dvv.to(v.scalar_type()), dg, dbeta};
}

}  // namespace chunk_prep_internal

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.def(
      "chunk_prep(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, float scale, int "
      "chunk_size, bool l2_normalize_qk) -> (Tensor u, Tensor w, Tensor qd, Tensor p, Tensor "
      "kend, Tensor g_last)");
  m.def(
      "chunk_prep_backward(Tensor? grad_u, Tensor? grad_w, Tensor? grad_qd, Tensor? grad_p, "
      "Tensor? grad_kend, Tensor? grad_g_last, Tensor q, Tensor k, Tensor v, Tensor g, Tensor "
      "beta, Tensor u, Tensor w, float scale, int chunk_size, bool l2_normalize_qk) -> (Tensor "
      "dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta)");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("chunk_prep", &chunk_prep_forward_cpu);
  m.impl("chunk_prep_backward", &chunk_prep_backward_cpu);
}

TORCH_LIBRARY_IMPL(gdr, Autograd, m) { m.impl("chunk_prep", &chunk_prep_autograd); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_prep(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, int64_t chunk_size, bool l2_normalize_qk) {
  return forward_op().call(q, k, v, g, beta, scale, chunk_size, l2_normalize_qk);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_prep_backward(
    const std::optional<at::Tensor>& grad_u, const std::optional<at::Tensor>& grad_w,
    const std::optional<at::Tensor>& grad_qd, const std::optional<at::Tensor>& grad_p,
    const std::optional<at::Tensor>& grad_kend, const std::optional<at::Tensor>& grad_g_last,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& u, const at::Tensor& w, double scale,
    int64_t chunk_size, bool l2_normalize_qk) {
  return backward_op().call(grad_u, grad_w, grad_qd, grad_p, grad_kend, grad_g_last, q, k, v, g,
                            beta, u, w, scale, chunk_size, l2_normalize_qk);
}

bool chunk_prep_has_cuda_kernel() {
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow("gdr::chunk_prep", "")
      .hasKernelForDispatchKey(c10::DispatchKey::CUDA);
}

}  // namespace gdr
