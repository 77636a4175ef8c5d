// DocumentBounds: where the documents of a packed batch start, per row; what the model
// needs to keep them apart.
//
// Note [Document masking]: training windows are packed, so one row of a batch may hold the
// end of one document and the start of the next. Handed a DocumentBounds
// (QwenForCausalLMImpl::forward / loss), the model keeps every document to itself: each GDN
// layer's causal conv starts from zero history and its recurrent core from a zero state at
// every document start, full attention is block-diagonal causal (a query sees the keys of its
// own document only), and RoPE positions restart at 0 in each document. Each of these runs the
// op on each document's slice (Note [Packed documents] in ops/packed/packed_documents.h), so
// a document's logits do not depend on the other documents' tokens at all (bit for bit:
// everything else the model does is row-wise, with shapes that do not depend on the values),
// and equal those of the model run on the document alone up to the rounding of the
// projections', MLP's and LM head's GEMMs over a different number of rows.
//
// The loss drops the term at each document start after a row's first position: the label
// there (the document's first token, scored against the previous position's logits) would
// train the previous document's last position to guess a token nothing in its context can
// tell. (The same choice as Hugging Face's DataCollatorWithFlattening; Megatron's
// eod_mask_loss drops the same terms when documents end with EOD.) The loss is the mean over
// the remaining targets.
//
// A batch whose rows are each one document takes the model's ordinary batched path: the
// same bits as without bounds, no per-document work. Where the starts come from (the
// indexed dataset's document index, or the token after each model.eos_token_id):
// gdr/data.h. On CUDA the per-document slices are one launch sequence per document
// (cuDNN's padded-ragged attention and FLA-style varlen GDN kernels are future work) and
// cannot be captured once for every batch, so the trainer runs masked microbatches eagerly
// (Note [Microbatch graphs] in gdr/microbatch_graphs.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gdr {

class DocumentBounds {
 public:
  // starts[r]: the positions in row r (of `length` tokens) where a document starts, strictly
  // increasing, the first 0, all < length. InvalidArgument naming the row and the values
  // otherwise, or when length < 1 or there is no row.
  static absl::StatusOr<DocumentBounds> create(std::vector<std::vector<int64_t>> starts,
                                               int64_t length);

  int64_t rows() const { return static_cast<int64_t>(starts_.size()); }
  int64_t length() const { return length_; }
  const std::vector<int64_t>& starts(int64_t row) const { return starts_.at(row); }
  // True when every row is one document (the model's ordinary path).
  bool single_documents() const { return single_documents_; }
  // The offsets of every document of the batch flattened row after row into one sequence of
  // rows() * length() positions (the rows' ends are document ends too): N + 1 strictly
  // increasing offsets from 0, as the ops' *_varlen entry points take them.
  const std::vector<int64_t>& cu_seqlens() const { return cu_seqlens_; }
  // Positions r * length() + s of every start s > 0 in row r: the loss's dropped targets.
  std::vector<int64_t> flat_starts_after_the_first() const;

 private:
  DocumentBounds() = default;

  std::vector<std::vector<int64_t>> starts_;
  int64_t length_ = 0;
  bool single_documents_ = true;
  std::vector<int64_t> cu_seqlens_;
};

}  // namespace gdr
