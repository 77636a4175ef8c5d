// Causal-LM cross-entropy as one op that reads the logits in place:
//   causal_lm_cross_entropy(logits [B, T, V], labels [B, T], ignore_index) -> loss []
//   loss = mean over the scored rows (b, t), t < T - 1, whose target y = labels[b, t + 1]
//          is not ignore_index, of logsumexp(logits[b, t]) - logits[b, t, y]
// the value of the composite (narrow to the first T - 1 positions, to(Float),
// at::cross_entropy_loss with Mean reduction), as a 0-dim FP32 tensor (Double logits on the
// CPU: to(Double) and FP64 throughout, loss, lse and count included). When every row is
// ignored the mean is 0 / 0 = NaN and the gradient is zero, like ATen's Mean reduction.
// Logits: Float, Half or BFloat16 (Double on the CPU only), any batch / token strides; on
// CUDA a vocab stride other than 1 costs one contiguous copy. Labels: any integral dtype.
//
// CPU implementation: the composite's ATen ops one for one (log_softmax, nll_loss_forward;
// backward nll_loss_backward, _log_softmax_backward_data, cast, zero pad), so values and
// gradients equal autograd through the composite bit for bit. CUDA implementation: the
// kernels of kernels/cross_entropy/cross_entropy.h on the current stream with scratch from the
// caching allocator: forward = one pass over the scored rows (per-row loss and logsumexp) plus an
// ordered one-block mean; backward = one pass writing grad_logits [B, T, V] (contiguous,
// logits dtype, zero on the last position and ignored rows) from the saved logsumexp and
// the upstream gradient read on the device (no sync). Deterministic by construction on
// both devices (Note [Cross-entropy determinism]). Differentiable once.
//
// Note [Cross-entropy target check]: on the CPU a target outside [0, V) that is not
// ignore_index is an error naming the value, its position in labels and V. On CUDA the
// op does not check on the host: copying labels back would wait for all queued work on
// every call, and the host could no longer queue ahead (measured on the 0.8B DP=2 step:
// docs/benchmarks_log.md). The kernels never read outside a row; a bad target
// makes the mean loss NaN and that row's gradient NaN (the other rows are unaffected),
// which the trainer reports as a non-finite loss. Callers validate labels on the host
// before uploading them: the trainer checks every token id against the vocabulary
// (gdr/trainer.cc, Note [Token id check]).
//
// The model's switch: the execution policy's cross_entropy = fused|composite
// (kernels.cross_entropy, environment override GDR_CROSS_ENTROPY; default fused) picks
// this op or the composite for CUDA logits in causal_lm_loss (models/qwen/model.cc); CPU
// and FP64 logits always take the composite.
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/policy/execution_policy.h"

#include <tuple>

namespace gdr {

// The unfused libtorch composition (autograd through ATen ops): the one reference of the
// formula, and the model's path on the CPU and for FP64.
at::Tensor causal_lm_cross_entropy_composite(const at::Tensor& logits, const at::Tensor& labels,
                                             int64_t ignore_index);

// Autograd-aware fused op (dispatches to CPU or CUDA).
at::Tensor causal_lm_cross_entropy(const at::Tensor& logits, const at::Tensor& labels,
                                   int64_t ignore_index);

// The forward and backward ops alone (no autograd). lse: FP32 [B, T - 1], the logsumexp of
// each scored row (0 on ignored rows on CUDA); count: 0-dim FP32, the number of counted
// rows (ATen's total_weight); both FP64 for Double logits. grad_loss: the upstream
// gradient, a one-element FP32 tensor on the logits' device. grad_logits: [B, T, V] contiguous in
// the logits' dtype.
std::tuple<at::Tensor, at::Tensor, at::Tensor> causal_lm_cross_entropy_forward(
    const at::Tensor& logits, const at::Tensor& labels,
    int64_t ignore_index);  // (loss, lse, count)
at::Tensor causal_lm_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                            const at::Tensor& labels, const at::Tensor& lse,
                                            const at::Tensor& count, int64_t ignore_index);

// True when the fused CUDA op takes `logits`: a CUDA tensor of dtype Float, Half or
// BFloat16.
bool cross_entropy_fused_supports(const at::Tensor& logits);

}  // namespace gdr
