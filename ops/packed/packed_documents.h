// Packed documents: several documents back to back along one sequence dim, described by
// cu_seqlens (as FLA's and flash-attention's varlen APIs): document i is positions
// cu_seqlens[i] .. cu_seqlens[i + 1] - 1.
//
// Note [Packed documents]: an op's *_varlen entry point (gated_delta_rule_varlen,
// causal_conv1d_silu_varlen, causal_attention_varlen, partial_rope_varlen) runs the op on
// each document's slice and concatenates the results, so each document sees only its own
// tokens: no recurrent state, conv history or attention crosses a boundary, and RoPE
// positions restart at 0. The result is the op on each document alone, bit for bit, forward
// and backward: the slices come from one split_with_sizes (split_documents below), whose
// backward is one cat of the documents' input gradients (a narrow per document would instead
// add N zero-filled full-size gradients: N times the memory traffic, and the sign of an
// all-zero element could flip), and the outputs from one cat, whose backward hands each
// document a view of its slice of the output gradient. The cost is one launch sequence per
// document and the two copies of the split / cat; a kernel that reads the offsets itself
// (cuDNN's padded-ragged attention, FLA's varlen GDN kernels) is future work. The model's
// use of it (document masking in training): Note [Document masking] in
// models/qwen/document_bounds.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace gdr {

// Checks cu_seqlens for a packed sequence of `tokens` positions: at least 2 offsets (one
// document), running from 0 to `tokens`, non-decreasing (empty documents allowed). Errors
// start with `op` and name cu_seqlens, e.g. "gated_delta_rule_varlen: expected cu_seqlens to
// run from 0 to T = 10 but got 0 .. 9".
void check_cu_seqlens(const char* op, const std::vector<int64_t>& cu_seqlens, int64_t tokens);

// The documents' slices of x along `dim` (views, one per document, empty ones included), from
// one differentiable split_with_sizes (see the Note). Checks cu_seqlens against x.size(dim).
std::vector<at::Tensor> split_documents(const char* op, const at::Tensor& x, int64_t dim,
                                        const std::vector<int64_t>& cu_seqlens);

// The documents' lengths: cu_seqlens[i + 1] - cu_seqlens[i].
std::vector<int64_t> document_lengths(const std::vector<int64_t>& cu_seqlens);

}  // namespace gdr
