#include "io/safetensors.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <system_error>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "io/file_util.h"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian data; this code copies bytes as they are");

namespace gdr::io {
namespace {

using ordered_json = nlohmann::ordered_json;
using json = nlohmann::json;

// The reference implementation refuses headers above this size; so do we, which also keeps
// a corrupt length from making us allocate gigabytes.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr const char* kMetadataKey = "__metadata__";
constexpr const char* kIndexFileName = "model.safetensors.index.json";
constexpr const char* kSingleFileName = "model.safetensors";

struct DTypeInfo {
  const char* name;
  at::ScalarType type;
  uint64_t size;
};

constexpr DTypeInfo kDTypes[] = {
    {"F64", at::kDouble, 8},    {"F32", at::kFloat, 4}, {"F16", at::kHalf, 2},
    {"BF16", at::kBFloat16, 2}, {"I64", at::kLong, 8},  {"I32", at::kInt, 4},
    {"I16", at::kShort, 2},     {"I8", at::kChar, 1},   {"U8", at::kByte, 1},
    {"BOOL", at::kBool, 1},
};

std::string supported_dtype_list() {
  std::vector<std::string> names;
  for (const DTypeInfo& d : kDTypes) names.emplace_back(d.name);
  return absl::StrJoin(names, ", ");
}

const DTypeInfo* find_dtype(at::ScalarType type) {
  for (const DTypeInfo& d : kDTypes) {
    if (d.type == type) return &d;
  }
  return nullptr;
}

const DTypeInfo* find_dtype(const std::string& name) {
  for (const DTypeInfo& d : kDTypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

std::string dtype_display_name(at::ScalarType type) {
  const DTypeInfo* d = find_dtype(type);
  return d != nullptr ? std::string(d->name) : std::string(c10::toString(type));
}

std::string shape_string(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// numel * element size, or nullopt on overflow (a corrupt shape must not wrap around and
// pass the size check).
std::optional<uint64_t> byte_size(const std::vector<int64_t>& shape, uint64_t element_size) {
  uint64_t total = element_size;
  for (int64_t dim : shape) {
    if (__builtin_mul_overflow(total, static_cast<uint64_t>(dim), &total)) return std::nullopt;
  }
  return total;
}

const char* json_kind(const ordered_json& value) { return value.type_name(); }

// ------------------------------------------------------------------------- header parsing

absl::Status malformed(const std::string& path, absl::string_view problem) {
  return absl::DataLossError(absl::StrCat(path, ": ", problem));
}

// Parses the header JSON, rejecting duplicate keys at any depth: nlohmann would silently
// keep the last one, and two entries for one tensor name must not pass unnoticed.
absl::StatusOr<ordered_json> parse_header_json(const std::string& path, const std::string& text) {
  std::vector<std::set<std::string>> keys_per_object;
  std::string duplicate;
  bool duplicate_is_tensor = false;
  auto callback = [&](int /*depth*/, nlohmann::json::parse_event_t event, ordered_json& parsed) {
    using E = nlohmann::json::parse_event_t;
    if (event == E::object_start) keys_per_object.emplace_back();
    if (event == E::object_end) keys_per_object.pop_back();
    if (event == E::key && duplicate.empty()) {
      const std::string& key = parsed.get_ref<const std::string&>();
      if (!keys_per_object.back().insert(key).second) {
        duplicate = key;
        duplicate_is_tensor = keys_per_object.size() == 1;
      }
    }
    return true;
  };
  ordered_json header;
  try {
    header = ordered_json::parse(text, callback);
  } catch (const ordered_json::parse_error& e) {
    return malformed(path, absl::StrCat("header is not valid JSON (parse error at byte ", e.byte,
                                        " of the header)"));
  } catch (const nlohmann::json::exception& e) {
    // Not a syntax error but a value the parser refuses, e.g. a number that overflows a
    // double (out_of_range 406): still the file's fault, never an escaping exception.
    return malformed(path, absl::StrCat("header is not valid JSON (", e.what(), ")"));
  }
  if (!duplicate.empty()) {
    return malformed(path, duplicate_is_tensor
                               ? absl::StrCat("duplicate tensor name '", duplicate, "'")
                               : absl::StrCat("duplicate key '", duplicate, "' in header"));
  }
  if (!header.is_object()) {
    return malformed(path,
                     absl::StrCat("header is not a JSON object (got ", json_kind(header), ")"));
  }
  return header;
}

absl::StatusOr<SafetensorsMetadata> parse_metadata(const std::string& path,
                                                   const ordered_json& value) {
  if (!value.is_object()) {
    return malformed(path,
                     absl::StrCat("\"__metadata__\" must be an object, got ", json_kind(value)));
  }
  SafetensorsMetadata metadata;
  for (const auto& [key, item] : value.items()) {
    if (!item.is_string()) {
      return malformed(path, absl::StrCat("\"__metadata__\" value for key '", key,
                                          "' must be a string, got ", json_kind(item)));
    }
    metadata[key] = item.get<std::string>();
  }
  return metadata;
}

absl::StatusOr<SafetensorsEntry> parse_entry(const std::string& path, const std::string& name,
                                             const ordered_json& value) {
  auto bad = [&](absl::string_view problem) {
    return malformed(path, absl::StrCat("tensor '", name, "': ", problem));
  };
  if (!value.is_object())
    return bad(absl::StrCat("entry must be an object, got ", json_kind(value)));

  SafetensorsEntry entry;
  entry.name = name;

  auto dtype_it = value.find("dtype");
  if (dtype_it == value.end() || !dtype_it->is_string()) {
    return bad("\"dtype\" is missing or not a string");
  }
  const std::string dtype_name = dtype_it->get<std::string>();
  const DTypeInfo* dtype = find_dtype(dtype_name);
  if (dtype == nullptr) {
    return bad(
        absl::StrCat("unknown dtype '", dtype_name, "' (supported: ", supported_dtype_list(), ")"));
  }
  entry.spec.dtype = dtype->type;

  auto shape_it = value.find("shape");
  if (shape_it == value.end() || !shape_it->is_array()) {
    return bad("\"shape\" is missing or not an array");
  }
  for (const ordered_json& dim : *shape_it) {
    if (!dim.is_number_integer()) {
      return bad(absl::StrCat("shape ", shape_it->dump(), " has a non-integer dimension"));
    }
    if (dim.is_number_unsigned() && dim.get<uint64_t>() > uint64_t{INT64_MAX}) {
      return bad(absl::StrCat("shape ", shape_it->dump(), " has a dimension too large"));
    }
    entry.spec.shape.push_back(dim.get<int64_t>());
  }
  for (int64_t dim : entry.spec.shape) {
    if (dim < 0) {
      return bad(
          absl::StrCat("shape ", shape_string(entry.spec.shape), " has a negative dimension"));
    }
  }

  auto offsets_it = value.find("data_offsets");
  if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
      !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned()) {
    return bad(
        absl::StrCat("\"data_offsets\" must be [begin, end] with non-negative integers, got ",
                     offsets_it == value.end() ? "nothing" : offsets_it->dump()));
  }
  entry.data_begin = (*offsets_it)[0].get<uint64_t>();
  entry.data_end = (*offsets_it)[1].get<uint64_t>();
  if (entry.data_end < entry.data_begin) {
    return bad(absl::StrCat("data_offsets [", entry.data_begin, ", ", entry.data_end,
                            "] end before they begin"));
  }

  std::optional<uint64_t> needed = byte_size(entry.spec.shape, dtype->size);
  if (!needed.has_value()) {
    return bad(absl::StrCat("shape ", shape_string(entry.spec.shape), " overflows 64 bits"));
  }
  const uint64_t held = entry.data_end - entry.data_begin;
  if (held != *needed) {
    return bad(absl::StrCat("data_offsets [", entry.data_begin, ", ", entry.data_end, "] hold ",
                            held, " bytes but ", describe_spec(entry.spec), " needs ", *needed));
  }
  return entry;
}

// The entries, sorted by offset, must tile [0, data_size) exactly: this is what the
// reference implementation enforces, and it rules out overlapping (aliased) tensors, gaps
// that hide stray bytes, and truncated files.
absl::Status check_layout(const std::string& path, const std::vector<SafetensorsEntry>& entries,
                          uint64_t data_size) {
  uint64_t covered = 0;
  const SafetensorsEntry* previous = nullptr;
  for (const SafetensorsEntry& e : entries) {
    if (e.data_end > data_size) {
      return malformed(path, absl::StrCat("tensor '", e.name, "': data_offsets [", e.data_begin,
                                          ", ", e.data_end, "] run past the end of the ", data_size,
                                          "-byte data buffer"));
    }
    if (e.data_begin < covered) {
      return malformed(path,
                       absl::StrCat("tensor '", e.name, "': data_offsets [", e.data_begin, ", ",
                                    e.data_end, "] overlap tensor '", previous->name, "' [",
                                    previous->data_begin, ", ", previous->data_end, "]"));
    }
    if (e.data_begin > covered) {
      return malformed(path, absl::StrCat("bytes [", covered, ", ", e.data_begin,
                                          ") of the data buffer belong to no tensor"));
    }
    covered = e.data_end;
    previous = &e;
  }
  if (covered != data_size) {
    return malformed(path, absl::StrCat("bytes [", covered, ", ", data_size,
                                        ") of the data buffer belong to no tensor"));
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsHeader> parse_header(const ReadOnlyFile& file) {
  const std::string& path = file.path();
  if (file.size() < 8) {
    return malformed(path, absl::StrCat("file is ", file.size(),
                                        " bytes, too short for the 8-byte header length"));
  }
  uint8_t length_bytes[8];
  if (absl::Status s = file.read_at(0, length_bytes, 8); !s.ok()) return s;
  uint64_t header_length = 0;
  std::memcpy(&header_length, length_bytes, 8);  // little-endian host, see static_assert
  if (header_length > kMaxHeaderBytes) {
    return malformed(path, absl::StrCat("header length ", header_length, " exceeds the limit of ",
                                        kMaxHeaderBytes, " bytes"));
  }
  if (header_length > file.size() - 8) {
    return malformed(
        path, absl::StrCat("header length ", header_length, " runs past the end of the file (",
                           file.size(), " bytes, so at most ", file.size() - 8, ")"));
  }
  std::string text(header_length, '\0');
  if (absl::Status s = file.read_at(8, text.data(), text.size()); !s.ok()) return s;

  auto parsed = parse_header_json(path, text);
  if (!parsed.ok()) return parsed.status();

  SafetensorsHeader header;
  header.data_start = 8 + header_length;
  for (const auto& [key, value] : parsed->items()) {
    if (key == kMetadataKey) {
      auto metadata = parse_metadata(path, value);
      if (!metadata.ok()) return metadata.status();
      header.metadata = std::move(*metadata);
      continue;
    }
    auto entry = parse_entry(path, key, value);
    if (!entry.ok()) return entry.status();
    header.entries.push_back(std::move(*entry));
  }
  // Stable on ties so zero-sized tensors at one offset keep their header order.
  std::stable_sort(header.entries.begin(), header.entries.end(),
                   [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
                     return std::tie(a.data_begin, a.data_end) < std::tie(b.data_begin, b.data_end);
                   });
  if (absl::Status s = check_layout(path, header.entries, file.size() - header.data_start);
      !s.ok()) {
    return s;
  }
  return header;
}

absl::StatusOr<NamedTensors> read_tensors(const ReadOnlyFile& file,
                                          const SafetensorsHeader& header) {
  NamedTensors tensors;
  tensors.reserve(header.entries.size());
  for (const SafetensorsEntry& e : header.entries) {
    at::Tensor t = at::empty(e.spec.shape, at::TensorOptions().dtype(e.spec.dtype));
    const uint64_t nbytes = e.data_end - e.data_begin;
    if (nbytes > 0) {
      if (absl::Status s = file.read_at(header.data_start + e.data_begin, t.data_ptr(), nbytes);
          !s.ok()) {
        return s;
      }
    }
    tensors.emplace_back(e.name, std::move(t));
  }
  return tensors;
}

// ------------------------------------------------------------------------------- writing

// Checks the writer's input; `where` names the destination in messages.
absl::Status check_tensors_to_write(const std::string& where, const NamedTensors& tensors) {
  std::unordered_map<std::string, size_t> seen;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, tensor] = tensors[i];
    auto bad = [&](absl::string_view problem) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": ", problem));
    };
    if (name.empty()) return bad(absl::StrCat("tensor #", i, " has an empty name"));
    if (name == kMetadataKey) {
      return bad(absl::StrCat("tensor #", i, " uses the reserved name \"__metadata__\""));
    }
    auto [it, inserted] = seen.emplace(name, i);
    if (!inserted) {
      return bad(absl::StrCat("duplicate tensor name '", name, "' (entries #", it->second, " and #",
                              i, ")"));
    }
    if (!tensor.defined()) return bad(absl::StrCat("tensor '", name, "' is undefined"));
    if (tensor.layout() != at::kStrided) {
      return bad(absl::StrCat("tensor '", name, "' has layout ", c10::str(tensor.layout()),
                              "; only strided tensors can be stored"));
    }
    if (find_dtype(tensor.scalar_type()) == nullptr) {
      return bad(absl::StrCat("tensor '", name, "' has dtype ", c10::toString(tensor.scalar_type()),
                              ", which is not stored (supported: ", supported_dtype_list(), ")"));
    }
  }
  return absl::OkStatus();
}

uint64_t tensor_bytes(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * find_dtype(t.scalar_type())->size;
}

// Header text for `tensors` laid out back to back, padded with spaces so that the data
// buffer starts 8-byte aligned (8 + length is a multiple of 8).
std::string build_header(const NamedTensors& tensors, const SafetensorsMetadata& metadata) {
  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header[kMetadataKey] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    const uint64_t nbytes = tensor_bytes(tensor);
    header[name] = ordered_json{{"dtype", find_dtype(tensor.scalar_type())->name},
                                {"shape", tensor.sizes().vec()},
                                {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

absl::Status write_checked(const std::string& path, const NamedTensors& tensors,
                           const SafetensorsMetadata& metadata) {
  const std::string header = build_header(tensors, metadata);
  auto writer = AtomicFileWriter::create(path);
  if (!writer.ok()) return writer.status();
  const uint64_t header_length = header.size();
  if (absl::Status s = writer->append(&header_length, 8); !s.ok()) return s;
  if (absl::Status s = writer->append(header); !s.ok()) return s;
  for (const auto& [name, tensor] : tensors) {
    // One tensor at a time, so a GPU model is never copied to the host all at once.
    at::Tensor host = tensor.cpu().contiguous();
    const uint64_t nbytes = tensor_bytes(host);
    if (nbytes == 0) continue;
    if (absl::Status s = writer->append(host.data_ptr(), nbytes); !s.ok()) return s;
  }
  return writer->commit();
}

// --------------------------------------------------------------------------------- shards

std::string metadata_value_text(const json& value) {
  return value.is_string() ? value.get<std::string>() : value.dump();
}

bool is_directory(const std::string& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec);
}

bool exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}

}  // namespace

// ---------------------------------------------------------------------------- public API

const at::Tensor* SafetensorsContents::find(const std::string& name) const {
  for (const auto& [n, t] : tensors) {
    if (n == name) return &t;
  }
  return nullptr;
}

absl::StatusOr<std::string> safetensors_dtype_name(at::ScalarType dtype) {
  const DTypeInfo* d = find_dtype(dtype);
  if (d == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("dtype ", c10::toString(dtype),
                     " has no safetensors name here (supported: ", supported_dtype_list(), ")"));
  }
  return std::string(d->name);
}

