// The linear group op: argument checks, the composite (reference), autograd with the
// input gradient summed inside the GEMMs, and the GDR_LINEAR_GROUP switch. Plain ATen
// calls, so one implementation for every device.
#include "ops/linear_group.h"
#include "ops/env_choice.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstddef>

namespace gdr {
namespace {

void check_inputs(const at::Tensor& x, at::TensorList weights) {
  TORCH_CHECK(x.defined(), "linear_group: x is undefined");
  TORCH_CHECK(x.dim() >= 1, "linear_group: expected x of shape [..., in], but got a 0-dim tensor");
  TORCH_CHECK(!weights.empty(), "linear_group: expected at least one weight, but got none");
  const int64_t in = x.size(-1);
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.defined(), "linear_group: weights[", i, "] is undefined");
    TORCH_CHECK(w.dim() == 2, "linear_group: expected weights[", i,
                "] of 2 dims [out, in], but got ", w.dim(), " (shape ", w.sizes(), ")");
    TORCH_CHECK(w.size(1) == in, "linear_group: expected weights[", i, "] of shape [out, ", in,
                "] (in = x.size(-1)), but got ", w.sizes());
    TORCH_CHECK(w.scalar_type() == x.scalar_type(), "linear_group: expected weights[", i,
                "] of dtype ", x.scalar_type(), " (x's), but got ", w.scalar_type());
    TORCH_CHECK(w.device() == x.device(), "linear_group: expected weights[", i, "] on ", x.device(),
                " (x's device), but got ", w.device());
  }
}

// Note [Linear group bits]
// at::linear(x, W) without a bias is at::matmul(x, W.t()). For x of 3 or more dims matmul
// folds x's leading dims into rows and runs one mm, x_rows.mm(W.t()), when the fold is a
// view or when W.t() requires a gradient (then x_rows = x.reshape(-1, in) may be a copy);
// otherwise it broadcasts W and runs bmm. The op's forward runs with grad mode off (custom
// Function), where W.t() never requires a gradient, so where the composite would fold by
// copying x (grad mode on, W requiring a gradient, leading dims that do not fold as a
// view) the forward hands at::linear a contiguous x instead: the same rows, the same mm,
// the same bits. Every other case is the same call on the same operands.
//
// The composite's dW comes from MmBackward0's mm_mat2_backward on mat2 = W.t() (sizes
// [in, out], strides W's transposed): for a column-major mat2 (any contiguous W) it is
// (dY_rows.t().mm(x_rows)).t(), and TBackward0 transposes back, so dW = dY_rows.t().mm(
// x_rows); otherwise x_rows.t().mm(dY_rows), transposed. weight_grad runs the same mm.
// dW is only needed where W requires a gradient under grad mode, where matmul always
// folds, and x.reshape(-1, in) is then exactly the composite's x_rows (a view, or a copy
// of the same values).

// True when x's leading dims fold into rows as a view (matmul's should_fold test).
bool rows_fold_as_view(const at::Tensor& x) {
  if (x.numel() == 0) return true;
  for (int64_t d = 0; d + 2 < x.dim(); ++d) {
    if (x.stride(d) != x.stride(d + 1) * x.size(d + 1)) return false;
  }
  return true;
}

// dW for y = x_rows.mm(w.t()): the mm of ATen's mm_mat2_backward (Note [Linear group bits]).
at::Tensor weight_grad(const at::Tensor& dy_rows, const at::Tensor& x_rows, const at::Tensor& w) {
  const at::Tensor wt = w.t();
  if (wt.stride(0) == 1 && wt.stride(1) == wt.size(0)) return dy_rows.t().mm(x_rows);
  return x_rows.t().mm(dy_rows).t();
}

