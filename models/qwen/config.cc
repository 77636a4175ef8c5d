// QwenConfig loading and validation. Both formats are read with yaml-cpp: JSON is YAML's
// flow style, so one strict, table-driven reader serves our YAML and HF's config.json.
#include "models/qwen/config.h"
#include "io/yaml_file.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gdr {
namespace {

// Keys of a Hugging Face Qwen3.5 text config that do not change the text model we build
// for training (token ids, serving options, dtype of the checkpoint, the MTP head, which
// gdr does not train). Anything outside this list and the model keys is an error.
const std::set<std::string>& ignored_hf_keys() {
  static const auto* keys = new std::set<std::string>{"_name_or_path",
                                                      "architectures",
                                                      "model_type",
                                                      "transformers_version",
                                                      "dtype",
                                                      "torch_dtype",
                                                      "bos_token_id",
                                                      "pad_token_id",
                                                      "use_cache",
                                                      "attention_dropout",
                                                      "mtp_num_hidden_layers",
                                                      "mtp_use_dedicated_embeddings",
                                                      "mamba_ssm_dtype",
                                                      "output_attentions",
                                                      "output_hidden_states",
                                                      "return_dict",
                                                      "use_sliding_window",
                                                      "sliding_window",
                                                      "max_window_layers"};
  return *keys;
}

// Where a value came from, for messages: "<file>: <prefix><key>: <problem>".
struct Source {
  std::string file;
  std::string prefix;

