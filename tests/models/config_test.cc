// QwenConfig loading: the checked-in configs, Hugging Face config.json (flat and nested),
// and the exact error messages for the mistakes people make.
#include "models/qwen/config.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <vector>

namespace gdr {
namespace {

std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = ::testing::TempDir() + name;
  std::ofstream(path) << text;
  return path;
}

// A complete tiny model section; tests append or replace lines.
constexpr char kTinyModel[] = R"(model:
  hidden_size: 64
  num_hidden_layers: 4
  intermediate_size: 128
  vocab_size: 256
  num_attention_heads: 4
  num_key_value_heads: 2
  head_dim: 16
  linear_num_key_heads: 2
  linear_num_value_heads: 4
  linear_key_head_dim: 16
  linear_value_head_dim: 16
)";

std::string with_lines(const std::string& extra) { return std::string(kTinyModel) + extra; }

std::string replaced(const std::string& from, const std::string& to) {
  std::string text = kTinyModel;
  text.replace(text.find(from), from.size(), to);
  return text;
}

TEST(QwenConfig, TheCheckedIn0_8bConfigHasTheReferenceNumbers) {
  const absl::StatusOr<QwenConfig> c = load_qwen_config("configs/qwen3_5_0_8b.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 1024);
  EXPECT_EQ(c->num_hidden_layers, 24);
  EXPECT_EQ(c->intermediate_size, 3584);
  EXPECT_EQ(c->vocab_size, 248320);
  EXPECT_EQ(c->num_attention_heads, 8);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->head_dim, 256);
  EXPECT_EQ(c->linear_num_key_heads, 16);
  EXPECT_EQ(c->linear_num_value_heads, 16);
  EXPECT_EQ(c->linear_key_head_dim, 128);
  EXPECT_EQ(c->linear_value_head_dim, 128);
  EXPECT_EQ(c->linear_conv_kernel_dim, 4);
  EXPECT_EQ(c->linear_conv_dim(), 6144);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e7);
  EXPECT_EQ(c->rotary_dim(), 64);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->hidden_act, "silu");
  ASSERT_EQ(c->layer_types.size(), 24u);
  for (int i = 0; i < 24; ++i) EXPECT_EQ(c->is_full_attention(i), (i + 1) % 4 == 0) << i;
  EXPECT_EQ(c->pre_gdr_fusion, PreGdrFusion::kGate);
  EXPECT_FALSE(c->deterministic_mode);
}

// The released Qwen3.5-2B and -4B text configs (their config.json values).
TEST(QwenConfig, The2bAnd4bConfigsHaveTheReleasedModelsNumbers) {
  const absl::StatusOr<QwenConfig> two = load_qwen_config("configs/train_qwen2b.yaml");
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->hidden_size, 2048);
  EXPECT_EQ(two->num_hidden_layers, 24);
  EXPECT_EQ(two->intermediate_size, 6144);
  EXPECT_EQ(two->num_attention_heads, 8);
  EXPECT_EQ(two->num_key_value_heads, 2);
  EXPECT_EQ(two->linear_num_key_heads, 16);
  EXPECT_EQ(two->linear_num_value_heads, 16);
  const absl::StatusOr<QwenConfig> four = load_qwen_config("configs/train_qwen4b.yaml");
  ASSERT_TRUE(four.ok()) << four.status();
  EXPECT_EQ(four->hidden_size, 2560);
  EXPECT_EQ(four->num_hidden_layers, 32);
  EXPECT_EQ(four->intermediate_size, 9216);
  EXPECT_EQ(four->num_attention_heads, 16);
  EXPECT_EQ(four->num_key_value_heads, 4);
  EXPECT_EQ(four->linear_num_key_heads, 16);
  EXPECT_EQ(four->linear_num_value_heads, 32);
  for (const QwenConfig* c : {&*two, &*four}) {
    EXPECT_EQ(c->vocab_size, 248320);
    EXPECT_EQ(c->head_dim, 256);
    EXPECT_EQ(c->linear_key_head_dim, 128);
    EXPECT_EQ(c->linear_value_head_dim, 128);
    EXPECT_EQ(c->rotary_dim(), 64);
    EXPECT_TRUE(c->tie_word_embeddings);
    ASSERT_EQ(c->layer_types.size(), static_cast<size_t>(c->num_hidden_layers));
    for (int64_t i = 0; i < c->num_hidden_layers; ++i) {
      EXPECT_EQ(c->is_full_attention(i), (i + 1) % 4 == 0) << i;
    }
  }
}

