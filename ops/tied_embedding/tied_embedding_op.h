// The tied word embedding of a causal LM (Qwen3.5-0.8B: W [V, H] is both the input
// embedding and the LM head) as a pair of autograd ops whose backward hands W ONE gradient:
//   h      = tied_embedding_lookup(ids, W, state)   W.index_select(0, ids.flatten()), in
//            ids' shape + [H]: at::embedding's bits (what torch::nn::Embedding runs)
//   logits = tied_lm_head(hidden, W, state)         hidden.matmul(W.t()): the bits of
//            matmul's folded mm (hidden [..., H] -> [N, H] @ W.t(), its path whenever W
//            requires grad)
// In the backward the LM head's dW = dlogits_2d^T @ hidden_2d (MmBackward's mm) is not
// returned to autograd but handed to the lookup's backward through `state`, which adds
// each id's token rows of d_h into it in place (tied_embedding_add_rows_) and returns it as
// W's gradient: no dense [V, H] embedding gradient, no zero fill, no [V, H] add (Note
// [Tied embedding gradient] in ops/tied_embedding/tied_embedding_op.cc). d_hidden is MmBackward's
// bits.
//
// One state per forward: make_tied_embedding_state(), passed to both ops of that forward.
// Dtypes: W and hidden one of Float, Half, BFloat16 (and Double on the CPU); ids int64.
// Deterministic by construction (kernels/tied_embedding/embedding_rows.h); no host sync, no
// allocation outside the current stream, so forward + backward can be captured into a CUDA graph.
//
// The model's switch: the execution policy's tied_embedding = fused|composite
// (kernels.tied_embedding, environment override GDR_TIED_EMBEDDING; default fused) picks
// this pair or torch::nn::Embedding + matmul (models/qwen/model.cc).
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/policy/execution_policy.h"

#include <memory>

namespace gdr {

// What the two ops of one forward share (opaque; see Note [Tied embedding gradient]).
class TiedEmbeddingState;
using TiedEmbeddingStatePtr = std::shared_ptr<TiedEmbeddingState>;
TiedEmbeddingStatePtr make_tied_embedding_state();

// ids int64, any shape; weight [V, H] -> [*ids.shape, H] in W's dtype.
at::Tensor tied_embedding_lookup(const at::Tensor& ids, const at::Tensor& weight,
                                 const TiedEmbeddingStatePtr& state);

// hidden [..., H] (at least 2-D) in W's dtype -> logits [..., V].
at::Tensor tied_lm_head(const at::Tensor& hidden, const at::Tensor& weight,
                        const TiedEmbeddingStatePtr& state);

// The backward's kernel as an op (no autograd), in place: for every distinct id in [0, V)
// dW[id] = round(float(dW[id]) + sum of rows[t] over the tokens t with that id, in FP32 in
// token order starting from the first token's row); FP64 sums for Double. grad_weight
// [V, H] contiguous; ids [N] int64; rows [N, H] contiguous, grad_weight's dtype and device.
// Ids outside [0, V) are skipped. The CPU implementation is the reference.
void tied_embedding_add_rows_(at::Tensor& grad_weight, const at::Tensor& ids,
                              const at::Tensor& rows);

// Whether the pair can take W: the switch says fused and W is Float / Half / BFloat16 (or
// Double on the CPU).
bool tied_embedding_fusable(const at::Tensor& weight);

}  // namespace gdr