  absl::Status error(absl::string_view key, absl::string_view problem) const {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", prefix, key, ": ", problem));
  }
};

using io::describe_yaml_node;

// A key that is not a plain name (a list or a mapping), inside `parent` ("" at the top).
absl::Status bad_key(const YAML::Node& key, const Source& source, absl::string_view parent) {
  return absl::InvalidArgumentError(absl::StrCat(
      source.file, ": ", parent.empty() ? source.prefix : absl::StrCat(source.prefix, parent, "."),
      "<key>: expected a plain key but got ", describe_yaml_node(key)));
}

template <typename T>
absl::Status read_plain(const YAML::Node& node, absl::string_view key, const Source& source,
                        absl::string_view expected, T* out) {
  const auto problem = io::read_plain_yaml_scalar(node, std::string(expected), out);
  return problem.has_value() ? source.error(key, *problem) : absl::OkStatus();
}

absl::Status read_int(const YAML::Node& node, absl::string_view key, const Source& source,
                      int64_t* out) {
  return read_plain(node, key, source, "an integer", out);
}

absl::Status read_double(const YAML::Node& node, absl::string_view key, const Source& source,
                         double* out) {
  return read_plain(node, key, source, "a number", out);
}

absl::Status read_bool(const YAML::Node& node, absl::string_view key, const Source& source,
                       bool* out) {
  return read_plain(node, key, source, "a boolean (true or false)", out);
}

absl::Status read_string(const YAML::Node& node, absl::string_view key, const Source& source,
                         std::string* out) {
  if (!node.IsDefined() || !node.IsScalar()) {
    return source.error(key, absl::StrCat("expected a string but got ", describe_yaml_node(node)));
  }
  *out = node.Scalar();
  return absl::OkStatus();
}

absl::Status read_string_list(const YAML::Node& node, absl::string_view key, const Source& source,
                              std::vector<std::string>* out) {
  if (!node.IsSequence()) {
    return source.error(
        key, absl::StrCat("expected a list of strings but got ", describe_yaml_node(node)));
  }
  out->clear();
  for (size_t i = 0; i < node.size(); ++i) {
    std::string item;
    if (absl::Status s = read_string(node[i], absl::StrCat(key, "[", i, "]"), source, &item);
        !s.ok()) {
      return s;
    }
    out->push_back(std::move(item));
  }
  return absl::OkStatus();
}

absl::Status read_fusion(const YAML::Node& node, absl::string_view key, const Source& source,
                         PreGdrFusion* out) {
  std::string text;
  if (absl::Status s = read_string(node, key, source, &text); !s.ok()) return s;
  if (text == "none") {
    *out = PreGdrFusion::kNone;
  } else if (text == "gate") {
    *out = PreGdrFusion::kGate;
  } else if (text == "full") {
    *out = PreGdrFusion::kFull;
  } else {
    return source.error(key, absl::StrCat("expected one of none, gate, full but got '", text, "'"));
  }
  return absl::OkStatus();
}

// HF's eos_token_id: an integer, a list of integers, or null (none).
absl::Status read_eos_token_ids(const YAML::Node& node, absl::string_view key, const Source& source,
                                std::vector<int64_t>* out) {
  out->clear();
  if (node.IsNull()) return absl::OkStatus();
  if (!node.IsSequence()) {
    int64_t id = 0;
    if (absl::Status s =
            read_plain(node, key, source, "an integer or a list of integers (token ids)", &id);
        !s.ok()) {
      return s;
    }
    out->push_back(id);
    return absl::OkStatus();
  }
  for (size_t i = 0; i < node.size(); ++i) {
    int64_t id = 0;
    if (absl::Status s = read_int(node[i], absl::StrCat(key, "[", i, "]"), source, &id); !s.ok()) {
      return s;
    }
    out->push_back(id);
  }
  return absl::OkStatus();
}

using Setter =
    std::function<absl::Status(const YAML::Node&, absl::string_view, const Source&, QwenConfig&)>;
struct Field {
  const char* name;
  bool required;
  Setter set;
};

Setter int_field(int64_t QwenConfig::*member) {
  return [member](const YAML::Node& n, absl::string_view k, const Source& s, QwenConfig& c) {
    return read_int(n, k, s, &(c.*member));
  };
}
Setter double_field(double QwenConfig::*member) {
  return [member](const YAML::Node& n, absl::string_view k, const Source& s, QwenConfig& c) {
    return read_double(n, k, s, &(c.*member));
  };
}
Setter bool_field(bool QwenConfig::*member) {
  return [member](const YAML::Node& n, absl::string_view k, const Source& s, QwenConfig& c) {
    return read_bool(n, k, s, &(c.*member));
  };
}

// A key that used to select a kernel here: an error pointing at its new place.
Setter moved_to_kernels(const char* policy_key) {
  return [policy_key](const YAML::Node&, absl::string_view k, const Source& s, QwenConfig&) {
    return s.error(k, absl::StrCat("kernel choices moved to the run config's kernels: section; "
                                   "set kernels.",
                                   policy_key, " instead"));
  };
}

const std::vector<Field>& model_fields() {
  static const auto* fields = new std::vector<Field>{
      {"hidden_size", true, int_field(&QwenConfig::hidden_size)},
      {"num_hidden_layers", true, int_field(&QwenConfig::num_hidden_layers)},
      {"intermediate_size", true, int_field(&QwenConfig::intermediate_size)},
      {"vocab_size", true, int_field(&QwenConfig::vocab_size)},
      {"num_attention_heads", true, int_field(&QwenConfig::num_attention_heads)},
      {"num_key_value_heads", true, int_field(&QwenConfig::num_key_value_heads)},
      {"head_dim", true, int_field(&QwenConfig::head_dim)},
      {"linear_num_key_heads", true, int_field(&QwenConfig::linear_num_key_heads)},
      {"linear_num_value_heads", true, int_field(&QwenConfig::linear_num_value_heads)},
      {"linear_key_head_dim", true, int_field(&QwenConfig::linear_key_head_dim)},
      {"linear_value_head_dim", true, int_field(&QwenConfig::linear_value_head_dim)},
      {"linear_conv_kernel_dim", false, int_field(&QwenConfig::linear_conv_kernel_dim)},
      {"rms_norm_eps", false, double_field(&QwenConfig::rms_norm_eps)},
      {"layer_types", false,
       [](const YAML::Node& n, absl::string_view k, const Source& s, QwenConfig& c) {
         return read_string_list(n, k, s, &c.layer_types);
       }},
      {"full_attention_interval", false, int_field(&QwenConfig::full_attention_interval)},
      {"rope_theta", false, double_field(&QwenConfig::rope_theta)},
      {"partial_rotary_factor", false, double_field(&QwenConfig::partial_rotary_factor)},
      {"tie_word_embeddings", false, bool_field(&QwenConfig::tie_word_embeddings)},
      {"hidden_act", false,
       [](const YAML::Node& n, absl::string_view k, const Source& s, QwenConfig& c) {
         return read_string(n, k, s, &c.hidden_act);
       }},
      {"max_position_embeddings", false, int_field(&QwenConfig::max_position_embeddings)},
      {"initializer_range", false, double_field(&QwenConfig::initializer_range)},
      {"eos_token_id", false,
       [](const YAML::Node& n, absl::string_view k, const Source& s, QwenConfig& c) {
         return read_eos_token_ids(n, k, s, &c.eos_token_ids);
       }},
      {"pre_gdr_fusion", false,
       [](const YAML::Node& n, absl::string_view k, const Source& s, QwenConfig& c) {
         return read_fusion(n, k, s, &c.pre_gdr_fusion);
       }},
      {"deterministic_mode", false, bool_field(&QwenConfig::deterministic_mode)},
      // Kernel choices moved to the execution policy (the run config's kernels: section).
      {"gdr_core_impl", false, moved_to_kernels("gdr_core_impl")},
      {"gdr_core_prep", false, moved_to_kernels("gdr_core_prep")},
      {"attention_impl", false, moved_to_kernels("attention")},
  };
  return *fields;
}

const Field* find_field(const std::string& key) {
  for (const Field& f : model_fields()) {
    if (key == f.name) return &f;
  }
  return nullptr;
}

// HF-only keys that are checked rather than ignored: they would change the model if they
// had another value than the one gdr builds.
absl::Status read_hf_extra(const std::string& key, const YAML::Node& node, const Source& source,
                           QwenConfig& config, bool* handled) {
  *handled = true;
  if (key == "attention_bias" || key == "attn_output_gate") {
    bool value = false;
    if (absl::Status s = read_bool(node, key, source, &value); !s.ok()) return s;
    const bool wanted = key == "attn_output_gate";  // gated attention, no biases
    if (value != wanted) {
      return source.error(
          key, absl::StrCat("expected ", wanted ? "true" : "false",
                            " (the only variant gdr builds) but got ", value ? "true" : "false"));
    }
    return absl::OkStatus();
  }
  if (key == "mlp_only_layers") {
    if (!node.IsSequence() || node.size() != 0) {
      return source.error(key,
                          absl::StrCat("expected an empty list (gdr builds no MoE layers) but got ",
                                       describe_yaml_node(node)));
    }
    return absl::OkStatus();
  }
  if (key == "rope_parameters" || key == "rope_scaling") {
    if (node.IsNull()) return absl::OkStatus();
    if (!node.IsMap()) {
      return source.error(key,
                          absl::StrCat("expected a mapping but got ", describe_yaml_node(node)));
    }
    const Source nested{source.file, absl::StrCat(source.prefix, key, ".")};
    for (const auto& item : node) {
      const std::optional<std::string> sub_key = io::yaml_key_text(item.first);
      if (!sub_key.has_value()) return bad_key(item.first, source, key);
      const std::string& sub = *sub_key;
      absl::Status s = absl::OkStatus();
      if (sub == "rope_theta") {
        s = read_double(item.second, sub, nested, &config.rope_theta);
      } else if (sub == "partial_rotary_factor") {
        s = read_double(item.second, sub, nested, &config.partial_rotary_factor);
      } else if (sub == "rope_type" || sub == "type") {
        std::string type;
        s = read_string(item.second, sub, nested, &type);
        if (s.ok() && type != "default") {
          s = nested.error(
              sub, absl::StrCat("expected 'default' (no RoPE scaling) but got '", type, "'"));
        }
      } else if (sub == "mrope_section" || sub == "mrope_interleaved") {
        // Text-only input gives the three mRoPE axes one position, which is plain RoPE.
      } else {
        s = nested.error(sub, "unknown key");
      }
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }
  *handled = false;
  return absl::OkStatus();
}

absl::StatusOr<QwenConfig> parse_section(const YAML::Node& section, const Source& source, bool hf) {
  if (!section.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(source.file, ": expected a mapping of model settings but got ",
                     describe_yaml_node(section)));
  }
  QwenConfig config;
  std::set<std::string> seen;
  std::vector<std::pair<std::string, YAML::Node>> deferred;  // rope_parameters after flat keys
  for (const auto& item : section) {
    const std::optional<std::string> key_text = io::yaml_key_text(item.first);
    if (!key_text.has_value()) return bad_key(item.first, source, "");
    const std::string& key = *key_text;
    if (const Field* field = find_field(key)) {
      if (absl::Status s = field->set(item.second, key, source, config); !s.ok()) return s;
      seen.insert(key);
      continue;
    }
    if (hf && ignored_hf_keys().count(key) > 0) continue;
    if (hf && (key == "rope_parameters" || key == "rope_scaling")) {
      deferred.emplace_back(key, item.second);
      continue;
    }
    bool handled = false;
    if (hf) {
      if (absl::Status s = read_hf_extra(key, item.second, source, config, &handled); !s.ok()) {
        return s;
      }
    }
    if (!handled) return source.error(key, "unknown key");
  }
  for (const auto& [key, node] : deferred) {
    bool handled = false;
    if (absl::Status s = read_hf_extra(key, node, source, config, &handled); !s.ok()) return s;
  }
  for (const Field& field : model_fields()) {
    if (field.required && seen.count(field.name) == 0) {
      return source.error(field.name, "required key is missing");
    }
  }
  if (seen.count("layer_types") == 0 && config.full_attention_interval > 0) {
    config.layer_types.clear();
    for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
      const bool full = (i + 1) % config.full_attention_interval == 0;
      config.layer_types.emplace_back(full ? kFullAttention : kLinearAttention);
    }
  }
  return config;
}

}  // namespace