TEST(QwenConfig, TheTinyConfigHasMoreValueHeadsThanKeyHeads) {
  const absl::StatusOr<QwenConfig> c = load_qwen_config("configs/tiny.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->linear_num_value_heads, 4);
  EXPECT_EQ(c->linear_num_key_heads, 2);
  EXPECT_EQ(c->vocab_size, 256);
  EXPECT_EQ(c->layer_types, (std::vector<std::string>{"linear_attention", "linear_attention",
                                                      "linear_attention", "full_attention"}));
}

TEST(QwenConfig, DifferencesNameEveryKeyThatChangesTheModelWithBothValues) {
  const absl::StatusOr<QwenConfig> a = load_qwen_config("configs/tiny.yaml");
  ASSERT_TRUE(a.ok()) << a.status();
  QwenConfig b = *a;
  // gdr's own keys and the ones that do not change the computation are not differences.
  b.pre_gdr_fusion = PreGdrFusion::kNone;
  b.deterministic_mode = !a->deterministic_mode;
  b.initializer_range = 0.5;
  b.max_position_embeddings = 7;
  EXPECT_TRUE(qwen_config_differences(*a, b).empty());
  b.rms_norm_eps = 1e-5;
  b.layer_types[0] = "full_attention";
  b.tie_word_embeddings = false;
  b.rope_theta = 10000000.5;
  EXPECT_EQ(qwen_config_differences(*a, b),
            (std::vector<std::string>{
                "rms_norm_eps (1e-06 vs 1e-05)",
                "layer_types ([linear_attention, linear_attention, linear_attention, "
                "full_attention] vs [full_attention, linear_attention, linear_attention, "
                "full_attention])",
                "rope_theta (10000000 vs 10000000.5)", "tie_word_embeddings (true vs false)"}));
}

TEST(QwenConfig, AFileThatIsOnlyTheModelSectionLoadsWithDefaultsAndDerivedLayerTypes) {
  std::string text = kTinyModel;
  text = text.substr(text.find('\n') + 1);  // drop "model:"
  const std::string path = write_file("bare.yaml", text + "  full_attention_interval: 2\n");
  const absl::StatusOr<QwenConfig> c = load_qwen_config_yaml(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layer_types, (std::vector<std::string>{"linear_attention", "full_attention",
                                                      "linear_attention", "full_attention"}));
  EXPECT_DOUBLE_EQ(c->partial_rotary_factor, 0.25);
}

TEST(QwenConfig, ARunConfigsOtherSectionsAreNotReadAsModelKeys) {
  const std::string path = write_file("run.yaml", with_lines("train:\n  steps: 10\n  lr: 1e-3\n"));
  EXPECT_TRUE(load_qwen_config_yaml(path).ok());
}

TEST(QwenConfig, HuggingFaceNestedTextConfigLoads) {
  const std::string path = write_file("config.json", R"({
  "architectures": ["Qwen3_5ForConditionalGeneration"],
  "model_type": "qwen3_5",
  "tie_word_embeddings": false,
  "vision_config": {"depth": 12, "hidden_size": 768},
  "text_config": {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 256, "attention_bias": false, "attn_output_gate": true,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-06, "full_attention_interval": 4, "max_position_embeddings": 262144,
    "tie_word_embeddings": true, "mtp_num_hidden_layers": 1, "eos_token_id": 248044,
    "dtype": "bfloat16", "mlp_only_layers": [], "hidden_act": "silu",
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
                    "linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "rope_parameters": {"mrope_interleaved": true, "mrope_section": [11, 11, 10],
                        "rope_type": "default", "rope_theta": 5000000, "partial_rotary_factor": 0.5}
  }
})");
  const absl::StatusOr<QwenConfig> c = load_qwen_config(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->hidden_size, 1024);
  EXPECT_EQ(c->num_hidden_layers, 8);
  EXPECT_EQ(c->linear_num_value_heads, 32);
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c->rope_theta, 5e6);
  EXPECT_EQ(c->rotary_dim(), 128);
  EXPECT_FALSE(c->tie_word_embeddings);  // the top level wins
  EXPECT_TRUE(c->is_full_attention(7));
  EXPECT_FALSE(c->is_full_attention(6));
}

