// One forward and backward of a tiny tied-embedding chain (lookup -> h + 0.5 silu(h) ->
// LM head -> sum(logits * probe)), through the fused pair (ops/tied_embedding/tied_embedding_op.h)
// or the composite the model ran before (at::embedding, what torch::nn::Embedding runs, and
// hidden.matmul(W.t())), plus the independent expectation of the fused W gradient; for
// the CPU and GPU tests that compare them.
#pragma once

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "ops/tied_embedding/tied_embedding_op.h"

namespace gdr::test_support {

struct TiedChainResult {
  at::Tensor logits, grad_weight, grad_hidden, grad_h;
};

// ids [B, T] int64; weight [V, H]; probe [B, T, V] (= dlogits), weight's dtype and device.
inline TiedChainResult run_tied_chain(bool fused, const at::Tensor& ids, const at::Tensor& weight,
                                      const at::Tensor& probe) {
  at::Tensor w = weight.detach().clone().requires_grad_(true);
  const TiedEmbeddingStatePtr state = make_tied_embedding_state();
  at::Tensor h = fused ? tied_embedding_lookup(ids, w, state) : at::embedding(w, ids);
  h.retain_grad();
  at::Tensor hidden = h + at::silu(h) * 0.5;
  hidden.retain_grad();
  const at::Tensor logits = fused ? tied_lm_head(hidden, w, state) : hidden.matmul(w.t());
  (logits * probe).sum().backward();
  return {logits.detach(), w.grad(), hidden.grad(), h.grad()};
}

// What the fused chain's W gradient must be, bit for bit: MmBackward's dW = probe_2d^T @
// hidden_2d with the token rows of grad_h added by the rows op (its CPU reference is
// checked against a plain loop) in one rounding, on the CPU. `r` is a fused run; hidden is
// recomputed on the inputs' device. Returns a CPU tensor.
inline at::Tensor expected_fused_grad_weight(const at::Tensor& ids, const at::Tensor& weight,
                                             const at::Tensor& probe, const TiedChainResult& r) {
  const int64_t n = ids.numel(), hsize = weight.size(1), v = weight.size(0);
  const at::Tensor h = at::embedding(weight, ids);
  const at::Tensor hidden = h + at::silu(h) * 0.5;
  at::Tensor dw = probe.reshape({n, v}).t().mm(hidden.reshape({n, hsize})).cpu();
  tied_embedding_add_rows_(dw, ids.reshape({-1}).cpu(),
                           r.grad_h.reshape({n, hsize}).contiguous().cpu());
  return dw;
}

}  // namespace gdr::test_support