absl::StatusOr<at::ScalarType> scalar_type_from_safetensors_dtype(const std::string& name) {
  const DTypeInfo* d = find_dtype(name);
  if (d == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("unknown safetensors dtype '", name,
                                                   "' (supported: ", supported_dtype_list(), ")"));
  }
  return d->type;
}

absl::Status write_safetensors(const std::string& path, const NamedTensors& tensors,
                               const SafetensorsMetadata& metadata) {
  if (absl::Status s = check_tensors_to_write(path, tensors); !s.ok()) return s;
  return write_checked(path, tensors, metadata);
}

absl::StatusOr<SafetensorsHeader> read_safetensors_header(const std::string& path) {
  auto file = ReadOnlyFile::open(path);
  if (!file.ok()) return file.status();
  return parse_header(*file);
}

absl::StatusOr<SafetensorsContents> read_safetensors(const std::string& path) {
  auto file = ReadOnlyFile::open(path);
  if (!file.ok()) return file.status();
  auto header = parse_header(*file);
  if (!header.ok()) return header.status();
  auto tensors = read_tensors(*file, *header);
  if (!tensors.ok()) return tensors.status();
  return SafetensorsContents{std::move(*tensors), std::move(header->metadata)};
}

absl::Status write_safetensors_sharded(const std::string& dir, const NamedTensors& tensors,
                                       int64_t max_shard_bytes,
                                       const SafetensorsMetadata& metadata) {
  if (max_shard_bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": max_shard_bytes must be positive, got ", max_shard_bytes));
  }
  if (absl::Status s = check_tensors_to_write(dir, tensors); !s.ok()) return s;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    return absl::InternalError(absl::StrCat(dir, ": cannot create directory: ", ec.message()));
  }

  // Greedy packing in the given order, as HF's shard_checkpoint does.
  std::vector<NamedTensors> shards;
  uint64_t shard_bytes = 0;
  uint64_t total_bytes = 0;
  for (const auto& named : tensors) {
    const uint64_t nbytes = tensor_bytes(named.second);
    if (shards.empty() ||
        (!shards.back().empty() && shard_bytes + nbytes > static_cast<uint64_t>(max_shard_bytes))) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(named);
    shard_bytes += nbytes;
    total_bytes += nbytes;
  }
  if (shards.empty()) shards.emplace_back();  // an empty checkpoint is still one shard

  json weight_map = json::object();
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string file_name =
        absl::StrFormat("model-%05d-of-%05d.safetensors", k + 1, shards.size());
    if (absl::Status s = write_checked(join_path(dir, file_name), shards[k], metadata); !s.ok()) {
      return s;
    }
    for (const auto& named : shards[k]) weight_map[named.first] = file_name;
  }

  // HF writes the index with sorted keys and a 2-space indent; nlohmann::json sorts keys.
  json index_metadata = json::object();
  for (const auto& [k, v] : metadata) index_metadata[k] = v;
  index_metadata["total_size"] = total_bytes;
  json index = {{"metadata", std::move(index_metadata)}, {"weight_map", std::move(weight_map)}};
  return write_file_atomically(join_path(dir, kIndexFileName), index.dump(2) + "\n");
}