// Note [Linear group input gradient]
// When several projections read one x, autograd gets one input gradient per projection
// (dY_i @ W_i, each a GEMM rounded to x's dtype) and sums them with one add kernel of
// x's size per extra consumer: ~360 BF16 [B*T, hidden] adds per optimizer step of the
// 0.8B model (~1.3 ms on an H200). Here the first defined dY_i gives dX = dY_i @ W_i and
// every further defined one, in index order, runs dX.addmm_(dY_j, W_j) with beta = 1:
// cuBLAS (or the CPU GEMM) reads dX in its epilogue, adds it to the FP32 accumulator and
// rounds once. So dX is not the composite's bits (separately rounded products, then a
// rounded add each), but it rounds to x's dtype once per GEMM instead of once per GEMM and
// once per add: at least as accurate. The order is fixed, so the result is deterministic
// (given deterministic GEMMs, which cuBLAS is with its per-stream workspace).
class LinearGroupFunction : public torch::autograd::Function<LinearGroupFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& x, at::TensorList weights,
                                                bool grad_mode) {
    ctx->set_materialize_grads(false);  // unused outputs come to backward undefined
    at::Tensor x_rows;  // x copied contiguous, where the composite's matmul would copy it
    const bool x_folds_as_view = x.dim() < 3 || rows_fold_as_view(x);
    torch::autograd::variable_list ys;
    ys.reserve(weights.size());
    for (const at::Tensor& w : weights) {
      const bool folds_by_copy = grad_mode && w.requires_grad() && !x_folds_as_view;
      if (folds_by_copy && !x_rows.defined()) x_rows = x.contiguous();
      ys.push_back(at::linear(folds_by_copy ? x_rows : x, w));
    }
    torch::autograd::variable_list saved{x};
    saved.insert(saved.end(), weights.begin(), weights.end());
    ctx->save_for_backward(saved);
    return ys;
  }

  // Gradients in the order of the inputs: x, each weight, then grad_mode's (undefined).
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const torch::autograd::variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    torch::autograd::variable_list out(grads.size() + 2);
    at::Tensor x_rows, dx_rows;
    for (size_t i = 0; i < grads.size(); ++i) {
      if (!grads[i].defined()) continue;
      const at::Tensor& w = saved[1 + i];
      // UnsafeViewBackward0's reshape: the rows MmBackward0 gets.
      const at::Tensor dy_rows = grads[i].reshape({-1, w.size(0)});
      if (ctx->needs_input_grad(1 + i)) {
        if (!x_rows.defined()) x_rows = x.reshape({-1, x.size(-1)});
        out[1 + i] = weight_grad(dy_rows, x_rows, w);
      }
      if (!ctx->needs_input_grad(0)) continue;
      // See Note [Linear group input gradient].
      if (!dx_rows.defined()) {
        dx_rows = dy_rows.mm(w);
      } else {
        dx_rows.addmm_(dy_rows, w, /*beta=*/1, /*alpha=*/1);
      }
    }
    if (dx_rows.defined()) out[0] = dx_rows.view(x.sizes());
    return out;
  }
};

}  // namespace

std::vector<at::Tensor> linear_group(const at::Tensor& x, at::TensorList weights) {
  check_inputs(x, weights);
  return LinearGroupFunction::apply(x, weights, at::GradMode::is_enabled());
}

std::vector<at::Tensor> linear_group_composite(const at::Tensor& x, at::TensorList weights) {
  check_inputs(x, weights);
  std::vector<at::Tensor> ys;
  ys.reserve(weights.size());
  for (const at::Tensor& w : weights) ys.push_back(at::linear(x, w));
  return ys;
}

LinearGroupImpl linear_group_impl() {
  return env_picks_second("GDR_LINEAR_GROUP", "fused", "composite") ? LinearGroupImpl::kComposite
                                                                    : LinearGroupImpl::kFused;
}

std::vector<at::Tensor> project(const at::Tensor& x, at::TensorList weights) {
  if (linear_group_impl() == LinearGroupImpl::kComposite) return linear_group_composite(x, weights);
  return linear_group(x, weights);
}

}  // namespace gdr