absl::string_view pre_gdr_fusion_name(PreGdrFusion fusion) {
  switch (fusion) {
    case PreGdrFusion::kNone: return "none";
    case PreGdrFusion::kGate: return "gate";
    case PreGdrFusion::kFull: return "full";
  }
  return "unknown";
}

int64_t QwenConfig::rotary_dim() const {
  return static_cast<int64_t>(std::llround(static_cast<double>(head_dim) * partial_rotary_factor));
}

absl::Status validate_qwen_config(const QwenConfig& c, absl::string_view file,
                                  absl::string_view key_prefix) {
  const Source source{std::string(file), std::string(key_prefix)};
  const std::pair<const char*, int64_t> positives[] = {
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"intermediate_size", c.intermediate_size},
      {"vocab_size", c.vocab_size},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"head_dim", c.head_dim},
      {"linear_num_key_heads", c.linear_num_key_heads},
      {"linear_num_value_heads", c.linear_num_value_heads},
      {"linear_key_head_dim", c.linear_key_head_dim},
      {"linear_value_head_dim", c.linear_value_head_dim},
      {"linear_conv_kernel_dim", c.linear_conv_kernel_dim},
      {"full_attention_interval", c.full_attention_interval},
      {"max_position_embeddings", c.max_position_embeddings},
  };
  for (const auto& [key, value] : positives) {
    if (value <= 0)
      return source.error(key, absl::StrCat("expected a positive integer but got ", value));
  }
  if (!(c.rms_norm_eps > 0)) {
    return source.error("rms_norm_eps",
                        absl::StrCat("expected a positive number but got ", c.rms_norm_eps));
  }
  if (!(c.rope_theta > 0)) {
    return source.error("rope_theta",
                        absl::StrCat("expected a positive number but got ", c.rope_theta));
  }
  if (!(c.initializer_range > 0)) {
    return source.error("initializer_range",
                        absl::StrCat("expected a positive number but got ", c.initializer_range));
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return source.error("num_attention_heads",
                        absl::StrCat("expected a multiple of ", key_prefix, "num_key_value_heads (",
                                     c.num_key_value_heads, ") but got ", c.num_attention_heads));
  }
  if (c.linear_num_value_heads % c.linear_num_key_heads != 0) {
    return source.error(
        "linear_num_value_heads",
        absl::StrCat("expected a multiple of ", key_prefix, "linear_num_key_heads (",
                     c.linear_num_key_heads, ") but got ", c.linear_num_value_heads));
  }
  if (static_cast<int64_t>(c.layer_types.size()) != c.num_hidden_layers) {
    return source.error("layer_types",
                        absl::StrCat("expected ", c.num_hidden_layers, " entries (", key_prefix,
                                     "num_hidden_layers) but got ", c.layer_types.size()));
  }
  for (size_t i = 0; i < c.layer_types.size(); ++i) {
    if (c.layer_types[i] != kLinearAttention && c.layer_types[i] != kFullAttention) {
      return source.error(absl::StrCat("layer_types[", i, "]"),
                          absl::StrCat("expected linear_attention or full_attention but got '",
                                       c.layer_types[i], "'"));
    }
  }
  const double rotary = static_cast<double>(c.head_dim) * c.partial_rotary_factor;
  if (!(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1) ||
      rotary != std::floor(rotary) || static_cast<int64_t>(rotary) % 2 != 0) {
    return source.error(
        "partial_rotary_factor",
        absl::StrCat("expected a factor in (0, 1] that makes head_dim (", c.head_dim,
                     ") * factor an even integer but got ", c.partial_rotary_factor));
  }
  for (size_t i = 0; i < c.eos_token_ids.size(); ++i) {
    const int64_t id = c.eos_token_ids[i];
    if (id < 0 || id >= c.vocab_size) {
      return source.error(c.eos_token_ids.size() == 1 ? std::string("eos_token_id")
                                                      : absl::StrCat("eos_token_id[", i, "]"),
                          absl::StrCat("expected a token id in [0, ", c.vocab_size, ") (",
                                       key_prefix, "vocab_size) but got ", id));
    }
  }
  if (c.hidden_act != "silu") {
    return source.error("hidden_act",
                        absl::StrCat("expected 'silu' (the only supported activation) but got '",
                                     c.hidden_act, "'"));
  }
  return absl::OkStatus();
}

