// Training batches of token ids: fixed-length windows over one token stream, visited in a
// seeded, shuffled order that a checkpoint can save and restore exactly.
//
// The stream is either the embedded corpus (data.source: embedded; every byte of the text
// file is one token, id 0..255) or a Megatron indexed dataset (data.source: indexed; all
// sequences concatenated in file order, no separator tokens inserted).
//
// Windows: window i is tokens [i * seq_len, i * seq_len + seq_len + 1), i.e. seq_len + 1
// tokens so that seq_len next-token predictions fit, consecutive windows sharing one
// boundary token; there are (num_tokens - 1) / seq_len of them (the tail is dropped).
//
// Order: epoch e visits every window once, in a permutation drawn by Fisher-Yates from a
// SplitMix64 stream: state = seed * 0x9E3779B97F4A7C15 ^ e, one draw discarded, then for
// i = n-1 .. 1 swap order[i] with order[(r * (i + 1)) >> 64] (r the next 64-bit draw).
// Fully specified, so the same on every platform and standard library (std::shuffle is
// not); tests/gdr/data_test.cc pins it against an independent transcription. A DataPosition {epoch,
// index} names the next window to read, so restoring it continues the exact sequence of batches; a
// batch that runs past the end of an epoch continues into the next one.
//
// Note [Document starts]: with data.document_masking the windows also say where documents
// start, for the model's document masking (Note [Document masking] in
// models/qwen/document_bounds.h). A document starts at the start of the stream, at the first
// token of each document of an indexed dataset's document index (Megatron's .idx: document k
// is sequences [doc[k], doc[k + 1]); empty documents start nowhere), and right after each
// token in model.eos_token_id (the EOS token is its document's last token; the next token
// starts a new one), both where both apply. The embedded corpus has no document index, so
// masking it needs an eos_token_id (e.g. 10, '\n', makes every line a document). A window's
// starts are positions in its seq_len + 1 tokens: the model runs on all of them (the last
// token only as a target), so a start at position seq_len also drops the window's last
// target. Every window's starts begin with 0 (a window starts its own first document, the
// rest of a document cut by the window boundary).
//
// Torch-free: batches are plain int64 vectors, row-major [batch, seq_len + 1].
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gdr/run_config.h"

namespace gdr {

struct DataPosition {
  int64_t epoch = 0;
  int64_t index = 0;  // into the epoch's order

  bool operator==(const DataPosition& o) const { return epoch == o.epoch && index == o.index; }
  bool operator!=(const DataPosition& o) const { return !(*this == o); }
};

class TokenWindows {
 public:
  // Reads the source named by `config` (its training windows: without the held-out tail
  // when data.valid_fraction > 0, see open_data_sets). InvalidArgument when it holds fewer than
  // seq_len + 1 tokens, or (embedded) a token outside 0..255 cannot occur; errors of the
  // readers (NotFound, DataLoss) pass through with the file named.
  // With data.document_masking the windows know their document starts (Note [Document
  // starts]), from the indexed dataset's document index and `eos_token_ids`; the embedded
  // source without eos_token_ids is then InvalidArgument.
  static absl::StatusOr<TokenWindows> open(const DataConfig& config, uint64_t seed,
                                           const std::vector<int64_t>& eos_token_ids = {});
  // The same over an in-memory stream (tests, tools). `document_starts`: positions in
  // `tokens` where documents start, sorted (0 is implied; duplicates and positions past the
  // end are ignored); absent: the windows carry no document starts.
  static absl::StatusOr<TokenWindows> from_tokens(
      std::vector<int64_t> tokens, int64_t seq_len, uint64_t seed,
      std::optional<std::vector<int64_t>> document_starts = std::nullopt);

  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t num_windows() const { return num_windows_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t window_length() const { return seq_len_ + 1; }

  // The window order of `epoch` (a permutation of 0 .. num_windows() - 1).
  std::vector<int64_t> epoch_order(int64_t epoch) const;

  // True when the windows carry document starts (Note [Document starts]).
  bool has_document_starts() const { return has_document_starts_; }
  // Where documents start in window `window`: strictly increasing positions in
  // [0, seq_len + 1), the first 0 ({0} when the windows carry no document starts).
  std::vector<int64_t> window_document_starts(int64_t window) const;

  // Windows first .. first + count - 1 in index order (no shuffle, the position unchanged),
  // row-major [count, seq_len + 1]: the evaluation batches. Requires
  // 0 <= first <= first + count <= num_windows(). `document_starts` (may be null) gets each
  // row's window_document_starts.
  std::vector<int64_t> windows_in_order(
      int64_t first, int64_t count,
      std::vector<std::vector<int64_t>>* document_starts = nullptr) const;

  // `batch_size` windows, row-major [batch_size, seq_len + 1], and the position advanced.
  // `document_starts` (may be null) gets each row's window_document_starts.
  std::vector<int64_t> next_batch(int64_t batch_size,
                                  std::vector<std::vector<int64_t>>* document_starts = nullptr);

  const DataPosition& position() const { return position_; }
  // InvalidArgument unless epoch >= 0 and 0 <= index < num_windows().
  absl::Status set_position(const DataPosition& position);

 private:
  TokenWindows(std::vector<int64_t> tokens, int64_t seq_len, uint64_t seed);
  const std::vector<int64_t>& order_of_current_epoch();

  std::vector<int64_t> tokens_;
  bool has_document_starts_ = false;
  std::vector<int64_t> document_starts_;  // sorted, unique, in [0, num_tokens()), first 0
  int64_t seq_len_ = 0;
  int64_t num_windows_ = 0;
  uint64_t seed_ = 0;
  DataPosition position_;
  int64_t cached_epoch_ = -1;
  std::vector<int64_t> cached_order_;
};

// The training windows and, when the config names one, the validation windows:
//   data.valid_fraction > 0   the last floor(windows * fraction) windows of the stream are
//                             held out (Note [Held-out validation] in data.cc): training
//                             never visits them, and no validation target is a training one;
//   data.valid_path / valid_prefix   a second text file / indexed dataset of the same kind.
// The validation windows are read in index order (TokenWindows::windows_in_order), never
// shuffled, so every evaluation of a run sees the same tokens.
struct DataSets {
  TokenWindows train;
  std::optional<TokenWindows> valid;
};
// With data.document_masking both sets carry their document starts (TokenWindows::open).
absl::StatusOr<DataSets> open_data_sets(const DataConfig& config, uint64_t seed,
                                        const std::vector<int64_t>& eos_token_ids = {});

// The positions right after each token of `eos_token_ids` in `tokens` (before the end):
// the document starts an EOS gives (Note [Document starts]), sorted.
std::vector<int64_t> document_starts_after_eos(const std::vector<int64_t>& tokens,
                                               const std::vector<int64_t>& eos_token_ids);

}  // namespace gdr
