// Megatron-LM's indexed dataset (the "MMIDIDX" .bin + .idx pair): token sequences stored
// back to back in a .bin file, described by an .idx file.
//
// Hand-written: no C++ reader exists in our package registries. The layout follows
// megatron/core/datasets/indexed_dataset.py (_IndexWriter / _IndexReader); all integers are
// little-endian:
//   .idx  offset 0   9 bytes   magic "MMIDIDX\x00\x00"
//         offset 9   u64       version, always 1
//         offset 17  u8        dtype code of the tokens in the .bin (TokenDType)
//         offset 18  u64       S, the sequence count
//         offset 26  u64       D, the document-index count (number of documents + 1)
//         offset 34  int32[S]  sequence lengths, in tokens
//                    int64[S]  sequence pointers, byte offsets into the .bin
//                    int64[D]  document indices: document k is sequences
//                              [doc[k], doc[k + 1]); doc[0] == 0 and doc[D - 1] == S
//                    int8[S]   sequence modes, only in multimodal datasets (ignored here)
//   .bin  the tokens, native numpy layout of the dtype.
//
// Contract:
//   - IndexedDataset::open validates everything up front (magic, version, dtype, sizes
//     implied by the counts, every sequence inside the .bin, document indices starting at 0,
//     non-decreasing and ending at S), so reads afterwards cannot go out of bounds. Errors
//     are absl::DataLossError naming the file and what is wrong (NotFound for a missing
//     file).
//   - The .bin is memory-mapped; a dataset is cheap to copy (copies share the mapping) and
//     safe to read from several threads.
//   - Tokens come back as int64 whatever the stored dtype.
//   - IndexedDatasetBuilder writes files Megatron reads unchanged; both files are published
//     atomically, the .idx last (see Note [Atomic file writes] in io/file_util.h).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "io/file_util.h"

namespace gdr::io {

// Megatron's DType codes. Float codes exist in the format but are not token types.
enum class TokenDType : uint8_t {
  kUInt8 = 1,
  kInt8 = 2,
  kInt16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kFloat64 = 6,
  kFloat32 = 7,
  kUInt16 = 8,
};

// Bytes per token; "uint16" etc. (numpy names) for messages.
int64_t token_dtype_size(TokenDType dtype);
const char* token_dtype_name(TokenDType dtype);

std::string idx_path_of(const std::string& path_prefix);  // prefix + ".idx"
std::string bin_path_of(const std::string& path_prefix);  // prefix + ".bin"

class IndexedDataset {
 public:
  // Opens `path_prefix`.idx and `path_prefix`.bin.
  static absl::StatusOr<IndexedDataset> open(const std::string& path_prefix);

  TokenDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }
  // Number of documents (one less than the number of document indices).
  int64_t num_documents() const { return static_cast<int64_t>(document_indices_.size()) - 1; }
  int64_t num_tokens() const { return num_tokens_; }

  const std::vector<int32_t>& sequence_lengths() const { return sequence_lengths_; }
  const std::vector<int64_t>& sequence_pointers() const { return sequence_pointers_; }
  // D == num_documents() + 1 entries; document k is sequences [d[k], d[k + 1]).
  const std::vector<int64_t>& document_indices() const { return document_indices_; }

  // Tokens [offset, offset + length) of sequence `index` (the rest of it when length is
  // nullopt), like Megatron's IndexedDataset.get. OutOfRange for a bad index or span.
  absl::StatusOr<std::vector<int64_t>> get(int64_t index, int64_t offset = 0,
                                           std::optional<int64_t> length = std::nullopt) const;
  absl::StatusOr<std::vector<int64_t>> sequence(int64_t index) const { return get(index); }

 private:
  IndexedDataset() = default;

  std::string path_prefix_;
  TokenDType dtype_ = TokenDType::kUInt8;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> sequence_pointers_;
  std::vector<int64_t> document_indices_;
  int64_t num_tokens_ = 0;
  std::shared_ptr<const MappedFile> bin_;
};

// Writes a dataset the way Megatron's IndexedDatasetBuilder does:
//   auto b = IndexedDatasetBuilder::create(prefix, TokenDType::kUInt16);
//   b->add_item(tokens); ...; b->end_document(); ...; b->finalize();
// Nothing is visible under `prefix` until finalize() succeeds.
class IndexedDatasetBuilder {
 public:
  // InvalidArgument for the float dtypes.
  static absl::StatusOr<IndexedDatasetBuilder> create(const std::string& path_prefix,
                                                      TokenDType dtype);

  // Appends one sequence. InvalidArgument (and nothing appended) when a token does not fit
  // the dtype, or when the sequence is longer than the format's int32 length allows.
  absl::Status add_item(absl::Span<const int64_t> tokens);

  // Closes the current document: the sequences added since the previous end_document().
  void end_document();

  // Writes the .idx and publishes both files. Sequences added after the last end_document()
  // form a final document, as if end_document() had been called.
  absl::Status finalize();

  int64_t num_sequences() const { return static_cast<int64_t>(sequence_lengths_.size()); }

 private:
  IndexedDatasetBuilder(std::string path_prefix, TokenDType dtype, AtomicFileWriter bin);

  std::string path_prefix_;
  TokenDType dtype_;
  AtomicFileWriter bin_;
  std::vector<int32_t> sequence_lengths_;
  std::vector<int64_t> document_indices_{0};
  std::vector<uint8_t> scratch_;
  bool finalized_ = false;
};

// Byte-level tokenization of a text file into an indexed dataset at `out_prefix`: every
// byte is one token (id 0..255), and every paragraph (lines separated by one or more blank
// or whitespace-only lines) is one document made of one sequence holding the paragraph's
// lines, each with its trailing '\n'. `dtype` must be kUInt8 or kUInt16.
struct TextDatasetStats {
  int64_t num_documents = 0;
  int64_t num_tokens = 0;
};
absl::StatusOr<TextDatasetStats> build_indexed_dataset_from_text(
    const std::string& text_path, const std::string& out_prefix,
    TokenDType dtype = TokenDType::kUInt8);

}  // namespace gdr::io