absl::StatusOr<QwenConfig> load_qwen_config_yaml(const std::string& path) {
  absl::StatusOr<YAML::Node> root = io::load_yaml_file(path);
  if (!root.ok()) return root.status();
  // Note: YAML::Node assignment writes through to the referenced node, so the section is
  // chosen at construction rather than by reassigning a node that aliases the root.
  const bool in_run_config = root->IsMap() && (*root)["model"];
  const Source source{path, in_run_config ? "model." : ""};
  const YAML::Node section = in_run_config ? (*root)["model"] : *root;
  absl::StatusOr<QwenConfig> config = parse_section(section, source, /*hf=*/false);
  if (!config.ok()) return config.status();
  if (absl::Status s = validate_qwen_config(*config, source.file, source.prefix); !s.ok()) return s;
  return config;
}

absl::StatusOr<QwenConfig> load_qwen_config_hf_json(const std::string& path) {
  absl::StatusOr<YAML::Node> root = io::load_yaml_file(path);
  if (!root.ok()) return root.status();
  if (!root->IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a JSON object but got ", describe_yaml_node(*root)));
  }
  // Composite (vision + text) checkpoints nest the text model; the rest of the top level
  // (vision_config, token ids ...) is not ours to read.
  const bool nested = static_cast<bool>((*root)["text_config"]);
  const Source source{path, nested ? "text_config." : ""};
  const YAML::Node section = nested ? (*root)["text_config"] : *root;
  absl::StatusOr<QwenConfig> config = parse_section(section, source, /*hf=*/true);
  if (!config.ok()) return config.status();
  // A composite config may keep the token ids at the top level only.
  if (nested && !section["eos_token_id"] && (*root)["eos_token_id"]) {
    if (absl::Status s = read_eos_token_ids((*root)["eos_token_id"], "eos_token_id",
                                            Source{path, ""}, &config->eos_token_ids);
        !s.ok()) {
      return s;
    }
  }
  if (nested && (*root)["tie_word_embeddings"]) {
    const Source top{path, ""};
    if (absl::Status s = read_bool((*root)["tie_word_embeddings"], "tie_word_embeddings", top,
                                   &config->tie_word_embeddings);
        !s.ok()) {
      return s;
    }
  }
  if (absl::Status s = validate_qwen_config(*config, source.file, source.prefix); !s.ok()) return s;
  return config;
}

