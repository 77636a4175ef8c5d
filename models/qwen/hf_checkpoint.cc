#include "models/qwen/hf_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <filesystem>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "io/file_util.h"
#include "io/safetensors.h"
#include "nlohmann/json.hpp"

namespace gdr {
namespace {

constexpr char kMultimodalPrefix[] = "model.language_model.";

bool is_skipped_part(const std::string& name) {
  return absl::StartsWith(name, "model.visual.") || absl::StartsWith(name, "mtp.");
}

}  // namespace

absl::Status write_hf_config_json(const QwenConfig& config, const std::string& path) {
  nlohmann::ordered_json json;
  json["architectures"] = {"Qwen3_5ForCausalLM"};
  json["model_type"] = "qwen3_5_text";
  json["hidden_size"] = config.hidden_size;
  json["num_hidden_layers"] = config.num_hidden_layers;
  json["intermediate_size"] = config.intermediate_size;
  json["vocab_size"] = config.vocab_size;
  json["num_attention_heads"] = config.num_attention_heads;
  json["num_key_value_heads"] = config.num_key_value_heads;
  json["head_dim"] = config.head_dim;
  json["linear_num_key_heads"] = config.linear_num_key_heads;
  json["linear_num_value_heads"] = config.linear_num_value_heads;
  json["linear_key_head_dim"] = config.linear_key_head_dim;
  json["linear_value_head_dim"] = config.linear_value_head_dim;
  json["linear_conv_kernel_dim"] = config.linear_conv_kernel_dim;
  json["rms_norm_eps"] = config.rms_norm_eps;
  json["layer_types"] = config.layer_types;
  json["full_attention_interval"] = config.full_attention_interval;
  json["rope_parameters"] = {{"rope_type", "default"},
                             {"rope_theta", config.rope_theta},
                             {"partial_rotary_factor", config.partial_rotary_factor}};
  json["tie_word_embeddings"] = config.tie_word_embeddings;
  json["hidden_act"] = config.hidden_act;
  json["max_position_embeddings"] = config.max_position_embeddings;
  json["initializer_range"] = config.initializer_range;
  json["attention_bias"] = false;
  json["attn_output_gate"] = true;
  return io::write_file_atomically(path, json.dump(2) + "\n");
}

absl::Status save_hf_checkpoint(const QwenForCausalLMImpl& model, const std::string& dir,
                                const HfSaveOptions& options) {
  io::NamedTensors tensors;
  int64_t total_bytes = 0;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    at::Tensor t = item.value().detach().to(at::kCPU);
    if (options.dtype) t = t.to(*options.dtype);
    total_bytes += t.numel() * static_cast<int64_t>(t.element_size());
    tensors.emplace_back(item.key(), t.contiguous());
  }
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec)
    return absl::InternalError(absl::StrCat(dir, ": cannot create directory: ", ec.message()));
  if (absl::Status s = write_hf_config_json(model.config(), dir + "/config.json"); !s.ok()) {
    return s;
  }
  const io::SafetensorsMetadata metadata = {{"format", "pt"}};
  if (total_bytes <= options.max_shard_bytes) {
    return io::write_safetensors(dir + "/model.safetensors", tensors, metadata);
  }
  return io::write_safetensors_sharded(dir, tensors, options.max_shard_bytes, metadata);
}

absl::StatusOr<HfLoadReport> load_hf_checkpoint(QwenForCausalLMImpl& model,
                                                const std::string& path) {
  absl::StatusOr<io::SafetensorsContents> contents = io::read_safetensors_sharded(path);
  if (!contents.ok()) return contents.status();

  std::map<std::string, at::Tensor> params;
  std::map<std::string, io::TensorSpec> expected;
  for (const auto& item : model.named_parameters(/*recurse=*/true)) {
    params[item.key()] = item.value();
    expected[item.key()] = io::spec_of(item.value());
  }
  const bool tied = model.config().tie_word_embeddings;

  HfLoadReport report;
  std::map<std::string, at::Tensor> found;
  std::map<std::string, io::TensorSpec> actual;
  for (const auto& [raw_name, tensor] : contents->tensors) {
    std::string name = raw_name;
    if (absl::StartsWith(name, kMultimodalPrefix)) {
      name = absl::StrCat("model.", name.substr(sizeof(kMultimodalPrefix) - 1));
    }
    if (is_skipped_part(name) || (tied && name == "lm_head.weight")) {
      ++report.skipped;
      continue;
    }
    io::TensorSpec spec = io::spec_of(tensor);
    // A floating tensor converts to the parameter's floating dtype (HF ships BF16).
    auto it = expected.find(name);
    if (it != expected.end() && at::isFloatingType(spec.dtype) &&
        at::isFloatingType(it->second.dtype)) {
      spec.dtype = it->second.dtype;
    }
    actual[name] = spec;
    found[name] = tensor;
  }
  if (absl::Status status = io::check_tensor_specs(actual, expected, path); !status.ok()) {
    return status;
  }
  c10::NoGradGuard no_grad;
  for (auto& [name, param] : params) {
    param.copy_(found.at(name).to(param.scalar_type()));
    ++report.loaded;
  }
  return report;
}

}  // namespace gdr