TEST(QwenConfig, HuggingFaceFlatConfigLoads) {
  const std::string path = write_file("flat_config.json", R"({
  "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
  "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 256,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
  "linear_value_head_dim": 16, "rope_theta": 10000, "partial_rotary_factor": 0.25,
  "tie_word_embeddings": true, "initializer_range": 0.01
})");
  const absl::StatusOr<QwenConfig> c = load_qwen_config_hf_json(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_DOUBLE_EQ(c->rope_theta, 1e4);
  EXPECT_DOUBLE_EQ(c->initializer_range, 0.01);
  EXPECT_TRUE(c->is_full_attention(3));
}

TEST(QwenConfig, EosTokenIdIsAnIdAListOrNothing) {
  const auto eos_of = [](const std::string& name, const std::string& line) {
    const absl::StatusOr<QwenConfig> c = load_qwen_config_yaml(write_file(name, with_lines(line)));
    EXPECT_TRUE(c.ok()) << c.status();
    return c.ok() ? c->eos_token_ids : std::vector<int64_t>{-1};
  };
  EXPECT_EQ(eos_of("eos_none.yaml", ""), std::vector<int64_t>{});
  EXPECT_EQ(eos_of("eos_null.yaml", "  eos_token_id: null\n"), std::vector<int64_t>{});
  EXPECT_EQ(eos_of("eos_one.yaml", "  eos_token_id: 10\n"), std::vector<int64_t>{10});
  EXPECT_EQ(eos_of("eos_list.yaml", "  eos_token_id: [0, 255]\n"), (std::vector<int64_t>{0, 255}));
}

TEST(QwenConfig, HuggingFaceEosTokenIdIsReadFromTextConfigOrTheTopLevel) {
  const std::string text_config = R"("hidden_size": 64, "num_hidden_layers": 4,
    "intermediate_size": 128, "vocab_size": 256, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16)";
  const std::string nested =
      write_file("eos_nested.json", "{\"eos_token_id\": 7, \"text_config\": {" + text_config +
                                        ", \"eos_token_id\": 3}}");
  const std::string top = write_file(
      "eos_top.json", "{\"eos_token_id\": [7, 8], \"text_config\": {" + text_config + "}}");
  const absl::StatusOr<QwenConfig> a = load_qwen_config_hf_json(nested);
  const absl::StatusOr<QwenConfig> b = load_qwen_config_hf_json(top);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->eos_token_ids, std::vector<int64_t>{3});
  EXPECT_EQ(b->eos_token_ids, (std::vector<int64_t>{7, 8}));
}

TEST(QwenConfig, AnEosTokenIdOutsideTheVocabularyOrOfTheWrongTypeIsAnError) {
  const std::string big = write_file("eos_big.yaml", with_lines("  eos_token_id: 256\n"));
  EXPECT_EQ(load_qwen_config_yaml(big).status().message(),
            big +
                ": model.eos_token_id: expected a token id in [0, 256) (model.vocab_size) but "
                "got 256");
  const std::string listed = write_file("eos_listed.yaml", with_lines("  eos_token_id: [1, -2]\n"));
  EXPECT_EQ(load_qwen_config_yaml(listed).status().message(),
            listed +
                ": model.eos_token_id[1]: expected a token id in [0, 256) (model.vocab_size) "
                "but got -2");
  const std::string word = write_file("eos_word.yaml", with_lines("  eos_token_id: end\n"));
  EXPECT_EQ(load_qwen_config_yaml(word).status().message(),
            word +
                ": model.eos_token_id: expected an integer or a list of integers (token ids) "
                "but got 'end'");
}

