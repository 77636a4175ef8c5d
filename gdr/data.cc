#include "gdr/data.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "io/file_util.h"
#include "io/indexed_dataset.h"

namespace gdr {
namespace {

// SplitMix64 (Steele, Lea, Flood 2014): tiny, well mixed, and fully specified, so the
// shuffle is identical everywhere.
uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// A token stream and, for an indexed dataset, where its document index says documents start.
struct TokenStream {
  std::vector<int64_t> tokens;
  std::vector<int64_t> index_starts;  // sorted; empty for the embedded corpus
};

// The token stream of `path` (embedded: a text file, one token per byte) or `prefix`
// (indexed: a Megatron dataset, its sequences in file order).
absl::StatusOr<TokenStream> read_tokens(DataSource source, const std::string& path,
                                        const std::string& prefix) {
  TokenStream stream;
  if (source == DataSource::kEmbedded) {
    absl::StatusOr<std::string> text = io::read_file(path);
    if (!text.ok()) return text.status();
    stream.tokens.reserve(text->size());
    for (unsigned char c : *text) stream.tokens.push_back(c);
    return stream;
  }
  absl::StatusOr<io::IndexedDataset> dataset = io::IndexedDataset::open(prefix);
  if (!dataset.ok()) return dataset.status();
  stream.tokens.reserve(dataset->num_tokens());
  // Token offset of every sequence, then of every document's first sequence (Note
  // [Document starts]); open() checked the document index is monotonic and ends at S.
  std::vector<int64_t> sequence_offsets;
  for (int64_t i = 0; i < dataset->num_sequences(); ++i) {
    sequence_offsets.push_back(static_cast<int64_t>(stream.tokens.size()));
    absl::StatusOr<std::vector<int64_t>> seq = dataset->sequence(i);
    if (!seq.ok()) return seq.status();
    stream.tokens.insert(stream.tokens.end(), seq->begin(), seq->end());
  }
  for (int64_t first_sequence : dataset->document_indices()) {
    if (first_sequence >= dataset->num_sequences()) continue;  // the closing index
    stream.index_starts.push_back(sequence_offsets[static_cast<size_t>(first_sequence)]);
  }
  return stream;
}

// Sorted, unique starts in [0, n), beginning with 0.
std::vector<int64_t> normalized_starts(std::vector<int64_t> starts, int64_t n) {
  starts.push_back(0);
  std::sort(starts.begin(), starts.end());
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  while (!starts.empty() && starts.back() >= n) starts.pop_back();
  return starts;
}

// The document starts of `stream` under `config` (Note [Document starts]); nullopt when
// document masking is off.
absl::StatusOr<std::optional<std::vector<int64_t>>> document_starts_of(
    const DataConfig& config, const std::string& name, const TokenStream& stream,
    const std::vector<int64_t>& eos_token_ids) {
  if (!config.document_masking) return std::optional<std::vector<int64_t>>();
  if (config.source == DataSource::kEmbedded && eos_token_ids.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name,
                     ": data.document_masking: the embedded corpus has no document index; set "
                     "model.eos_token_id to the token that ends a document"));
  }
  std::vector<int64_t> starts = document_starts_after_eos(stream.tokens, eos_token_ids);
  starts.insert(starts.end(), stream.index_starts.begin(), stream.index_starts.end());
  return std::optional<std::vector<int64_t>>(std::move(starts));
}

}  // namespace

TokenWindows::TokenWindows(std::vector<int64_t> tokens, int64_t seq_len, uint64_t seed)
    : tokens_(std::move(tokens)),
      seq_len_(seq_len),
      num_windows_((static_cast<int64_t>(tokens_.size()) - 1) / seq_len),
      seed_(seed) {}

