// HF checkpoint exchange of the tiny model: bit-exact round trips (single file, shards,
// BF16), the multimodal name layout, and refusals that name the tensors at fault.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>

#include "io/safetensors.h"
#include "models/qwen/config.h"
#include "models/qwen/hf_checkpoint.h"
#include "models/qwen/model.h"

namespace gdr {
namespace {

QwenConfig tiny() {
  auto config = load_qwen_config("configs/tiny.yaml");
  EXPECT_TRUE(config.ok()) << config.status();
  return *config;
}

std::string fresh_dir(const std::string& name) {
  const std::string dir = testing::TempDir() + "/" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

void expect_same_parameters(QwenForCausalLMImpl& x, QwenForCausalLMImpl& y) {
  auto px = x.named_parameters(), py = y.named_parameters();
  ASSERT_EQ(px.size(), py.size());
  for (const auto& item : px) {
    const at::Tensor& other = py[item.key()];
    EXPECT_TRUE(at::equal(item.value(), other)) << item.key();
  }
}

TEST(HfCheckpoint, SingleFileRoundTripIsBitExact) {
  QwenForCausalLM source(tiny()), target(tiny());
  init_qwen_weights(*source, 1);
  init_qwen_weights(*target, 2);
  const std::string dir = fresh_dir("single");
  ASSERT_TRUE(save_hf_checkpoint(*source, dir).ok());
  ASSERT_TRUE(std::filesystem::exists(dir + "/model.safetensors"));
  auto report = load_hf_checkpoint(*target, dir);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->loaded, static_cast<int64_t>(source->parameters().size()));
  expect_same_parameters(*source, *target);
}

TEST(HfCheckpoint, ConfigJsonRoundTripsThroughTheHfLoader) {
  QwenForCausalLM source(tiny());
  const std::string dir = fresh_dir("config_json");
  ASSERT_TRUE(save_hf_checkpoint(*source, dir).ok());
  auto loaded = load_qwen_config_hf_json(dir + "/config.json");
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  const QwenConfig& a = source->config();
  const QwenConfig& b = *loaded;
  EXPECT_EQ(b.hidden_size, a.hidden_size);
  EXPECT_EQ(b.num_hidden_layers, a.num_hidden_layers);
  EXPECT_EQ(b.intermediate_size, a.intermediate_size);
  EXPECT_EQ(b.vocab_size, a.vocab_size);
  EXPECT_EQ(b.num_attention_heads, a.num_attention_heads);
  EXPECT_EQ(b.num_key_value_heads, a.num_key_value_heads);
  EXPECT_EQ(b.head_dim, a.head_dim);
  EXPECT_EQ(b.linear_num_key_heads, a.linear_num_key_heads);
  EXPECT_EQ(b.linear_num_value_heads, a.linear_num_value_heads);
  EXPECT_EQ(b.linear_key_head_dim, a.linear_key_head_dim);
  EXPECT_EQ(b.linear_value_head_dim, a.linear_value_head_dim);
  EXPECT_EQ(b.layer_types, a.layer_types);
  EXPECT_EQ(b.rope_theta, a.rope_theta);
  EXPECT_EQ(b.partial_rotary_factor, a.partial_rotary_factor);
  EXPECT_EQ(b.rms_norm_eps, a.rms_norm_eps);
  EXPECT_EQ(b.tie_word_embeddings, a.tie_word_embeddings);
}

TEST(HfCheckpoint, ShardedRoundTripIsBitExact) {
  QwenForCausalLM source(tiny()), target(tiny());
  init_qwen_weights(*source, 3);
  const std::string dir = fresh_dir("sharded");
  HfSaveOptions options;
  options.max_shard_bytes = 64 * 1024;
  ASSERT_TRUE(save_hf_checkpoint(*source, dir, options).ok());
  ASSERT_TRUE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  ASSERT_TRUE(load_hf_checkpoint(*target, dir).ok());
  expect_same_parameters(*source, *target);
}

TEST(HfCheckpoint, Bf16CheckpointLoadsIntoAnFp32ModelAsTheRoundedValues) {
  QwenForCausalLM source(tiny()), target(tiny());
  init_qwen_weights(*source, 4);
  const std::string dir = fresh_dir("bf16");
  HfSaveOptions options;
  options.dtype = at::kBFloat16;
  ASSERT_TRUE(save_hf_checkpoint(*source, dir, options).ok());
  auto header = io::read_safetensors_header(dir + "/model.safetensors");
  ASSERT_TRUE(header.ok());
  EXPECT_EQ(header->entries[0].spec.dtype, at::kBFloat16);
  ASSERT_TRUE(load_hf_checkpoint(*target, dir).ok());
  auto params = target->named_parameters();
  for (const auto& item : source->named_parameters()) {
    EXPECT_TRUE(at::equal(params[item.key()], item.value().to(at::kBFloat16).to(at::kFloat)))
        << item.key();
  }
}

TEST(HfCheckpoint, ReadsTheMultimodalLayoutAndSkipsTheVisionTower) {
  QwenForCausalLM source(tiny()), target(tiny());
  init_qwen_weights(*source, 5);
  io::NamedTensors tensors;
  for (const auto& item : source->named_parameters()) {
    std::string name = item.key();
    if (name.rfind("model.", 0) == 0) name = "model.language_model." + name.substr(6);
    tensors.emplace_back(name, item.value().detach());
  }
  tensors.emplace_back("model.visual.patch_embed.weight", at::zeros({2, 2}));
  tensors.emplace_back("mtp.fc.weight", at::zeros({2, 2}));
  const std::string dir = fresh_dir("multimodal");
  std::filesystem::create_directories(dir);
  ASSERT_TRUE(io::write_safetensors(dir + "/model.safetensors", tensors).ok());
  auto report = load_hf_checkpoint(*target, dir);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->skipped, 2);
  expect_same_parameters(*source, *target);
}

TEST(HfCheckpoint, MissingAndMisshapenTensorsAreRefusedAndNothingIsModified) {
  QwenForCausalLM source(tiny()), target(tiny());
  init_qwen_weights(*source, 6);
  init_qwen_weights(*target, 7);
  io::NamedTensors tensors;
  for (const auto& item : source->named_parameters()) {
    if (item.key() == "model.norm.weight") continue;
    at::Tensor t = item.value().detach();
    if (item.key() == "model.layers.0.linear_attn.A_log") t = at::zeros({3});
    tensors.emplace_back(item.key(), t);
  }
  const std::string dir = fresh_dir("broken");
  std::filesystem::create_directories(dir);
  const std::string file = dir + "/model.safetensors";
  ASSERT_TRUE(io::write_safetensors(file, tensors).ok());
  const at::Tensor before = target->named_parameters()["model.layers.1.mlp.up_proj.weight"].clone();
  auto report = load_hf_checkpoint(*target, file);
  ASSERT_FALSE(report.ok());
  const std::string message(report.status().message());
  EXPECT_NE(message.find(file + ": tensors do not match the expected set:"), std::string::npos)
      << message;
  EXPECT_NE(message.find("model.norm.weight"), std::string::npos) << message;
  EXPECT_NE(message.find("model.layers.0.linear_attn.A_log: expected F32 [4], got F32 [3]"),
            std::string::npos)
      << message;
  EXPECT_TRUE(at::equal(before, target->named_parameters()["model.layers.1.mlp.up_proj.weight"]));
}

}  // namespace
}  // namespace gdr
