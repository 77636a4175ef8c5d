#include "io/indexed_dataset.h"

#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the .idx/.bin formats are little-endian; this code copies bytes as they are");

namespace gdr::io {
namespace {

constexpr char kMagic[] = "MMIDIDX\x00\x00";  // 9 bytes; the literal's own NUL is not part of it
constexpr size_t kMagicBytes = 9;
constexpr uint64_t kVersion = 1;
// magic + version + dtype code + sequence count + document-index count
constexpr uint64_t kHeaderBytes = kMagicBytes + 8 + 1 + 8 + 8;

struct TokenRange {
  int64_t min;
  int64_t max;
};

TokenRange token_range(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::kUInt8: return {0, 255};
    case TokenDType::kInt8: return {-128, 127};
    case TokenDType::kInt16: return {-32768, 32767};
    case TokenDType::kInt32: return {INT32_MIN, INT32_MAX};
    case TokenDType::kUInt16: return {0, 65535};
    default: return {INT64_MIN, INT64_MAX};
  }
}

bool is_token_dtype(TokenDType dtype) {
  return dtype != TokenDType::kFloat32 && dtype != TokenDType::kFloat64;
}

bool is_known_code(uint8_t code) { return code >= 1 && code <= 8; }

template <typename T>
T load(const uint8_t* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));  // .bin offsets need not be aligned
  return value;
}

template <typename T>
void decode_as(const uint8_t* src, int64_t count, int64_t* dst) {
  for (int64_t i = 0; i < count; ++i) dst[i] = static_cast<int64_t>(load<T>(src + i * sizeof(T)));
}

void decode(TokenDType dtype, const uint8_t* src, int64_t count, int64_t* dst) {
  switch (dtype) {
    case TokenDType::kUInt8: return decode_as<uint8_t>(src, count, dst);
    case TokenDType::kInt8: return decode_as<int8_t>(src, count, dst);
    case TokenDType::kInt16: return decode_as<int16_t>(src, count, dst);
    case TokenDType::kInt32: return decode_as<int32_t>(src, count, dst);
    case TokenDType::kInt64: return decode_as<int64_t>(src, count, dst);
    case TokenDType::kUInt16: return decode_as<uint16_t>(src, count, dst);
    default: return;  // float dtypes are refused at open
  }
}

template <typename T>
void encode_as(absl::Span<const int64_t> tokens, uint8_t* dst) {
  for (size_t i = 0; i < tokens.size(); ++i) {
    const T value = static_cast<T>(tokens[i]);
    std::memcpy(dst + i * sizeof(T), &value, sizeof(T));
  }
}

void encode(TokenDType dtype, absl::Span<const int64_t> tokens, uint8_t* dst) {
  switch (dtype) {
    case TokenDType::kUInt8: return encode_as<uint8_t>(tokens, dst);
    case TokenDType::kInt8: return encode_as<int8_t>(tokens, dst);
    case TokenDType::kInt16: return encode_as<int16_t>(tokens, dst);
    case TokenDType::kInt32: return encode_as<int32_t>(tokens, dst);
    case TokenDType::kInt64: return encode_as<int64_t>(tokens, dst);
    case TokenDType::kUInt16: return encode_as<uint16_t>(tokens, dst);
    default: return;  // float dtypes are refused at create
  }
}

template <typename T>
void append_pod(std::string* out, const T& value) {
  out->append(reinterpret_cast<const char*>(&value), sizeof(T));
}

template <typename T>
void append_array(std::string* out, const std::vector<T>& values) {
  out->append(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T));
}

template <typename T>
std::vector<T> load_array(const uint8_t* p, uint64_t count) {
  std::vector<T> values(count);
  if (count > 0) std::memcpy(values.data(), p, count * sizeof(T));
  return values;
}

// 34 + 12 * S + 8 * D, or nullopt on overflow (a corrupt count must not wrap around).
std::optional<uint64_t> index_bytes_needed(uint64_t sequences, uint64_t documents) {
  uint64_t per_sequence, per_document, total;
  if (__builtin_mul_overflow(sequences, uint64_t{12}, &per_sequence)) return std::nullopt;
  if (__builtin_mul_overflow(documents, uint64_t{8}, &per_document)) return std::nullopt;
  if (__builtin_add_overflow(kHeaderBytes, per_sequence, &total)) return std::nullopt;
  if (__builtin_add_overflow(total, per_document, &total)) return std::nullopt;
  return total;
}

