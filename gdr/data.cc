#include "gdr/data.h"

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

// The token stream of `path` (embedded: a text file, one token per byte) or `prefix`
// (indexed: a Megatron dataset, its sequences in file order).
absl::StatusOr<std::vector<int64_t>> read_tokens(DataSource source, const std::string& path,
                                                 const std::string& prefix) {
  if (source == DataSource::kEmbedded) {
    absl::StatusOr<std::string> text = io::read_file(path);
    if (!text.ok()) return text.status();
    std::vector<int64_t> tokens;
    tokens.reserve(text->size());
    for (unsigned char c : *text) tokens.push_back(c);
    return tokens;
  }
  absl::StatusOr<io::IndexedDataset> dataset = io::IndexedDataset::open(prefix);
  if (!dataset.ok()) return dataset.status();
  std::vector<int64_t> tokens;
  tokens.reserve(dataset->num_tokens());
  for (int64_t i = 0; i < dataset->num_sequences(); ++i) {
    absl::StatusOr<std::vector<int64_t>> seq = dataset->sequence(i);
    if (!seq.ok()) return seq.status();
    tokens.insert(tokens.end(), seq->begin(), seq->end());
  }
  return tokens;
}

}  // namespace

TokenWindows::TokenWindows(std::vector<int64_t> tokens, int64_t seq_len, uint64_t seed)
    : tokens_(std::move(tokens)),
      seq_len_(seq_len),
      num_windows_((static_cast<int64_t>(tokens_.size()) - 1) / seq_len),
      seed_(seed) {}

absl::StatusOr<TokenWindows> TokenWindows::from_tokens(std::vector<int64_t> tokens, int64_t seq_len,
                                                       uint64_t seed) {
  if (seq_len < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data.seq_len: expected >= 1 but got ", seq_len));
  }
  if (static_cast<int64_t>(tokens.size()) < seq_len + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("data: the token stream has ", tokens.size(),
                     " tokens, fewer than one window of seq_len + 1 = ", seq_len + 1));
  }
  return TokenWindows(std::move(tokens), seq_len, seed);
}

namespace {

// Windows over `tokens`, an error naming `name` when there is not one window.
absl::StatusOr<TokenWindows> windows_named(const std::string& name, std::vector<int64_t> tokens,
                                           int64_t seq_len, uint64_t seed) {
  absl::StatusOr<TokenWindows> windows =
      TokenWindows::from_tokens(std::move(tokens), seq_len, seed);
  if (!windows.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", windows.status().message()));
  }
  return windows;
}

}  // namespace

absl::StatusOr<TokenWindows> TokenWindows::open(const DataConfig& config, uint64_t seed) {
  absl::StatusOr<DataSets> sets = open_data_sets(config, seed);
  if (!sets.ok()) return sets.status();
  return std::move(sets->train);
}

absl::StatusOr<DataSets> open_data_sets(const DataConfig& config, uint64_t seed) {
  const bool embedded = config.source == DataSource::kEmbedded;
  const std::string& name = embedded ? config.path : config.prefix;
  absl::StatusOr<std::vector<int64_t>> tokens =
      read_tokens(config.source, config.path, config.prefix);
  if (!tokens.ok()) return tokens.status();
  std::optional<TokenWindows> valid;
  if (config.valid_fraction > 0) {
    // Note [Held-out validation]: the last windows of the stream. The boundary token is
    // shared (the last training target is the first validation input), so no validation
    // target is ever a training target.
    const int64_t windows = (static_cast<int64_t>(tokens->size()) - 1) / config.seq_len;
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
    std::vector<int64_t> tail(tokens->begin() + cut, tokens->end());
    tokens->resize(static_cast<size_t>(cut + 1));
    absl::StatusOr<TokenWindows> held = windows_named(name, std::move(tail), config.seq_len, 0);
    if (!held.ok()) return held.status();
    valid.emplace(std::move(*held));
  } else if (!config.valid_path.empty() || !config.valid_prefix.empty()) {
    const std::string& valid_name = embedded ? config.valid_path : config.valid_prefix;
    absl::StatusOr<std::vector<int64_t>> valid_tokens =
        read_tokens(config.source, config.valid_path, config.valid_prefix);
    if (!valid_tokens.ok()) return valid_tokens.status();
    absl::StatusOr<TokenWindows> held =
        windows_named(valid_name, std::move(*valid_tokens), config.seq_len, 0);
    if (!held.ok()) return held.status();
    valid.emplace(std::move(*held));
  }
  absl::StatusOr<TokenWindows> train =
      windows_named(name, std::move(*tokens), config.seq_len, seed);
  if (!train.ok()) return train.status();
  return DataSets{std::move(*train), std::move(valid)};
}

std::vector<int64_t> TokenWindows::windows_in_order(int64_t first, int64_t count) const {
  std::vector<int64_t> rows;
  rows.reserve(static_cast<size_t>(count * window_length()));
  for (int64_t w = first; w < first + count; ++w) {
    const auto begin = tokens_.begin() + w * seq_len_;
    rows.insert(rows.end(), begin, begin + window_length());
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

std::vector<int64_t> TokenWindows::next_batch(int64_t batch_size) {
  std::vector<int64_t> batch;
  batch.reserve(batch_size * window_length());
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t window = order_of_current_epoch()[position_.index];
    const auto begin = tokens_.begin() + window * seq_len_;
    batch.insert(batch.end(), begin, begin + window_length());
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