namespace {

// The shortest text that reads back as exactly `v` ("1e-06", "10000000").
std::string shortest_exact(double v) {
  if (std::abs(v) < 1e15 && v == std::trunc(v)) return absl::StrCat(static_cast<int64_t>(v));
  char buf[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*g", precision, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}

std::string shown(double v) { return shortest_exact(v); }
std::string shown(int64_t v) { return absl::StrCat(v); }
std::string shown(absl::string_view v) { return std::string(v); }
std::string shown(const std::string& v) { return v; }

}  // namespace

std::vector<std::string> qwen_config_differences(const QwenConfig& a, const QwenConfig& b) {
  std::vector<std::string> differing;
  const auto compare = [&](absl::string_view key, const auto& x, const auto& y) {
    if (x != y) differing.push_back(absl::StrCat(key, " (", shown(x), " vs ", shown(y), ")"));
  };
  compare("hidden_size", a.hidden_size, b.hidden_size);
  compare("num_hidden_layers", a.num_hidden_layers, b.num_hidden_layers);
  compare("intermediate_size", a.intermediate_size, b.intermediate_size);
  compare("vocab_size", a.vocab_size, b.vocab_size);
  compare("num_attention_heads", a.num_attention_heads, b.num_attention_heads);
  compare("num_key_value_heads", a.num_key_value_heads, b.num_key_value_heads);
  compare("head_dim", a.head_dim, b.head_dim);
  compare("linear_num_key_heads", a.linear_num_key_heads, b.linear_num_key_heads);
  compare("linear_num_value_heads", a.linear_num_value_heads, b.linear_num_value_heads);
  compare("linear_key_head_dim", a.linear_key_head_dim, b.linear_key_head_dim);
  compare("linear_value_head_dim", a.linear_value_head_dim, b.linear_value_head_dim);
  compare("linear_conv_kernel_dim", a.linear_conv_kernel_dim, b.linear_conv_kernel_dim);
  compare("rms_norm_eps", a.rms_norm_eps, b.rms_norm_eps);
  if (a.layer_types != b.layer_types) {
    differing.push_back(absl::StrCat("layer_types ([", absl::StrJoin(a.layer_types, ", "), "] vs [",
                                     absl::StrJoin(b.layer_types, ", "), "])"));
  }
  compare("rope_theta", a.rope_theta, b.rope_theta);
  compare("partial_rotary_factor", a.partial_rotary_factor, b.partial_rotary_factor);
  compare("tie_word_embeddings", absl::string_view(a.tie_word_embeddings ? "true" : "false"),
          absl::string_view(b.tie_word_embeddings ? "true" : "false"));
  compare("hidden_act", a.hidden_act, b.hidden_act);
  return differing;
}

absl::StatusOr<QwenConfig> load_qwen_config(const std::string& path) {
  if (absl::EndsWith(path, ".json")) return load_qwen_config_hf_json(path);
  return load_qwen_config_yaml(path);
}

}  // namespace gdr
