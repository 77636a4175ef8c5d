// QwenConfig: the shape of a Qwen3.5 text model plus gdr's own model settings, loaded from
// our YAML run configs or from a Hugging Face config.json, and validated.
//
// Keys are named exactly like Hugging Face's Qwen3.5 text config.json, so a config can be
// copied between the two. gdr adds two keys, which the run's execution policy takes over
// (ops/policy/execution_policy.h):
//   pre_gdr_fusion: none | gate | full   how the pre-GDR gate runs (default gate):
//       none = unfused ATen composite (gdr::pre_gdr_gate_composite),
//       gate = the fused gate op (gdr::pre_gdr_gate),
//       full = conv1d, SiLU, L2 norm, repeat and gate as one fused CUDA op
//              (gdr::pre_gdr_full_fusion; CUDA only, not with deterministic_mode).
//   deterministic_mode: bool             ordered, bit-reproducible paths (default false);
//       see apply_deterministic_mode() in ops/policy/determinism.h.
// The rule between them (deterministic_mode rejects pre_gdr_fusion: full) is the policy's
// (validate_execution_policy), checked when a run config is loaded. The former kernel keys
// gdr_core_impl, gdr_core_prep and attention_impl are errors that name their place in the
// run config's kernels: section.
//
// Errors are absl::InvalidArgumentError (NotFoundError for a missing file) whose message
// is "<file>: <key path>: <what is wrong>", e.g.
//   "configs/x.yaml: model.linear_num_value_heads: expected a multiple of
//    linear_num_key_heads (2) but got 3".
// Unknown keys are errors in both formats (a misspelt key must not silently fall back to
// a default). A Hugging Face file may also carry keys that do not change the text model
// (bos / pad token ids, dtype, MTP head, mRoPE sections ...): those are accepted and ignored,
// see ignored_hf_keys() in config.cc. eos_token_id is read (both formats; in a nested
// config.json from text_config, else from the top level): document masking splits
// documents after it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "ops/policy/execution_policy.h"

namespace gdr {

absl::string_view pre_gdr_fusion_name(PreGdrFusion fusion);

inline constexpr absl::string_view kLinearAttention = "linear_attention";
inline constexpr absl::string_view kFullAttention = "full_attention";

struct QwenConfig {
  // Required sizes.
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t linear_num_key_heads = 0;    // Hk
  int64_t linear_num_value_heads = 0;  // Hv, a multiple of Hk
  int64_t linear_key_head_dim = 0;     // dk
  int64_t linear_value_head_dim = 0;   // dv
  // Optional, defaults are Qwen3.5-0.8B's.
  int64_t linear_conv_kernel_dim = 4;
  double rms_norm_eps = 1e-6;
  // One of kLinearAttention / kFullAttention per layer. When absent from a file it is
  // derived from full_attention_interval: layer i is full iff (i + 1) % interval == 0.
  std::vector<std::string> layer_types;
  int64_t full_attention_interval = 4;
  double rope_theta = 1e7;
  double partial_rotary_factor = 0.25;
  bool tie_word_embeddings = true;
  std::string hidden_act = "silu";  // the only supported activation
  int64_t max_position_embeddings = 262144;
  double initializer_range = 0.02;
  // Hugging Face's eos_token_id: one id or a list of ids (null or absent: none). The model
  // itself does not use it; with data.document_masking a document starts right after each of
  // these tokens (Note [Document masking] in models/qwen/document_bounds.h). Each id must be
  // in [0, vocab_size).
  std::vector<int64_t> eos_token_ids;
  // gdr keys.
  PreGdrFusion pre_gdr_fusion = PreGdrFusion::kGate;
  bool deterministic_mode = false;

  // Derived sizes.
  int64_t linear_key_dim() const { return linear_num_key_heads * linear_key_head_dim; }
  int64_t linear_value_dim() const { return linear_num_value_heads * linear_value_head_dim; }
  // Channels of the GDN causal conv: q, k and v together.
  int64_t linear_conv_dim() const { return 2 * linear_key_dim() + linear_value_dim(); }
  int64_t rotary_dim() const;  // head_dim * partial_rotary_factor
  bool is_full_attention(int64_t layer) const { return layer_types.at(layer) == kFullAttention; }
};

// Checks consistency (positive sizes, head divisibility, layer_types,
// rotary dims). `source` and `key_prefix` only shape the messages
// ("<source>: <key_prefix><key>: ...").
absl::Status validate_qwen_config(const QwenConfig& config, absl::string_view source,
                                  absl::string_view key_prefix = "");

// Our YAML: either a run config with a `model:` section (other sections belong to the
// trainer and are not read here; keys are reported as "model.<key>"), or a file that is
// only the model section. Layer types missing -> derived from full_attention_interval.
absl::StatusOr<QwenConfig> load_qwen_config_yaml(const std::string& path);

// A Hugging Face config.json, flat (Qwen3_5ForCausalLM, keys reported bare) or nested
// under `text_config` (Qwen3_5ForConditionalGeneration, keys reported "text_config.<key>";
// a top-level tie_word_embeddings wins over the nested one, as in transformers). rope_theta
// and partial_rotary_factor are read flat or from `rope_parameters` / `rope_scaling`.
absl::StatusOr<QwenConfig> load_qwen_config_hf_json(const std::string& path);

// Either loader by extension: ".json" -> Hugging Face, otherwise YAML.
absl::StatusOr<QwenConfig> load_qwen_config(const std::string& path);

// The keys whose values differ between two configs, each as "<key> (<a> vs <b>)", in the
// order of the key table: every key that changes the weights' shapes or what the model
// computes (sizes, layer_types, conv kernel, rms_norm_eps, RoPE, tying, activation).
// gdr's own keys, initializer_range, max_position_embeddings and full_attention_interval
// (layer_types says it) are left out. Empty when the same model.
std::vector<std::string> qwen_config_differences(const QwenConfig& a, const QwenConfig& b);

}  // namespace gdr
