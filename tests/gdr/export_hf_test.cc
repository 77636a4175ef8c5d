// The Hugging Face hand-off both ways: train.init_from (a run starts from HF weights) and
// export_hf (a training checkpoint becomes an HF directory). Checked bit for bit against the
// trainer's FP32 masters; transformers' side is tools/hf/check_export.py (README).
#include "gdr/export_hf.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "gdr/checkpoint.h"
#include "io/safetensors.h"
#include "models/qwen/config.h"
#include "models/qwen/hf_checkpoint.h"
#include "models/qwen/model.h"
#include "tests/gdr/trainer_test_util.h"

namespace gdr {
namespace {

using testing_util::bytes_equal;
using testing_util::make_trainer;
using testing_util::run_steps;
using testing_util::scratch_dir;
using testing_util::tiny_run_config;

io::NamedTensors read_weights(const std::string& file) {
  absl::StatusOr<io::SafetensorsContents> c = io::read_safetensors(file);
  EXPECT_TRUE(c.ok()) << c.status();
  return c.ok() ? c->tensors : io::NamedTensors{};
}

io::NamedTensors sorted(io::NamedTensors t) {
  std::sort(t.begin(), t.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  return t;
}

io::NamedTensors cast(const io::NamedTensors& t, at::ScalarType dtype) {
  io::NamedTensors out;
  for (const auto& [name, x] : t) out.emplace_back(name, x.to(dtype));
  return out;
}

// One run trained two steps with a checkpoint, shared by the suite.
class ExportHfTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    checkpoint_dir_ = new std::string(scratch_dir("export_ckpt"));
    auto trainer = make_trainer(tiny_run_config());
    run_steps(*trainer, 2);
    ASSERT_TRUE(trainer->save_checkpoint(checkpoint_step_dir(*checkpoint_dir_, 2)).ok());
    masters_ = new io::NamedTensors(trainer->master_parameters());
  }
  static void TearDownTestSuite() {
    delete checkpoint_dir_;
    delete masters_;
  }
  static std::string* checkpoint_dir_;
  static io::NamedTensors* masters_;
};
std::string* ExportHfTest::checkpoint_dir_ = nullptr;
io::NamedTensors* ExportHfTest::masters_ = nullptr;

TEST_F(ExportHfTest, Fp32ExportHoldsTheMastersBitForBitUnderHfNames) {
  const std::string out = scratch_dir("export_fp32");
  ExportHfOptions options;
  options.dtype = at::kFloat;
  absl::StatusOr<ExportHfReport> report = export_hf_checkpoint(*checkpoint_dir_, out, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_EQ(report->step, 2);
  EXPECT_EQ(report->step_dir, checkpoint_step_dir(*checkpoint_dir_, 2));
  EXPECT_EQ(report->tensors, static_cast<int64_t>(masters_->size()));
  EXPECT_TRUE(report->copied_files.empty());
  EXPECT_TRUE(bytes_equal(sorted(read_weights(out + "/model.safetensors")), sorted(*masters_)));
  EXPECT_FALSE(std::filesystem::exists(out + ".partial"));

  absl::StatusOr<QwenConfig> written = load_qwen_config_hf_json(out + "/config.json");
  ASSERT_TRUE(written.ok()) << written.status();
  EXPECT_TRUE(qwen_config_differences(written.value(), tiny_run_config().model).empty());
}

TEST_F(ExportHfTest, Bf16ExportIsTheMastersRoundedAndItsLogitsAreRecorded) {
  const std::string out = scratch_dir("export_bf16");
  const std::string logits_file = scratch_dir("export_bf16_logits.safetensors");
  ExportHfOptions options;  // bf16 by default
  options.reference_logits_path = logits_file;
  absl::StatusOr<ExportHfReport> report = export_hf_checkpoint(*checkpoint_dir_, out, options);
  ASSERT_TRUE(report.ok()) << report.status();
  EXPECT_TRUE(bytes_equal(sorted(read_weights(out + "/model.safetensors")),
                          sorted(cast(*masters_, at::kBFloat16))));
  std::ifstream config(out + "/config.json");
  const std::string text((std::istreambuf_iterator<char>(config)), {});
  EXPECT_NE(text.find("\"dtype\": \"bfloat16\""), std::string::npos) << text;

  // The recorded logits are the FP32 model's on the written (rounded) weights.
  const QwenConfig model_config = tiny_run_config().model;
  QwenForCausalLM model(model_config);
  ASSERT_TRUE(load_hf_checkpoint(*model, out).ok());
  const io::NamedTensors recorded = read_weights(logits_file);
  ASSERT_EQ(recorded.size(), 2u);
  const at::Tensor ids = recorded[0].first == "input_ids" ? recorded[0].second : recorded[1].second;
  const at::Tensor logits = recorded[0].first == "logits" ? recorded[0].second : recorded[1].second;
  EXPECT_EQ(ids.sizes(), (at::IntArrayRef{kReferenceBatchRows, kReferenceBatchTokens}));
  at::NoGradGuard no_grad;
  EXPECT_TRUE(at::equal(model->forward(ids), logits));
}

TEST_F(ExportHfTest, RefusesANonEmptyOutputAndACorruptedCheckpoint) {
  const std::string out = scratch_dir("export_busy");
  std::filesystem::create_directories(out);
  std::ofstream(out + "/keep.txt") << "mine";
  absl::StatusOr<ExportHfReport> busy = export_hf_checkpoint(*checkpoint_dir_, out);
  EXPECT_EQ(busy.status().message(),
            out +
                ": --output exists and is not empty; name a new directory (nothing is "
                "overwritten)");
  EXPECT_TRUE(std::filesystem::exists(out + "/keep.txt"));

  const std::string copy = scratch_dir("export_corrupt");
  std::filesystem::copy(*checkpoint_dir_, copy, std::filesystem::copy_options::recursive);
  const std::string model_file = checkpoint_step_dir(copy, 2) + "/model.safetensors";
  {
    std::fstream f(model_file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x7f');
  }
  absl::StatusOr<ExportHfReport> corrupt = export_hf_checkpoint(copy, scratch_dir("export_c"));
  EXPECT_EQ(corrupt.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_NE(corrupt.status().message().find(model_file + ": checksum mismatch"), std::string::npos)
      << corrupt.status();
  EXPECT_FALSE(std::filesystem::exists(scratch_dir("export_c")));
}

TEST_F(ExportHfTest, InitFromStartsARunFromTheExportedWeights) {
  const std::string out = scratch_dir("export_for_init");
  ExportHfOptions options;
  options.dtype = at::kFloat;
  ASSERT_TRUE(export_hf_checkpoint(*checkpoint_dir_, out, options).ok());
  std::ofstream(out + "/generation_config.json") << "{\"eos_token_id\": 1}\n";

  // A fresh run started from the export holds the exported weights before its first step
  // (a different seed: nothing comes from the reference init).
  auto started = make_trainer(tiny_run_config({{"train.init_from", out}, {"train.seed", "7"}}));
  EXPECT_TRUE(bytes_equal(started->master_parameters(), *masters_));

  // Its own export copies the companion files of the directory it started from.
  run_steps(*started, 1);
  const std::string second_ckpt = scratch_dir("export_second_ckpt");
  ASSERT_TRUE(started->save_checkpoint(checkpoint_step_dir(second_ckpt, 1)).ok());
  absl::StatusOr<ExportHfReport> again =
      export_hf_checkpoint(second_ckpt, scratch_dir("export_second"));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->copied_files, std::vector<std::string>{"generation_config.json"});
}

TEST_F(ExportHfTest, InitFromRefusesADifferentModelNamingTheKeys) {
  const std::string out = scratch_dir("export_for_mismatch");
  ASSERT_TRUE(export_hf_checkpoint(*checkpoint_dir_, out).ok());
  const RunConfig other = tiny_run_config(
      {{"train.init_from", out}, {"model.intermediate_size", "96"}, {"model.rope_theta", "10000"}});
  absl::StatusOr<std::unique_ptr<Trainer>> refused = Trainer::create(other);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(refused.status().message()),
            "configs/train_tiny.yaml: train.init_from: " + out +
                "/config.json: the checkpoint's model differs from the run's in "
                "intermediate_size (96 vs 128), rope_theta (10000 vs 10000000) (the run's value "
                "first)");

  absl::StatusOr<std::unique_ptr<Trainer>> missing =
      Trainer::create(tiny_run_config({{"train.init_from", out + "/model.safetensors.x"}}));
  EXPECT_EQ(missing.status().message(), "configs/train_tiny.yaml: train.init_from: " + out +
                                            "/model.safetensors.x: no such file or directory");
  std::filesystem::remove(out + "/config.json");
  absl::StatusOr<std::unique_ptr<Trainer>> no_config =
      Trainer::create(tiny_run_config({{"train.init_from", out + "/model.safetensors"}}));
  EXPECT_EQ(no_config.status().message(),
            "configs/train_tiny.yaml: train.init_from: " + out +
                "/model.safetensors: no config.json beside the weights (expected " + out +
                "/config.json)");
}

}  // namespace
}  // namespace gdr
