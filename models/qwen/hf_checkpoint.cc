#include "models/qwen/hf_checkpoint.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <filesystem>
#include <map>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "io/file_util.h"
#include "io/safetensors.h"
#include "nlohmann/json.hpp"

namespace gdr {
namespace {

constexpr char kMultimodalPrefix[] = "model.language_model.";

bool is_skipped_part(const std::string& name) {
  return absl::StartsWith(name, "model.visual.") || absl::StartsWith(name, "mtp.");
}

// transformers' name of a dtype (config.json "dtype"); "" for one it has no name for here.
std::string hf_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return "bfloat16";
    case at::kHalf: return "float16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    default: return "";
  }
}

}  // namespace

absl::Status write_hf_config_json(const QwenConfig& config, const std::string& path,
                                  absl::string_view dtype) {
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
  if (!dtype.empty()) json["dtype"] = std::string(dtype);
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
  const std::string dtype_name =
      tensors.empty() ? "" : hf_dtype_name(tensors.front().second.scalar_type());
  if (absl::Status s = write_hf_config_json(model.config(), dir + "/config.json", dtype_name);
      !s.ok()) {
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

std::string hf_config_json_for(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return path + "/config.json";
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  return (parent.empty() ? std::filesystem::path("config.json") : parent / "config.json").string();
}

absl::StatusOr<HfLoadReport> load_hf_checkpoint_checked(QwenForCausalLMImpl& model,
                                                        const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    return absl::NotFoundError(absl::StrCat(path, ": no such file or directory"));
  }
  const std::string config_json = hf_config_json_for(path);
  if (!std::filesystem::exists(config_json, ec)) {
    return absl::NotFoundError(
        absl::StrCat(path, ": no config.json beside the weights (expected ", config_json, ")"));
  }
  absl::StatusOr<QwenConfig> saved = load_qwen_config_hf_json(config_json);
  if (!saved.ok()) return saved.status();
  const std::vector<std::string> differing = qwen_config_differences(model.config(), *saved);
  if (!differing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(config_json, ": the checkpoint's model differs from the run's in ",
                     absl::StrJoin(differing, ", "), " (the run's value first)"));
  }
  return load_hf_checkpoint(model, path);
}

}  // namespace gdr