absl::Status malformed(const std::string& path, absl::string_view problem) {
  return absl::DataLossError(absl::StrCat(path, ": ", problem));
}

}  // namespace

int64_t token_dtype_size(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::kUInt8:
    case TokenDType::kInt8: return 1;
    case TokenDType::kInt16:
    case TokenDType::kUInt16: return 2;
    case TokenDType::kInt32:
    case TokenDType::kFloat32: return 4;
    case TokenDType::kInt64:
    case TokenDType::kFloat64: return 8;
  }
  return 0;
}

const char* token_dtype_name(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::kUInt8: return "uint8";
    case TokenDType::kInt8: return "int8";
    case TokenDType::kInt16: return "int16";
    case TokenDType::kInt32: return "int32";
    case TokenDType::kInt64: return "int64";
    case TokenDType::kFloat64: return "float64";
    case TokenDType::kFloat32: return "float32";
    case TokenDType::kUInt16: return "uint16";
  }
  return "unknown";
}

std::string idx_path_of(const std::string& path_prefix) { return path_prefix + ".idx"; }
std::string bin_path_of(const std::string& path_prefix) { return path_prefix + ".bin"; }

// ---------------------------------------------------------------------------- reading

absl::StatusOr<IndexedDataset> IndexedDataset::open(const std::string& path_prefix) {
  const std::string idx_path = idx_path_of(path_prefix);
  const std::string bin_path = bin_path_of(path_prefix);
  auto idx_or = MappedFile::open(idx_path);
  if (!idx_or.ok()) return idx_or.status();
  const MappedFile& idx = **idx_or;
  const uint8_t* p = idx.data();

  if (idx.size() < kHeaderBytes) {
    return malformed(idx_path, absl::StrCat("index is ", idx.size(), " bytes, shorter than its ",
                                            kHeaderBytes, "-byte header"));
  }
  if (std::memcmp(p, kMagic, kMagicBytes) != 0) {
    return malformed(
        idx_path,
        absl::StrCat(
            "bad magic: expected \"", absl::CHexEscape(absl::string_view(kMagic, kMagicBytes)),
            "\", got \"",
            absl::CHexEscape(absl::string_view(reinterpret_cast<const char*>(p), kMagicBytes)),
            "\""));
  }
  const uint64_t version = load<uint64_t>(p + 9);
  if (version != kVersion) {
    return malformed(idx_path,
                     absl::StrCat("unsupported version ", version, " (expected ", kVersion, ")"));
  }
  const uint8_t code = p[17];
  if (!is_known_code(code)) {
    return malformed(idx_path, absl::StrCat("unknown dtype code ", code, " (expected 1..8)"));
  }
  const auto dtype = static_cast<TokenDType>(code);
  if (!is_token_dtype(dtype)) {
    return malformed(idx_path, absl::StrCat("dtype code ", code, " (", token_dtype_name(dtype),
                                            ") is not a token dtype"));
  }
  const uint64_t sequence_count = load<uint64_t>(p + 18);
  const uint64_t document_count = load<uint64_t>(p + 26);
  const std::string counts =
      absl::StrCat("(", sequence_count, " sequences, ", document_count, " document indices)");
  std::optional<uint64_t> needed = index_bytes_needed(sequence_count, document_count);
  if (!needed.has_value() || idx.size() < *needed) {
    return malformed(
        idx_path,
        absl::StrCat("index is ", idx.size(), " bytes but its counts ", counts, " need ",
                     needed.has_value() ? absl::StrCat(*needed) : std::string("more than 2^64")));
  }
  // Multimodal datasets append one int8 mode per sequence; anything else is corruption.
  const uint64_t trailing = idx.size() - *needed;
  if (trailing != 0 && trailing != sequence_count) {
    return malformed(idx_path, absl::StrCat("index has ", trailing,
                                            " bytes after the document indices; its counts ",
                                            counts, " allow 0 or ", sequence_count));
  }

  IndexedDataset ds;
  ds.path_prefix_ = path_prefix;
  ds.dtype_ = dtype;
  const uint8_t* cursor = p + kHeaderBytes;
  ds.sequence_lengths_ = load_array<int32_t>(cursor, sequence_count);
  cursor += sequence_count * sizeof(int32_t);
  ds.sequence_pointers_ = load_array<int64_t>(cursor, sequence_count);
  cursor += sequence_count * sizeof(int64_t);
  ds.document_indices_ = load_array<int64_t>(cursor, document_count);

  const std::vector<int64_t>& docs = ds.document_indices_;
  if (docs.empty()) {
    return malformed(idx_path, "no document indices (expected at least the leading 0)");
  }
  if (docs[0] != 0) {
    return malformed(idx_path, absl::StrCat("document indices must start at 0, got ", docs[0]));
  }
  for (size_t k = 1; k < docs.size(); ++k) {
    if (docs[k] < docs[k - 1]) {
      return malformed(idx_path, absl::StrCat("document indices are not monotonic: index ", k,
                                              " is ", docs[k], " after ", docs[k - 1]));
    }
  }
  if (static_cast<uint64_t>(docs.back()) != sequence_count) {
    return malformed(idx_path, absl::StrCat("last document index is ", docs.back(),
                                            ", expected the sequence count ", sequence_count));
  }

  auto bin = MappedFile::open(bin_path);
  if (!bin.ok()) return bin.status();
  ds.bin_ = std::move(*bin);
  const uint64_t bin_size = ds.bin_->size();
  const uint64_t item = static_cast<uint64_t>(token_dtype_size(dtype));
  for (uint64_t i = 0; i < sequence_count; ++i) {
    const int32_t length = ds.sequence_lengths_[i];
    const int64_t pointer = ds.sequence_pointers_[i];
    if (length < 0) {
      return malformed(idx_path, absl::StrCat("sequence ", i, " has negative length ", length));
    }
    if (pointer < 0) {
      return malformed(idx_path, absl::StrCat("sequence ", i, " has negative pointer ", pointer));
    }
    // pointer < 2^63 and length * item < 2^34, so the sum cannot wrap in 64 bits.
    const uint64_t end = static_cast<uint64_t>(pointer) + static_cast<uint64_t>(length) * item;
    if (end > bin_size) {
      return malformed(idx_path,
                       absl::StrCat("sequence ", i, " (", length, " ", token_dtype_name(dtype),
                                    " tokens at byte ", pointer, ") ends at byte ", end,
                                    ", past the end of ", bin_path, " (", bin_size, " bytes)"));
    }
    ds.num_tokens_ += length;
  }
  return ds;
}

