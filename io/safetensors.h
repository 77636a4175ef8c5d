// Reading and writing safetensors checkpoints (single files and HF-style sharded sets).
//
// Hand-written: there is no C++ safetensors library in our package registries, and the
// format is small. The format (https://github.com/huggingface/safetensors):
//   bytes [0, 8)       N, the header length, unsigned 64-bit little-endian
//   bytes [8, 8 + N)   a UTF-8 JSON object. Each key is a tensor name mapping to
//                      {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]};
//                      the optional key "__metadata__" maps to a {string: string} object.
//   bytes [8 + N, ...) the data buffer; a tensor's bytes are buffer[begin, end), row-major,
//                      little-endian.
// Sharded checkpoints are several such files plus "model.safetensors.index.json":
//   {"metadata": {...}, "weight_map": {tensor name: shard file name}}
//
// Contract of this module:
//   - dtypes: F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL (at::kDouble ... at::kBool).
//   - Reading checks what the reference implementation checks, and names the file, the tensor
//     and expected vs actual in the error (absl::DataLossError for a malformed file,
//     NotFoundError for a missing one): header length (<= 100'000'000, inside the file),
//     header is a JSON object, no duplicate keys, known dtype, non-negative integer
//     dims, data_offsets that are in order and cover the buffer exactly with no gaps or
//     overlaps, and end - begin == numel * element size. The order of keys in the header
//     does not matter.
//   - Tensors come back on the CPU, contiguous, owning their memory (no mmap kept alive),
//     in file order (ascending data offset), which for files written here is the order they
//     were given to the writer.
//   - Writing copies each tensor to a contiguous CPU tensor, lays tensors out in the order
//     given with no padding between them (tensors that share memory, e.g. tied embeddings,
//     are written as independent copies), pads the header with spaces to a multiple of 8
//     bytes, and publishes the file atomically (see Note [Atomic file writes] in
//     io/file_util.h). The output is byte-for-byte deterministic for a given input.
// This code assumes a little-endian host (checked at compile time).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace gdr::io {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;
using SafetensorsMetadata = std::map<std::string, std::string>;

// What a checkpoint holds, in file order.
struct SafetensorsContents {
  NamedTensors tensors;
  SafetensorsMetadata metadata;

  // The tensor called `name`, or nullptr. Linear scan: for lookups in a loop, build a map.
  const at::Tensor* find(const std::string& name) const;
};

// The description of one tensor, without its data.
struct TensorSpec {
  at::ScalarType dtype = at::kFloat;
  std::vector<int64_t> shape;

  bool operator==(const TensorSpec& other) const {
    return dtype == other.dtype && shape == other.shape;
  }
  bool operator!=(const TensorSpec& other) const { return !(*this == other); }
};

// One entry of a parsed header.
struct SafetensorsEntry {
  std::string name;
  TensorSpec spec;
  uint64_t data_begin = 0;  // relative to the start of the data buffer
  uint64_t data_end = 0;
};

struct SafetensorsHeader {
  std::vector<SafetensorsEntry> entries;  // ascending data_begin
  SafetensorsMetadata metadata;
  uint64_t data_start = 0;  // absolute file offset of the data buffer (8 + N)
};

// The safetensors dtype string for `dtype` ("F32", "BF16", ...), or an InvalidArgument
// error for a dtype this module does not store; and the inverse.
absl::StatusOr<std::string> safetensors_dtype_name(at::ScalarType dtype);
absl::StatusOr<at::ScalarType> scalar_type_from_safetensors_dtype(const std::string& name);

// Writes `tensors` (unique, non-empty names other than "__metadata__"; defined, strided
// tensors of a supported dtype on any device) and `metadata` to `path`, atomically.
absl::Status write_safetensors(const std::string& path, const NamedTensors& tensors,
                               const SafetensorsMetadata& metadata = {});

// Reads and validates only the header of `path` (cheap: no tensor data is read).
absl::StatusOr<SafetensorsHeader> read_safetensors_header(const std::string& path);

// Reads and validates the whole file.
absl::StatusOr<SafetensorsContents> read_safetensors(const std::string& path);

// Writes `tensors` as HF-style shards into `dir` (created if missing):
//   model-00001-of-0000n.safetensors ... and model.safetensors.index.json.
// Tensors are packed greedily in the order given: a shard is closed when adding the next
// tensor would take its data past `max_shard_bytes`; a tensor larger than that gets a shard
// of its own. An index is written even for a single shard. `metadata` goes into each
// shard's "__metadata__" and into the index's "metadata", where "total_size" (the sum of
// tensor bytes, a JSON number as HF writes it) is added. Shards are committed before the
// index, so a reader that finds the index finds every shard it names. Shard files left
// over from an earlier, differently sharded save in `dir` are not removed.
absl::Status write_safetensors_sharded(const std::string& dir, const NamedTensors& tensors,
                                       int64_t max_shard_bytes,
                                       const SafetensorsMetadata& metadata = {});

// Reads a sharded checkpoint. `dir_or_index_path` is either the index JSON file or a
// directory holding "model.safetensors.index.json" (or, failing that, a single
// "model.safetensors", which is read as an unsharded checkpoint); a path ending in
// ".safetensors" is read as a single file. Checks that every shard named by the index
// exists, that each tensor is in the shard the index says, and that no shard holds a
// tensor the index does not list. Tensors come back shard by shard (shards
// sorted by file name), each shard in file order. `metadata` is the index's "metadata",
// with non-string values (e.g. total_size) rendered as JSON text.
absl::StatusOr<SafetensorsContents> read_safetensors_sharded(const std::string& dir_or_index_path);

// ----------------------------------------------------------------- comparing tensor sets

// How a loaded set of tensors differs from what a model expects.
struct TensorSetDiff {
  std::vector<std::string> missing;     // expected, absent (sorted)
  std::vector<std::string> unexpected;  // present, not expected (sorted)
  std::vector<std::string> mismatched;  // "name: expected BF16 [4, 8], got F32 [4, 8]" (sorted)

  bool ok() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // Human-readable, one problem per line; lists at most `max_per_kind` names of each kind
  // followed by "... and K more".
  std::string to_string(size_t max_per_kind = 20) const;
};

// "F32 [2, 3]": a spec as it appears in messages.
std::string describe_spec(const TensorSpec& spec);

TensorSpec spec_of(const at::Tensor& tensor);
std::map<std::string, TensorSpec> specs_of(const NamedTensors& tensors);

TensorSetDiff diff_tensor_specs(const std::map<std::string, TensorSpec>& actual,
                                const std::map<std::string, TensorSpec>& expected);

// OK when `actual` matches `expected` exactly; otherwise InvalidArgument whose message is
// "<what>: tensors do not match the expected set:\n" + diff.to_string().
absl::Status check_tensor_specs(const std::map<std::string, TensorSpec>& actual,
                                const std::map<std::string, TensorSpec>& expected,
                                const std::string& what);

}  // namespace gdr::io