absl::StatusOr<SafetensorsContents> read_safetensors_sharded(const std::string& dir_or_index_path) {
  std::string index_path = dir_or_index_path;
  const std::string suffix = ".safetensors";
  if (index_path.size() >= suffix.size() &&
      index_path.compare(index_path.size() - suffix.size(), suffix.size(), suffix) == 0) {
    return read_safetensors(index_path);  // a plain file was named: nothing to assemble
  }
  if (is_directory(dir_or_index_path)) {
    index_path = join_path(dir_or_index_path, kIndexFileName);
    if (!exists(index_path)) {
      const std::string single = join_path(dir_or_index_path, kSingleFileName);
      if (exists(single)) return read_safetensors(single);
      return absl::NotFoundError(absl::StrCat(dir_or_index_path, ": neither ", kIndexFileName,
                                              " nor ", kSingleFileName, " found"));
    }
  }
  auto text = read_file(index_path);
  if (!text.ok()) return text.status();
  auto bad = [&](absl::string_view problem) {
    return absl::DataLossError(absl::StrCat(index_path, ": ", problem));
  };

  json index = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded()) return bad("index is not valid JSON");
  if (!index.is_object()) return bad("index is not a JSON object");
  auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object()) {
    return bad("\"weight_map\" is missing or not an object");
  }

  SafetensorsMetadata metadata;
  if (auto meta_it = index.find("metadata"); meta_it != index.end() && !meta_it->is_null()) {
    if (!meta_it->is_object()) return bad("\"metadata\" is not an object");
    for (const auto& [k, v] : meta_it->items()) metadata[k] = metadata_value_text(v);
  }

  // shard file -> names the index puts there; std::map sorts the shards by file name.
  std::map<std::string, std::set<std::string>> names_per_shard;
  std::unordered_map<std::string, std::string> shard_of;
  for (const auto& [name, file] : map_it->items()) {
    if (!file.is_string()) {
      return bad(absl::StrCat("weight_map entry for tensor '", name, "' is not a string"));
    }
    const std::string file_name = file.get<std::string>();
    // Shards live next to the index; refusing paths keeps a crafted index from reading
    // files elsewhere.
    if (file_name.empty() || file_name.find('/') != std::string::npos || file_name == "." ||
        file_name == "..") {
      return bad(
          absl::StrCat("shard '", file_name, "' for tensor '", name, "' is not a plain file name"));
    }
    names_per_shard[file_name].insert(name);
    shard_of[name] = file_name;
  }

  const std::string dir = dirname_of(index_path);
  SafetensorsContents contents;
  contents.metadata = std::move(metadata);
  for (const auto& [file_name, names] : names_per_shard) {
    const std::string shard_path = join_path(dir, file_name);
    if (!exists(shard_path)) {
      return absl::NotFoundError(absl::StrCat(index_path, ": shard '", file_name, "' (for tensor '",
                                              *names.begin(), "') does not exist"));
    }
    auto file = ReadOnlyFile::open(shard_path);
    if (!file.ok()) return file.status();
    auto header = parse_header(*file);
    if (!header.ok()) return header.status();

    std::unordered_set<std::string> present;
    for (const SafetensorsEntry& e : header->entries) {
      present.insert(e.name);
      auto it = shard_of.find(e.name);
      if (it == shard_of.end()) {
        return bad(absl::StrCat("shard '", file_name, "' holds tensor '", e.name,
                                "', which the index does not list"));
      }
      if (it->second != file_name) {
        return bad(absl::StrCat("shard '", file_name, "' holds tensor '", e.name,
                                "', which the index puts in shard '", it->second, "'"));
      }
    }
    for (const std::string& name : names) {
      if (present.count(name) == 0) {
        return bad(absl::StrCat("tensor '", name, "' is mapped to shard '", file_name,
                                "', which does not hold it"));
      }
    }
    auto tensors = read_tensors(*file, *header);
    if (!tensors.ok()) return tensors.status();
    for (auto& named : *tensors) contents.tensors.push_back(std::move(named));
  }
  return contents;
}