absl::StatusOr<TokenWindows> TokenWindows::from_tokens(
    std::vector<int64_t> tokens, int64_t seq_len, uint64_t seed,
    std::optional<std::vector<int64_t>> document_starts) {
  if (seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.seq_len: expected >= 1 but got ", seq_len));
  }
  if (static_cast<int64_t>(tokens.size()) < seq_len + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data: the token stream has ", tokens.size(),
                     " tokens, fewer than one window of seq_len + 1 = ", seq_len + 1));
  }
  const int64_t n = static_cast<int64_t>(tokens.size());
  TokenWindows windows(std::move(tokens), seq_len, seed);
  if (document_starts.has_value()) {
    windows.has_document_starts_ = true;
    windows.document_starts_ = normalized_starts(std::move(*document_starts), n);
  }
  return windows;
}

std::vector<int64_t> document_starts_after_eos(const std::vector<int64_t>& tokens,
                                               const std::vector<int64_t>& eos_token_ids) {
  std::vector<int64_t> starts;
  if (eos_token_ids.empty()) return starts;
  for (size_t i = 0; i + 1 < tokens.size(); ++i) {
    if (std::find(eos_token_ids.begin(), eos_token_ids.end(), tokens[i]) != eos_token_ids.end()) {
      starts.push_back(static_cast<int64_t>(i) + 1);
    }
  }
  return starts;
}

namespace {

// Windows over `tokens`, an error naming `name` when there is not one window.
absl::StatusOr<TokenWindows> windows_named(const std::string& name, std::vector<int64_t> tokens,
                                           int64_t seq_len, uint64_t seed,
                                           std::optional<std::vector<int64_t>> document_starts) {
  absl::StatusOr<TokenWindows> windows =
      TokenWindows::from_tokens(std::move(tokens), seq_len, seed, std::move(document_starts));
  if (!windows.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", windows.status().message()));
  }
  return windows;
}

}  // namespace

absl::StatusOr<TokenWindows> TokenWindows::open(const DataConfig& config, uint64_t seed,
                                                const std::vector<int64_t>& eos_token_ids) {
  absl::StatusOr<DataSets> sets = open_data_sets(config, seed, eos_token_ids);
  if (!sets.ok()) return sets.status();
  return std::move(sets->train);
}

absl::StatusOr<DataSets> open_data_sets(const DataConfig& config, uint64_t seed,
                                        const std::vector<int64_t>& eos_token_ids) {
  const bool embedded = config.source == DataSource::kEmbedded;
  const std::string& name = embedded ? config.path : config.prefix;
  absl::StatusOr<TokenStream> stream = read_tokens(config.source, config.path, config.prefix);
  if (!stream.ok()) return stream.status();
  absl::StatusOr<std::optional<std::vector<int64_t>>> starts =
      document_starts_of(config, name, *stream, eos_token_ids);
  if (!starts.ok()) return starts.status();
  std::vector<int64_t>& tokens = stream->tokens;
  std::optional<TokenWindows> valid;
  if (config.valid_fraction > 0) {
    // Note [Held-out validation]: the last windows of the stream. The boundary token is
    // shared (the last training target is the first validation input), so no validation
    // target is ever a training target.
    const int64_t windows = (static_cast<int64_t>(tokens.size()) - 1) / config.seq_len;
    const int64_t held_out =
        static_cast<int64_t>(static_cast<double>(windows) * config.valid_fraction);
    if (held_out < 1 || held_out >= windows) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": data.valid_fraction ", config.valid_fraction, " of ", windows,
                       " windows holds out ", held_out,
                       "; expected at least one window for validation and "
                       "one for training"));
    }
    const int64_t cut = (windows - held_out) * config.seq_len;
    std::vector<int64_t> tail(tokens.begin() + cut, tokens.end());
    tokens.resize(static_cast<size_t>(cut + 1));
    // The tail's starts, shifted to its own positions (the training stream's are cut by
    // from_tokens at its end).
    std::optional<std::vector<int64_t>> tail_starts;
    if (starts->has_value()) {
      tail_starts.emplace();
      for (int64_t s : **starts) {
        if (s >= cut) tail_starts->push_back(s - cut);
      }
    }
    absl::StatusOr<TokenWindows> held =
        windows_named(name, std::move(tail), config.seq_len, 0, std::move(tail_starts));
    if (!held.ok()) return held.status();
    valid.emplace(std::move(*held));
  } else if (!config.valid_path.empty() || !config.valid_prefix.empty()) {
    const std::string& valid_name = embedded ? config.valid_path : config.valid_prefix;
    absl::StatusOr<TokenStream> valid_stream =
        read_tokens(config.source, config.valid_path, config.valid_prefix);
    if (!valid_stream.ok()) return valid_stream.status();
    absl::StatusOr<std::optional<std::vector<int64_t>>> valid_starts =
        document_starts_of(config, valid_name, *valid_stream, eos_token_ids);
    if (!valid_starts.ok()) return valid_starts.status();
    absl::StatusOr<TokenWindows> held = windows_named(valid_name, std::move(valid_stream->tokens),
                                                      config.seq_len, 0, std::move(*valid_starts));
    if (!held.ok()) return held.status();
    valid.emplace(std::move(*held));
  }
  absl::StatusOr<TokenWindows> train =
      windows_named(name, std::move(tokens), config.seq_len, seed, std::move(*starts));
  if (!train.ok()) return train.status();
  return DataSets{std::move(*train), std::move(valid)};
}

