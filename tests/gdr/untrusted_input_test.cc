// No untrusted file can crash a run: every reader of user files (safetensors and its index
// JSON, a Hugging Face config.json, a run config YAML, a Megatron .idx/.bin pair, a
// checkpoint directory) gets thousands of deterministic mutations of a valid file (bit
// flips, truncations, inserted and deleted bytes, and, for the JSON / YAML texts, numbers and
// strings swapped for hostile ones). Each read must either succeed or return a Status whose
// message names the file; an exception escaping a reader fails the test, as does a crash or,
// under `--config=asan`, a memory error. The mutations bite: most reads of a mutated
// safetensors header or checkpoint are refused.
#include <ATen/ops/arange.h>
#include <ATen/ops/ones.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gdr/checkpoint.h"
#include "gdr/run_config.h"
#include "io/indexed_dataset.h"
#include "io/safetensors.h"
#include "models/qwen/config.h"
#include "tests/io/test_files.h"

namespace gdr {
namespace {

using io::read_bytes;
using io::test_dir;
using io::write_bytes;

constexpr int kMutationsPerFile = 2000;

// Numbers and strings a hostile file may carry in place of a JSON / YAML token.
const char* const kHostileTokens[] = {"6e792",
                                      "-1",
                                      "1e20",
                                      "18446744073709551616",
                                      "-9223372036854775809",
                                      "NaN",
                                      "[]",
                                      "{}",
                                      "null",
                                      "\"\\ud800\"",
                                      "0.5",
                                      "true",
                                      "\"\xff\xfe\"",
                                      "1e-400",
                                      "[[[[[[[[1]]]]]]]]"};

// One deterministic mutation of `bytes`; the kind cycles so every kind runs often.
std::string mutate(const std::string& bytes, int index, std::mt19937_64& rng) {
  std::string m = bytes;
  auto position = [&](size_t size) { return size == 0 ? 0 : static_cast<size_t>(rng() % size); };
  switch (index % 6) {
    case 0:  // flip one to three bits
      for (int i = 0, n = 1 + static_cast<int>(rng() % 3); i < n && !m.empty(); ++i) {
        m[position(m.size())] ^= static_cast<char>(1 << (rng() % 8));
      }
      break;
    case 1:  // truncate
      m.resize(position(m.size()));
      break;
    case 2:  // insert a few bytes
      m.insert(position(m.size() + 1), std::string(1 + rng() % 4, static_cast<char>(rng())));
      break;
    case 3:  // delete a few bytes
      if (!m.empty()) m.erase(position(m.size()), 1 + rng() % 4);
      break;
    default: {  // replace a number or a quoted string of the text with a hostile token
      std::vector<size_t> starts;
      for (size_t i = 0; i < m.size(); ++i) {
        const bool digit = m[i] >= '0' && m[i] <= '9' && (i == 0 || !isalnum(m[i - 1]));
        if (digit || m[i] == '"') starts.push_back(i);
      }
      if (starts.empty()) break;
      const size_t begin = starts[position(starts.size())];
      size_t end = begin + 1;
      if (m[begin] == '"') {
        while (end < m.size() && m[end] != '"') ++end;
        end = std::min(m.size(), end + 1);
      } else {
        while (end < m.size() && (isalnum(m[end]) || m[end] == '.' || m[end] == '-')) ++end;
      }
      const std::string token = kHostileTokens[rng() % std::size(kHostileTokens)];
      m.replace(begin, end - begin, token);
      break;
    }
  }
  // A text without a number or a string to replace (COMPLETE's digest may start with a
  // letter): flip a bit instead, so every mutation changes the file.
  if (m == bytes && !m.empty()) m[position(m.size())] ^= 1;
  return m;
}

struct Outcome {
  int ok = 0;
  int refused = 0;
};

// Writes kMutationsPerFile mutations of `original` to `path` in turn and calls `read` on
// each (with `path` mutated, `named` is what its messages must name).
Outcome read_mutations(const std::string& path, const std::string& original,
                       const std::string& named, uint64_t seed,
                       const std::function<absl::Status()>& read) {
  std::mt19937_64 rng(seed);
  Outcome outcome;
  for (int i = 0; i < kMutationsPerFile; ++i) {
    write_bytes(path, mutate(original, i, rng));
    absl::Status status;
    try {
      status = read();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "mutation " << i << " of " << path << ": an exception escaped: " << e.what();
      continue;
    } catch (...) {
      ADD_FAILURE() << "mutation " << i << " of " << path << ": a non-std exception escaped";
      continue;
    }
    if (status.ok()) {
      ++outcome.ok;
    } else {
      ++outcome.refused;
      EXPECT_NE(status.message().find(named), std::string::npos)
          << "mutation " << i << ": the error does not name " << named << ": " << status;
    }
  }
  write_bytes(path, original);
  return outcome;
}

io::NamedTensors small_tensors() {
  return {{"model.embed_tokens.weight", at::arange(24, at::kFloat).reshape({4, 6})},
          {"model.norm.weight", at::ones({6}, at::kBFloat16)},
          {"step", at::arange(3, at::kLong)}};
}

TEST(UntrustedInput, SafetensorsReadersReturnAStatusForAnyMutation) {
  const std::string dir = test_dir();
  const std::string path = dir + "/model.safetensors";
  ASSERT_TRUE(io::write_safetensors(path, small_tensors(), {{"format", "pt"}}).ok());
  const std::string original = read_bytes(path);
  const Outcome full =
      read_mutations(path, original, path, 1, [&] { return io::read_safetensors(path).status(); });
  const Outcome header = read_mutations(path, original, path, 2,
                                        [&] { return io::read_safetensors_header(path).status(); });
  EXPECT_GT(full.refused, kMutationsPerFile / 2) << "ok " << full.ok;
  EXPECT_GT(header.refused, kMutationsPerFile / 3) << "ok " << header.ok;
}

TEST(UntrustedInput, AHeaderNumberThatOverflowsADoubleIsRefused) {
  const std::string dir = test_dir();
  const std::string path = dir + "/model.safetensors";
  ASSERT_TRUE(io::write_safetensors(path, small_tensors()).ok());
  std::string bytes = read_bytes(path);
  const size_t at = bytes.find("[4,6]");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 5, "[6e792]");  // the header's length prefix stays; the JSON grows
  // Keep the declared header length consistent so the JSON parser sees the number.
  uint64_t header_size = 0;
  for (int i = 7; i >= 0; --i) header_size = header_size << 8 | static_cast<uint8_t>(bytes[i]);
  header_size += 2;
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(header_size >> (8 * i));
  write_bytes(path, bytes);
  const absl::Status status = io::read_safetensors(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  EXPECT_EQ(status.message().substr(0, path.size()), path) << status;
}

TEST(UntrustedInput, TheShardIndexReaderReturnsAStatusForAnyMutation) {
  const std::string dir = test_dir();
  ASSERT_TRUE(io::write_safetensors_sharded(dir, small_tensors(), 64).ok());
  const std::string index = dir + "/model.safetensors.index.json";
  const Outcome outcome = read_mutations(
      index, read_bytes(index), dir, 3, [&] { return io::read_safetensors_sharded(dir).status(); });
  EXPECT_GT(outcome.refused, kMutationsPerFile / 3) << "ok " << outcome.ok;
}

constexpr char kHfConfig[] = R"({
  "architectures": ["Qwen3_5ForCausalLM"],
  "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128, "vocab_size": 256,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
  "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
  "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-06,
  "full_attention_interval": 4, "rope_theta": 10000000, "partial_rotary_factor": 0.25,
  "tie_word_embeddings": true, "hidden_act": "silu", "max_position_embeddings": 262144,
  "initializer_range": 0.02, "bos_token_id": 255, "eos_token_id": 255
})";