absl::StatusOr<std::vector<int64_t>> IndexedDataset::get(int64_t index, int64_t offset,
                                                         std::optional<int64_t> length) const {
  if (index < 0 || index >= num_sequences()) {
    return absl::OutOfRangeError(absl::StrCat(path_prefix_, ": sequence index ", index,
                                              " out of range [0, ", num_sequences(), ")"));
  }
  const int64_t full = sequence_lengths_[index];
  const int64_t count = length.has_value() ? *length : full - offset;
  if (offset < 0 || count < 0 || offset > full || count > full - offset) {
    return absl::OutOfRangeError(absl::StrCat(path_prefix_, ": tokens [", offset, ", ",
                                              offset + count, ") out of range for sequence ", index,
                                              " of length ", full));
  }
  std::vector<int64_t> tokens(count);
  if (count == 0) return tokens;
  const int64_t item = token_dtype_size(dtype_);
  decode(dtype_, bin_->data() + sequence_pointers_[index] + offset * item, count, tokens.data());
  return tokens;
}

// ---------------------------------------------------------------------------- writing

IndexedDatasetBuilder::IndexedDatasetBuilder(std::string path_prefix, TokenDType dtype,
                                             AtomicFileWriter bin)
    : path_prefix_(std::move(path_prefix)), dtype_(dtype), bin_(std::move(bin)) {}

absl::StatusOr<IndexedDatasetBuilder> IndexedDatasetBuilder::create(const std::string& path_prefix,
                                                                    TokenDType dtype) {
  if (!is_known_code(static_cast<uint8_t>(dtype)) || !is_token_dtype(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path_prefix, ": dtype code ", static_cast<int>(dtype), " is not a token dtype"));
  }
  auto bin = AtomicFileWriter::create(bin_path_of(path_prefix));
  if (!bin.ok()) return bin.status();
  return IndexedDatasetBuilder(path_prefix, dtype, std::move(*bin));
}

