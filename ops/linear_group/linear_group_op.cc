// The linear group op: argument checks, the composite (reference), autograd with the
// input gradient summed inside the GEMMs, and the execution policy's linear_group switch.
// Plain ATen calls, so one implementation for every device.
#include "ops/linear_group/linear_group_op.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstddef>
#include <numeric>
#include <vector>

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

// The order in which the products enter dX: increasing out_i, ties in index order (Note
// [Linear group input gradient]). saved = {x, W_0, W_1, ...}.
std::vector<size_t> accumulation_order(const torch::autograd::variable_list& saved) {
  std::vector<size_t> order(saved.size() - 1);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return saved[1 + a].size(0) < saved[1 + b].size(0); });
  return order;
}

// Note [Linear group input gradient]
// When several projections read one x, autograd gets one input gradient per projection
// (dY_i @ W_i, each a GEMM rounded to x's dtype) and sums them with one add kernel of
// x's size per extra consumer: ~360 BF16 [B*T, hidden] adds per optimizer step of the
// 0.8B model (measured: docs/benchmarks_log.md). Here the first product gives
// dX = dY_i @ W_i and every further one runs dX.addmm_(dY_j, W_j) with beta = 1: cuBLAS (or
// the CPU GEMM) reads dX in its epilogue, adds it to the FP32 accumulator and rounds once.
// So dX is not the composite's bits (separately rounded products, then a rounded add each):
// it is rounded to x's dtype once per GEMM instead of once per GEMM and once per add.
//
// Each of those roundings is of the running sum, so the order matters for accuracy: the
// products go in order of increasing out_i (ties in index order), the narrow projections'
// small contributions first and the widest one last, so only the last roundings are at
// the full sum's size. Measured with the CPU's BF16 GEMM on the model's widths (x [1, 256,
// 1024]; Frobenius error against FP64 from the same BF16 operands): in index order the
// GDN's group (qkv first, so the full sum rounded four times) had 3.2e-3 against the
// composite's 2.6e-3; in increasing width 1.9e-3, and the attention and MLP groups 1.9e-3
// and 2.0e-3 against 2.6e-3 and 2.5e-3. linear_group_test bounds it on the CPU and
// linear_group_gpu_test on CUDA. The order is a function of the shapes alone, so the
// result is deterministic (given deterministic GEMMs, which cuBLAS is with its per-stream
// workspace). Undefined dY_i (unused outputs) are skipped.
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
    const size_t n = grads.size();
    torch::autograd::variable_list out(n + 2);
    // UnsafeViewBackward0's reshape: the rows MmBackward0 gets.
    std::vector<at::Tensor> dy_rows(n);
    for (size_t i = 0; i < n; ++i) {
      if (grads[i].defined()) dy_rows[i] = grads[i].reshape({-1, saved[1 + i].size(0)});
    }
    at::Tensor x_rows;
    for (size_t i = 0; i < n; ++i) {
      if (!dy_rows[i].defined() || !ctx->needs_input_grad(1 + i)) continue;
      if (!x_rows.defined()) x_rows = x.reshape({-1, x.size(-1)});
      out[1 + i] = weight_grad(dy_rows[i], x_rows, saved[1 + i]);
    }
    if (!ctx->needs_input_grad(0)) return out;
    at::Tensor dx_rows;
    for (size_t i : accumulation_order(saved)) {
      if (!dy_rows[i].defined()) continue;
      const at::Tensor& w = saved[1 + i];
      if (!dx_rows.defined()) {
        dx_rows = dy_rows[i].mm(w);
      } else {
        dx_rows.addmm_(dy_rows[i], w, /*beta=*/1, /*alpha=*/1);
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

std::vector<at::Tensor> project(const at::Tensor& x, at::TensorList weights) {
  if (current_execution_policy().linear_group == LinearGroupImpl::kComposite)
    return linear_group_composite(x, weights);
  return linear_group(x, weights);
}

}  // namespace gdr