TEST(UntrustedInput, TheConfigJsonReaderReturnsAStatusForAnyMutation) {
  const std::string path = test_dir() + "/config.json";
  write_bytes(path, kHfConfig);
  ASSERT_TRUE(load_qwen_config_hf_json(path).ok()) << load_qwen_config_hf_json(path).status();
  const Outcome outcome = read_mutations(path, kHfConfig, path, 4,
                                         [&] { return load_qwen_config_hf_json(path).status(); });
  EXPECT_GT(outcome.refused, kMutationsPerFile / 3) << "ok " << outcome.ok;
}

TEST(UntrustedInput, TheRunConfigReaderReturnsAStatusForAnyMutation) {
  const std::string path = test_dir() + "/run.yaml";
  const std::string original = read_bytes("configs/train_tiny.yaml");
  ASSERT_FALSE(original.empty());
  write_bytes(path, original);
  ASSERT_TRUE(load_run_config(path).ok()) << load_run_config(path).status();
  // Errors of --set style are named by the override, not the file: none here.
  const Outcome outcome =
      read_mutations(path, original, path, 5, [&] { return load_run_config(path).status(); });
  EXPECT_GT(outcome.refused, kMutationsPerFile / 5) << "ok " << outcome.ok;
}

TEST(UntrustedInput, TheIndexedDatasetReaderReturnsAStatusForAnyMutation) {
  const std::string prefix = test_dir() + "/corpus";
  absl::StatusOr<io::IndexedDatasetBuilder> builder =
      io::IndexedDatasetBuilder::create(prefix, io::TokenDType::kUInt16);
  ASSERT_TRUE(builder.ok()) << builder.status();
  for (int64_t doc = 0; doc < 5; ++doc) {
    for (int64_t seq = 0; seq < 3; ++seq) {
      std::vector<int64_t> tokens(static_cast<size_t>(7 + doc + seq));
      for (size_t t = 0; t < tokens.size(); ++t) tokens[t] = static_cast<int64_t>(t * 31 + doc);
      ASSERT_TRUE(builder->add_item(tokens).ok());
    }
    builder->end_document();
  }
  ASSERT_TRUE(builder->finalize().ok());
  // Opening and then reading every sequence: a mutated index must not send a read outside
  // the .bin file.
  auto open_and_read = [&]() -> absl::Status {
    absl::StatusOr<io::IndexedDataset> ds = io::IndexedDataset::open(prefix);
    if (!ds.ok()) return ds.status();
    for (int64_t i = 0; i < ds->num_sequences(); ++i) {
      if (absl::StatusOr<std::vector<int64_t>> s = ds->sequence(i); !s.ok()) return s.status();
    }
    return absl::OkStatus();
  };
  ASSERT_TRUE(open_and_read().ok());
  const std::string idx = io::idx_path_of(prefix), bin = io::bin_path_of(prefix);
  const Outcome index = read_mutations(idx, read_bytes(idx), prefix, 6, open_and_read);
  const Outcome data = read_mutations(bin, read_bytes(bin), prefix, 7, open_and_read);
  EXPECT_GT(index.refused, kMutationsPerFile / 3) << "ok " << index.ok;
  EXPECT_GT(data.refused, kMutationsPerFile / 10) << "ok " << data.ok;  // truncations
}

TEST(UntrustedInput, TheCheckpointReaderReturnsAStatusForAnyMutation) {
  const std::string dir = test_dir() + "/step_1";
  Checkpoint checkpoint;
  checkpoint.model = small_tensors();
  checkpoint.state.step = 1;
  checkpoint.state.rng_cpu_hex = "00ff";
  checkpoint.state.config_text = "model: {}\n";
  checkpoint.state.execution_policy = "rms_norm=fused";
  ASSERT_TRUE(write_checkpoint(dir, checkpoint).ok());
  ASSERT_TRUE(read_checkpoint(dir).ok());
  int refused = 0;
  for (const char* file : {"state.json", "COMPLETE", "model.safetensors"}) {
    const std::string path = dir + "/" + file;
    const Outcome outcome = read_mutations(path, read_bytes(path), dir, 8,
                                           [&] { return read_checkpoint(dir).status(); });
    refused += outcome.refused;
  }
  EXPECT_GT(refused, 3 * kMutationsPerFile * 9 / 10);  // digests catch nearly every change
}

}  // namespace
}  // namespace gdr