TEST(QwenConfig, AnUnknownKeyIsAnErrorNamingTheKeyAndTheFile) {
  const std::string path = write_file("unknown.yaml", with_lines("  hiden_size: 64\n"));
  EXPECT_EQ(load_qwen_config_yaml(path).status().message(),
            path + ": model.hiden_size: unknown key");
}

TEST(QwenConfig, AnUnknownHuggingFaceKeyIsAnErrorNamingTheKeyAndTheFile) {
  const std::string path =
      write_file("moe_config.json", R"({"text_config": {"hidden_size": 64, "num_experts": 8}})");
  EXPECT_EQ(load_qwen_config_hf_json(path).status().message(),
            path + ": text_config.num_experts: unknown key");
}

TEST(QwenConfig, AWrongTypeIsAnErrorNamingTheKeyTheFileAndTheValue) {
  const std::string path = write_file("type.yaml", replaced("hidden_size: 64", "hidden_size: big"));
  EXPECT_EQ(load_qwen_config_yaml(path).status().message(),
            path + ": model.hidden_size: expected an integer but got 'big'");
}

TEST(QwenConfig, AQuotedNumberIsAStringNotAnInteger) {
  const std::string path = write_file("quoted.yaml", replaced("head_dim: 16", "head_dim: \"16\""));
  EXPECT_EQ(load_qwen_config_yaml(path).status().message(),
            path + ": model.head_dim: expected an integer but got '16'");
}

TEST(QwenConfig, AWrongBooleanIsAnError) {
  const std::string path = write_file("bool.yaml", with_lines("  deterministic_mode: sometimes\n"));
  EXPECT_EQ(
      load_qwen_config_yaml(path).status().message(),
      path + ": model.deterministic_mode: expected a boolean (true or false) but got 'sometimes'");
}

TEST(QwenConfig, AMissingRequiredKeyIsAnError) {
  const std::string path = write_file("missing.yaml", replaced("  vocab_size: 256\n", ""));
  EXPECT_EQ(load_qwen_config_yaml(path).status().message(),
            path + ": model.vocab_size: required key is missing");
}

TEST(QwenConfig, ValueHeadsThatAreNotAMultipleOfKeyHeadsAreAnError) {
  const std::string path =
      write_file("heads.yaml", replaced("linear_num_value_heads: 4", "linear_num_value_heads: 3"));
  EXPECT_EQ(load_qwen_config_yaml(path).status().message(),
            path +
                ": model.linear_num_value_heads: expected a multiple of model.linear_num_key_heads "
                "(2) but got 3");
}

TEST(QwenConfig, LayerTypesOfTheWrongLengthAreAnError) {
  const std::string path = write_file(
      "layers.yaml",
      with_lines("  layer_types: [linear_attention, linear_attention, full_attention]\n"));
  EXPECT_EQ(load_qwen_config_yaml(path).status().message(),
            path + ": model.layer_types: expected 4 entries (model.num_hidden_layers) but got 3");
}

TEST(QwenConfig, AnUnknownLayerTypeIsAnError) {
  const std::string path = write_file(
      "layer_type.yaml", with_lines("  layer_types: [linear_attention, linear_attention, "
                                    "sliding_attention, full_attention]\n"));
  EXPECT_EQ(load_qwen_config_yaml(path).status().message(),
            path +
                ": model.layer_types[2]: expected linear_attention or full_attention but got "
                "'sliding_attention'");
}