std::vector<int64_t> TokenWindows::window_document_starts(int64_t window) const {
  if (!has_document_starts_) return {0};
  const int64_t begin = window * seq_len_, end = begin + window_length();
  std::vector<int64_t> starts = {0};
  for (auto it = std::upper_bound(document_starts_.begin(), document_starts_.end(), begin);
       it != document_starts_.end() && *it < end; ++it) {
    starts.push_back(*it - begin);
  }
  return starts;
}

std::vector<int64_t> TokenWindows::windows_in_order(
    int64_t first, int64_t count, std::vector<std::vector<int64_t>>* document_starts) const {
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(count * window_length()));
  if (document_starts != nullptr) document_starts->clear();
  for (int64_t w = first; w < first + count; ++w) {
    const auto begin = tokens_.begin() + w * seq_len_;
    rows.insert(rows.end(), begin, begin + window_length());
    if (document_starts != nullptr) document_starts->push_back(window_document_starts(w));
  }
  return rows;
}

std::vector<int64_t> TokenWindows::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(num_windows_);
  for (int64_t i = 0; i < num_windows_; ++i) order[i] = i;
  uint64_t state = seed_ * 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(epoch);
  splitmix64(state);
  for (int64_t i = num_windows_ - 1; i > 0; --i) {
    // Multiply-shift maps 64 random bits to [0, i]; its bias is below 2^-40 here.
    const uint64_t r = splitmix64(state);
    const int64_t j = static_cast<int64_t>(
        static_cast<unsigned __int128>(r) * static_cast<uint64_t>(i + 1) >> 64);
    std::swap(order[i], order[j]);
  }
  return order;
}

const std::vector<int64_t>& TokenWindows::order_of_current_epoch() {
  if (cached_epoch_ != position_.epoch) {
    cached_order_ = epoch_order(position_.epoch);
    cached_epoch_ = position_.epoch;
  }
  return cached_order_;
}

std::vector<int64_t> TokenWindows::next_batch(int64_t batch_size,
                                              std::vector<std::vector<int64_t>>* document_starts) {
  std::vector<int64_t> batch;
  batch.reserve(batch_size * window_length());
  if (document_starts != nullptr) document_starts->clear();
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t window = order_of_current_epoch()[position_.index];
    const auto begin = tokens_.begin() + window * seq_len_;
    batch.insert(batch.end(), begin, begin + window_length());
    if (document_starts != nullptr) document_starts->push_back(window_document_starts(window));
    if (++position_.index == num_windows_) {
      position_.index = 0;
      ++position_.epoch;
    }
  }
  return batch;
}

absl::Status TokenWindows::set_position(const DataPosition& position) {
  if (position.epoch < 0 || position.index < 0 || position.index >= num_windows_) {
    return absl::InvalidArgumentError(
        absl::StrCat("data position {epoch ", position.epoch, ", index ", position.index,
                     "} is outside the data set (", num_windows_, " windows per epoch)"));
  }
  position_ = position;
  return absl::OkStatus();
}

}  // namespace gdr
