// Exchange of Qwen3.5 weights with Hugging Face checkpoints (safetensors, single file or
// sharded with model.safetensors.index.json), under HF's tensor names.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "models/qwen/model.h"

namespace gdr {

struct HfSaveOptions {
  // Store in this dtype (e.g. BF16 as HF ships); default: each parameter's own dtype.
  std::optional<at::ScalarType> dtype;
  // One model.safetensors up to this many bytes, else HF-style shards + index.
  int64_t max_shard_bytes = int64_t{5} << 30;
};

// The text config as a Hugging Face config.json (model_type qwen3_5_text), readable by
// load_qwen_config_hf_json and by transformers. gdr's own keys (pre_gdr_fusion,
// deterministic_mode) are not HF keys and are not written. `dtype` ("bfloat16", "float32";
// "" leaves the key out) is the stored weights' dtype, which transformers loads by default.
absl::Status write_hf_config_json(const QwenConfig& config, const std::string& path,
                                  absl::string_view dtype = "");

// Writes model.named_parameters() and config.json (with the stored dtype) into `dir`
// (created if missing), atomically per file.
absl::Status save_hf_checkpoint(const QwenForCausalLMImpl& model, const std::string& dir,
                                const HfSaveOptions& options = {});

struct HfLoadReport {
  int64_t loaded = 0;   // parameters filled
  int64_t skipped = 0;  // tensors of parts gdr does not model (vision tower, MTP head)
};

// Fills every parameter of `model` from `path` (a directory, an index JSON, or a
// .safetensors file). Accepts the multimodal layout (model.language_model.* is read as
// model.*) and skips model.visual.* and mtp.* tensors; a tied model also ignores
// lm_head.weight. Floating dtypes are converted to each parameter's dtype; anything else
// that differs (missing, unexpected, wrong shape, non-float dtype) is an error naming
// the file and the tensors, and then no parameter is modified.
absl::StatusOr<HfLoadReport> load_hf_checkpoint(QwenForCausalLMImpl& model,
                                                const std::string& path);

// The config.json that describes the weights at `path`: <path>/config.json for a
// directory, else the config.json beside the file.
std::string hf_config_json_for(const std::string& path);

// load_hf_checkpoint after checking the checkpoint's config.json (hf_config_json_for) against
// model.config(). Errors, before any parameter is modified:
//   NotFound         "<path>: no config.json beside the weights (expected <file>)"
//   InvalidArgument  "<config.json>: the checkpoint's model differs from the run's in
//                     <key> (<run's> vs <checkpoint's>), ..." (qwen_config_differences)
//   and every error of load_qwen_config_hf_json and load_hf_checkpoint.
absl::StatusOr<HfLoadReport> load_hf_checkpoint_checked(QwenForCausalLMImpl& model,
                                                        const std::string& path);

}  // namespace gdr