TEST(QwenConfig, FullFusionLoadsWhenDeterministicModeIsOff) {
  const std::string path = write_file("full.yaml", with_lines("  pre_gdr_fusion: full\n"));
  const absl::StatusOr<QwenConfig> config = load_qwen_config_yaml(path);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->pre_gdr_fusion, PreGdrFusion::kFull);
}

TEST(QwenConfig, AnUnknownFusionLevelIsAnError) {
  const std::string path = write_file("fusion.yaml", with_lines("  pre_gdr_fusion: partial\n"));
  EXPECT_EQ(load_qwen_config_yaml(path).status().message(),
            path + ": model.pre_gdr_fusion: expected one of none, gate, full but got 'partial'");
}

// The former kernel keys of the model section (gdr_core_impl, gdr_core_prep, attention_impl)
// moved to the run config's kernels: section (the execution policy): a config without them
// loads, and one with them, whatever the value, is an error naming the new key.
TEST(QwenConfig, KernelKeysInTheModelSectionNameTheirPlaceInTheKernelsSection) {
  const std::string unset_path = write_file("core_unset.yaml", with_lines(""));
  const absl::StatusOr<QwenConfig> unset = load_qwen_config_yaml(unset_path);
  ASSERT_TRUE(unset.ok()) << unset.status();
  const std::string impl = write_file("core.yaml", with_lines("  gdr_core_impl: composite\n"));
  EXPECT_EQ(load_qwen_config_yaml(impl).status().message(),
            impl +
                ": model.gdr_core_impl: kernel choices moved to the run config's kernels: "
                "section; set kernels.gdr_core_impl instead");
  const std::string prep = write_file("prep.yaml", with_lines("  gdr_core_prep: kernel\n"));
  EXPECT_EQ(load_qwen_config_yaml(prep).status().message(),
            prep +
                ": model.gdr_core_prep: kernel choices moved to the run config's kernels: "
                "section; set kernels.gdr_core_prep instead");
  const std::string attention =
      write_file("attention.yaml", with_lines("  attention_impl: aten\n"));
  EXPECT_EQ(load_qwen_config_yaml(attention).status().message(),
            attention +
                ": model.attention_impl: kernel choices moved to the run config's "
                "kernels: section; set kernels.attention instead");
}

TEST(QwenConfig, KernelKeysInTheModelSectionAreRefusedWhateverTheirValue) {
  const std::string impl = write_file("core_bad.yaml", with_lines("  gdr_core_impl: triton\n"));
  EXPECT_EQ(load_qwen_config_yaml(impl).status().message(),
            impl +
                ": model.gdr_core_impl: kernel choices moved to the run config's kernels: "
                "section; set kernels.gdr_core_impl instead");
  const std::string prep = write_file("prep_bad.yaml", with_lines("  gdr_core_prep: kernels\n"));
  EXPECT_EQ(load_qwen_config_yaml(prep).status().message(),
            prep +
                ": model.gdr_core_prep: kernel choices moved to the run config's kernels: "
                "section; set kernels.gdr_core_prep instead");
  const std::string attention =
      write_file("attention_bad.yaml", with_lines("  attention_impl: flash\n"));
  EXPECT_EQ(load_qwen_config_yaml(attention).status().message(),
            attention +
                ": model.attention_impl: kernel choices moved to the run config's "
                "kernels: section; set kernels.attention instead");
}

TEST(QwenConfig, AHuggingFaceModelWithAttentionBiasIsRejected) {
  const std::string path = write_file("bias_config.json", R"({"attention_bias": true})");
  EXPECT_EQ(load_qwen_config_hf_json(path).status().message(),
            path + ": attention_bias: expected false (the only variant gdr builds) but got true");
}

TEST(QwenConfig, AMissingFileIsNotFound) {
  const absl::StatusOr<QwenConfig> c = load_qwen_config("/nonexistent/model.yaml");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(), "/nonexistent/model.yaml: cannot open the config file");
}

}  // namespace
}  // namespace gdr