// ---------------------------------------------------------------------- comparing sets

std::string describe_spec(const TensorSpec& spec) {
  return absl::StrCat(dtype_display_name(spec.dtype), " ", shape_string(spec.shape));
}

TensorSpec spec_of(const at::Tensor& tensor) {
  return TensorSpec{tensor.scalar_type(), tensor.sizes().vec()};
}

std::map<std::string, TensorSpec> specs_of(const NamedTensors& tensors) {
  std::map<std::string, TensorSpec> specs;
  for (const auto& [name, tensor] : tensors) specs[name] = spec_of(tensor);
  return specs;
}

TensorSetDiff diff_tensor_specs(const std::map<std::string, TensorSpec>& actual,
                                const std::map<std::string, TensorSpec>& expected) {
  TensorSetDiff diff;
  for (const auto& [name, want] : expected) {
    auto it = actual.find(name);
    if (it == actual.end()) {
      diff.missing.push_back(name);
    } else if (it->second != want) {
      diff.mismatched.push_back(absl::StrCat(name, ": expected ", describe_spec(want), ", got ",
                                             describe_spec(it->second)));
    }
  }
  for (const auto& [name, spec] : actual) {
    if (expected.count(name) == 0) diff.unexpected.push_back(name);
  }
  return diff;  // std::map iteration keeps all three lists sorted by name
}

std::string TensorSetDiff::to_string(size_t max_per_kind) const {
  std::string out;
  auto list = [&](const char* kind, const std::vector<std::string>& items) {
    if (items.empty()) return;
    absl::StrAppend(&out, kind, " (", items.size(), "):\n");
    const size_t shown = std::min(items.size(), max_per_kind);
    for (size_t i = 0; i < shown; ++i) absl::StrAppend(&out, "  ", items[i], "\n");
    if (shown < items.size()) absl::StrAppend(&out, "  ... and ", items.size() - shown, " more\n");
  };
  list("missing", missing);
  list("unexpected", unexpected);
  list("mismatched", mismatched);
  return out;
}

absl::Status check_tensor_specs(const std::map<std::string, TensorSpec>& actual,
                                const std::map<std::string, TensorSpec>& expected,
                                const std::string& what) {
  TensorSetDiff diff = diff_tensor_specs(actual, expected);
  if (diff.ok()) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": tensors do not match the expected set:\n", diff.to_string()));
}

}  // namespace gdr::io