absl::Status IndexedDatasetBuilder::add_item(absl::Span<const int64_t> tokens) {
  if (finalized_) {
    return absl::FailedPreconditionError(absl::StrCat(path_prefix_, ": add_item after finalize"));
  }
  if (tokens.size() > static_cast<size_t>(INT32_MAX)) {
    return absl::InvalidArgumentError(absl::StrCat(path_prefix_, ": sequence of ", tokens.size(),
                                                   " tokens is longer than the int32 length "
                                                   "the .idx format stores"));
  }
  const TokenRange range = token_range(dtype_);
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < range.min || tokens[i] > range.max) {
      return absl::InvalidArgumentError(
          absl::StrCat(path_prefix_, ": token ", tokens[i], " at position ", i, " of sequence ",
                       sequence_lengths_.size(), " does not fit ", token_dtype_name(dtype_), " [",
                       range.min, ", ", range.max, "]"));
    }
  }
  scratch_.resize(tokens.size() * token_dtype_size(dtype_));
  encode(dtype_, tokens, scratch_.data());
  if (absl::Status s = bin_.append(scratch_.data(), scratch_.size()); !s.ok()) return s;
  sequence_lengths_.push_back(static_cast<int32_t>(tokens.size()));
  return absl::OkStatus();
}

void IndexedDatasetBuilder::end_document() {
  document_indices_.push_back(static_cast<int64_t>(sequence_lengths_.size()));
}

absl::Status IndexedDatasetBuilder::finalize() {
  if (finalized_) {
    return absl::FailedPreconditionError(absl::StrCat(path_prefix_, ": finalized twice"));
  }
  finalized_ = true;
  if (document_indices_.back() != static_cast<int64_t>(sequence_lengths_.size())) end_document();

  // Pointers are the running byte offsets, as Megatron's _IndexWriter computes them.
  std::vector<int64_t> pointers;
  pointers.reserve(sequence_lengths_.size());
  int64_t offset = 0;
  for (int32_t length : sequence_lengths_) {
    pointers.push_back(offset);
    offset += static_cast<int64_t>(length) * token_dtype_size(dtype_);
  }

  std::string idx(kMagic, kMagicBytes);
  append_pod(&idx, kVersion);
  append_pod(&idx, static_cast<uint8_t>(dtype_));
  append_pod(&idx, static_cast<uint64_t>(sequence_lengths_.size()));
  append_pod(&idx, static_cast<uint64_t>(document_indices_.size()));
  append_array(&idx, sequence_lengths_);
  append_array(&idx, pointers);
  append_array(&idx, document_indices_);

  // The .bin first: a reader that finds the new .idx must find the .bin it describes.
  if (absl::Status s = bin_.commit(); !s.ok()) return s;
  return write_file_atomically(idx_path_of(path_prefix_), idx);
}

// ------------------------------------------------------------------------- from text

absl::StatusOr<TextDatasetStats> build_indexed_dataset_from_text(const std::string& text_path,
                                                                 const std::string& out_prefix,
                                                                 TokenDType dtype) {
  if (dtype != TokenDType::kUInt8 && dtype != TokenDType::kUInt16) {
    return absl::InvalidArgumentError(absl::StrCat(out_prefix,
                                                   ": byte-level tokens need dtype "
                                                   "uint8 or uint16, got ",
                                                   token_dtype_name(dtype)));
  }
  auto text = read_file(text_path);
  if (!text.ok()) return text.status();
  auto builder = IndexedDatasetBuilder::create(out_prefix, dtype);
  if (!builder.ok()) return builder.status();

  TextDatasetStats stats;
  std::vector<int64_t> paragraph;
  auto flush = [&]() -> absl::Status {
    if (paragraph.empty()) return absl::OkStatus();
    if (absl::Status s = builder->add_item(paragraph); !s.ok()) return s;
    builder->end_document();
    stats.num_documents += 1;
    stats.num_tokens += static_cast<int64_t>(paragraph.size());
    paragraph.clear();
    return absl::OkStatus();
  };

  const std::string& s = *text;
  size_t begin = 0;
  while (begin < s.size()) {
    size_t end = s.find('\n', begin);
    if (end == std::string::npos) end = s.size();
    const absl::string_view line(s.data() + begin, end - begin);
    const bool blank = line.find_first_not_of(" \t\r\f\v") == absl::string_view::npos;
    if (blank) {
      if (absl::Status st = flush(); !st.ok()) return st;
    } else {
      for (char c : line) paragraph.push_back(static_cast<unsigned char>(c));
      paragraph.push_back('\n');
    }
    begin = end + 1;
  }
  if (absl::Status st = flush(); !st.ok()) return st;
  if (absl::Status st = builder->finalize(); !st.ok()) return st;
  return stats;
}

}  // namespace gdr::io
