// Run config loading: the checked-in configs, defaults, --set overrides, and the exact
// error messages for unknown keys, wrong types and bad values.
#include "gdr/run_config.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace gdr {
namespace {

constexpr char kModelSection[] = R"(model:
  hidden_size: 64
  num_hidden_layers: 2
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

std::string write_config(const std::string& name, const std::string& text) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(RunConfigTest, LoadsTheTinyTrainingConfig) {
  const absl::StatusOr<RunConfig> c = load_run_config("configs/train_tiny.yaml");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->model.hidden_size, 64);
  EXPECT_TRUE(c->model.deterministic_mode);
  EXPECT_EQ(c->data.source, DataSource::kEmbedded);
  EXPECT_EQ(c->data.path, "data/corpus.txt");
  EXPECT_EQ(c->data.seq_len, 64);
  EXPECT_EQ(c->data.micro_batch_size, 4);
  EXPECT_DOUBLE_EQ(c->optimizer.lr, 3e-3);
  EXPECT_EQ(c->optimizer.impl, OptimizerImpl::kFused);  // the default
  EXPECT_DOUBLE_EQ(c->optimizer.beta2, 0.95);
  EXPECT_EQ(c->train.grad_accum, 2);
  EXPECT_EQ(c->train.steps, 30);
  EXPECT_EQ(c->schedule_total_steps(), 30);
  EXPECT_EQ(c->train.dtype, TrainDtype::kFloat32);
  EXPECT_EQ(c->train.on_nonfinite, OnNonfinite::kStop);
  EXPECT_NE(c->config_text.find("grad_accum: 2"), std::string::npos);
}

TEST(RunConfigTest, MissingSectionsKeepTheirDefaults) {
  const std::string path = write_config("model_only.yaml", kModelSection);
  const absl::StatusOr<RunConfig> c = load_run_config(path);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train.steps, TrainConfig().steps);
  EXPECT_EQ(c->data.seq_len, DataConfig().seq_len);
  EXPECT_EQ(c->model.num_hidden_layers, 2);
}

TEST(RunConfigTest, OverridesAreTypedByTheSchema) {
  const absl::StatusOr<RunConfig> c =
      load_run_config("configs/train_tiny.yaml", {{"train.steps", "5"},
                                                  {"optimizer.betas", "[0.8, 0.99]"},
                                                  {"train.dtype", "bf16"},
                                                  {"model.hidden_size", "32"},
                                                  {"train.metrics_path", "runs/m.jsonl"}});
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->train.steps, 5);
  EXPECT_DOUBLE_EQ(c->optimizer.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c->optimizer.beta2, 0.99);
  EXPECT_EQ(c->train.dtype, TrainDtype::kBFloat16);
  EXPECT_EQ(c->model.hidden_size, 32);
  EXPECT_EQ(c->train.metrics_path, "runs/m.jsonl");
  EXPECT_NE(c->config_text.find("steps: 5"), std::string::npos);
  EXPECT_TRUE(c->train.cuda_graphs);             // the default
  EXPECT_FALSE(c->train.shard_optimizer_state);  // the default
  const absl::StatusOr<RunConfig> eager =
      load_run_config("configs/train_tiny.yaml", {{"train.cuda_graphs", "false"}});
  ASSERT_TRUE(eager.ok()) << eager.status();
  EXPECT_FALSE(eager->train.cuda_graphs);
}

TEST(RunConfigTest, ParsesOverrideFlags) {
  const absl::StatusOr<ConfigOverride> o = parse_config_override("train.steps=5");
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->path, "train.steps");
  EXPECT_EQ(o->value, "5");
  EXPECT_EQ(parse_config_override("steps=5").status().message(),
            "--set steps=5: expected section.key=value, e.g. --set=train.steps=5");
  EXPECT_EQ(parse_config_override("train.steps").status().message(),
            "--set train.steps: expected section.key=value, e.g. --set=train.steps=5");
}

struct ErrorCase {
  const char* name;
  std::string extra_yaml;  // appended after the model section
  std::vector<ConfigOverride> overrides;
  std::string expected;  // "$" stands for the file path
};

class RunConfigErrorTest : public testing::TestWithParam<ErrorCase> {};

TEST_P(RunConfigErrorTest, NamesTheKeyAndTheFile) {
  const ErrorCase& c = GetParam();
  const std::string path =
      write_config(std::string(c.name) + ".yaml", kModelSection + c.extra_yaml);
  const absl::StatusOr<RunConfig> loaded = load_run_config(path, c.overrides);
  ASSERT_FALSE(loaded.ok());
  std::string expected = c.expected;
  if (const size_t at = expected.find('$'); at != std::string::npos) expected.replace(at, 1, path);
  EXPECT_EQ(loaded.status().message(), expected);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RunConfigErrorTest,
    testing::Values(
        ErrorCase{"unknown_key", "train:\n  stepz: 3\n", {}, "$: train.stepz: unknown key"},
        ErrorCase{"unknown_section", "trainer:\n  steps: 3\n", {}, "$: trainer: unknown section"},
        ErrorCase{"wrong_type",
                  "train:\n  steps: many\n",
                  {},
                  "$: train.steps: expected an integer but got 'many'"},
        ErrorCase{"quoted_number",
                  "train:\n  steps: \"3\"\n",
                  {},
                  "$: train.steps: expected an integer but got '3'"},
        ErrorCase{"bad_choice",
                  "train:\n  dtype: fp16\n",
                  {},
                  "$: train.dtype: expected one of fp32, bf16 but got 'fp16'"},
        ErrorCase{"bad_optimizer_impl",
                  "optimizer:\n  impl: adam\n",
                  {},
                  "$: optimizer.impl: expected one of fused, loop but got 'adam'"},
        ErrorCase{"bad_cuda_graphs",
                  "train:\n  cuda_graphs: sometimes\n",
                  {},
                  "$: train.cuda_graphs: expected one of false, true but got 'sometimes'"},
        ErrorCase{"bad_shard_optimizer_state",
                  "train:\n  shard_optimizer_state: maybe\n",
                  {},
                  "$: train.shard_optimizer_state: expected one of false, true but got 'maybe'"},
        ErrorCase{"bad_nonfinite",
                  "train:\n  on_nonfinite: ignore\n",
                  {},
                  "$: train.on_nonfinite: expected one of stop, skip but got 'ignore'"},
        ErrorCase{"betas_not_a_pair",
                  "optimizer:\n  betas: 0.9\n",
                  {},
                  "$: optimizer.betas: expected a list of two numbers but got '0.9'"},
        ErrorCase{"beta_out_of_range",
                  "optimizer:\n  betas: [0.9, 1.0]\n",
                  {},
                  "$: optimizer.betas[1]: expected a number in [0, 1) but got 1"},
        ErrorCase{"zero_seq_len",
                  "data:\n  seq_len: 0\n",
                  {},
                  "$: data.seq_len: expected an integer >= 1 but got 0"},
        ErrorCase{"indexed_without_prefix",
                  "data:\n  source: indexed\n",
                  {},
                  "$: data.prefix: required when data.source is indexed"},
        ErrorCase{
            "section_not_a_mapping", "train: 3\n", {}, "$: train: expected a mapping but got '3'"},
        ErrorCase{"model_error_passes_through",
                  "",
                  {{"model.hidden_size", "abc"}},
                  "$: model.hidden_size: expected an integer but got 'abc'"},
        ErrorCase{"model_unknown_key_via_set",
                  "",
                  {{"model.hiden_size", "3"}},
                  "$: model.hiden_size: unknown key"},
        ErrorCase{"override_wrong_type",
                  "",
                  {{"train.steps", "x"}},
                  "$: train.steps: expected an integer but got 'x'"},
        ErrorCase{"override_unknown_key",
                  "",
                  {{"train.stepz", "5"}},
                  "--set train.stepz=5: train.stepz: unknown key"},
        ErrorCase{"bad_kernel_choice",
                  "kernels:\n  rms_norm: fast\n",
                  {},
                  "$: kernels.rms_norm: expected fused or composite, but got 'fast'"},
        ErrorCase{"unknown_kernel_key",
                  "kernels:\n  rms_norms: fused\n",
                  {},
                  "$: kernels.rms_norms: unknown key"},
        ErrorCase{"bad_kernel_tile_via_set",
                  "",
                  {{"kernels.pre_gdr_gate_tile", "128x16"}},
                  "$: kernels.pre_gdr_gate_tile: expected auto or a tile BLOCK_TxBLOCK_HxTHREADS "
                  "of positive integers (e.g. 128x16x256), but got '128x16'"},
        ErrorCase{"kernel_key_in_the_model_section",
                  "",
                  {{"model.attention_impl", "aten"}},
                  "$: model.attention_impl: kernel choices moved to the run config's kernels: "
                  "section; set kernels.attention instead"},
        ErrorCase{"eval_without_a_validation_set",
                  "train:\n  eval_every: 5\n",
                  {},
                  "$: train.eval_every: evaluation needs a validation set: set "
                  "data.valid_fraction, data.valid_path or data.valid_prefix"},
        ErrorCase{"two_validation_sets",
                  "data:\n  valid_fraction: 0.1\n  valid_path: v.txt\n",
                  {},
                  "$: data.valid_fraction: set one of data.valid_fraction, data.valid_path and "
                  "data.valid_prefix"},
        ErrorCase{"valid_fraction_out_of_range",
                  "data:\n  valid_fraction: 0.7\n",
                  {},
                  "$: data.valid_fraction: expected a number in [0, 0.5] but got 0.7"},
        ErrorCase{"valid_prefix_with_embedded_data",
                  "data:\n  valid_prefix: runs/valid\n",
                  {},
                  "$: data.valid_prefix: an indexed dataset for data.source indexed; with "
                  "embedded data use data.valid_path"},
        ErrorCase{"zero_eval_batches",
                  "train:\n  eval_batches: 0\n",
                  {},
                  "$: train.eval_batches: expected an integer >= 1 but got 0"},
        ErrorCase{"bad_document_masking",
                  "data:\n  document_masking: yes please\n",
                  {},
                  "$: data.document_masking: expected one of false, true but got 'yes please'"},
        ErrorCase{"document_masking_embedded_without_eos",
                  "data:\n  document_masking: true\n",
                  {},
                  "$: data.document_masking: true with data.source embedded needs "
                  "model.eos_token_id (the token that ends a document, e.g. 10 for a newline in "
                  "the byte corpus); the embedded corpus has no document index"},
        ErrorCase{"override_unknown_section",
                  "",
                  {{"trainer.steps", "5"}},
                  "--set trainer.steps=5: trainer.steps: unknown key"}),
    [](const testing::TestParamInfo<ErrorCase>& info) { return std::string(info.param.name); });

TEST(RunConfigTest, TheKernelsSectionSetsThePolicyWithTheModelAndTrainChoices) {
  const std::string path = write_config(
      "kernels.yaml", std::string(kModelSection) +
                          "  deterministic_mode: true\n"
                          "kernels:\n  attention: aten\n  pre_gdr_gate_tile: 128x16x256\n"
                          "  chunk_gemm_wgmma: false\n"
                          "train:\n  cuda_graphs: false\n");
  const absl::StatusOr<RunConfig> c = load_run_config(path);
  ASSERT_TRUE(c.ok()) << c.status();
  const ExecutionPolicy p = file_execution_policy(*c);
  EXPECT_EQ(p.attention, AttentionBackend::kAten);
  ASSERT_TRUE(p.gate_tile.has_value());
  EXPECT_EQ(*p.gate_tile, (kernels::GateTile{128, 16, 256}));
  EXPECT_FALSE(p.chunk_gemm_wgmma);
  EXPECT_TRUE(p.deterministic);
  EXPECT_FALSE(p.cuda_graphs);
  EXPECT_EQ(p.rms_norm, RmsNormImpl::kFused);  // not set: the default
}

TEST(RunConfigTest, TheEnvironmentOverridesTheFileAndIsNamedInErrors) {
  const std::string path = write_config(
      "kernels_env.yaml",
      std::string(kModelSection) + "  pre_gdr_fusion: full\nkernels:\n  attention: cudnn\n");
  const absl::StatusOr<RunConfig> c = load_run_config(path);
  ASSERT_TRUE(c.ok()) << c.status();
  std::map<std::string, std::string> env = {{"GDR_ATTENTION", "aten"}, {"GDR_ROPE", ""}};
  auto get = [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
  std::vector<std::string> from_env;
  absl::StatusOr<ExecutionPolicy> p = execution_policy_for_run(*c, get, &from_env);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->attention, AttentionBackend::kAten);
  EXPECT_EQ(from_env, std::vector<std::string>{"attention"});
  env["GDR_ATTENTION"] = "flash";
  EXPECT_EQ(execution_policy_for_run(*c, get).status().message(),
            "GDR_ATTENTION: expected cudnn or aten, but got 'flash'");
  env = {{"GDR_DETERMINISTIC", "1"}};
  const absl::Status rule = execution_policy_for_run(*c, get).status();
  EXPECT_EQ(rule.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(rule.message(),
            path +
                " with the environment: deterministic_mode: true cannot be combined with "
                "pre_gdr_fusion: full (the fully fused pre-GDR path has no ordered, "
                "bit-reproducible backward); use pre_gdr_fusion: gate or none");
}

TEST(RunConfigTest, DeterministicModeWithFullFusionIsRefusedWhenTheFileIsLoaded) {
  const std::string path =
      write_config("det_full.yaml", std::string(kModelSection) +
                                        "  pre_gdr_fusion: full\n  deterministic_mode: true\n");
  const absl::Status status = load_run_config(path).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(),
            path +
                ": deterministic_mode: true cannot be combined with pre_gdr_fusion: full (the "
                "fully fused pre-GDR path has no ordered, bit-reproducible backward); use "
                "pre_gdr_fusion: gate or none");
}

TEST(RunConfigTest, DocumentMaskingIsOffByDefaultAndReadWithItsEosToken) {
  const std::string path = write_config("masking.yaml", kModelSection);
  absl::StatusOr<RunConfig> plain = load_run_config(path);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->data.document_masking);
  EXPECT_TRUE(plain->model.eos_token_ids.empty());
  absl::StatusOr<RunConfig> masked =
      load_run_config(path, {{"data.document_masking", "true"}, {"model.eos_token_id", "10"}});
  ASSERT_TRUE(masked.ok()) << masked.status();
  EXPECT_TRUE(masked->data.document_masking);
  EXPECT_EQ(masked->model.eos_token_ids, std::vector<int64_t>{10});
  // An indexed dataset has its document index: no eos_token_id needed.
  absl::StatusOr<RunConfig> indexed = load_run_config(
      path, {{"data.document_masking", "true"}, {"data.source", "indexed"}, {"data.prefix", "x"}});
  EXPECT_TRUE(indexed.ok()) << indexed.status();
}

TEST(RunConfigTest, MissingModelSectionIsAnError) {
  const std::string path = write_config("no_model.yaml", "train:\n  steps: 3\n");
  EXPECT_EQ(load_run_config(path).status().message(),
            path + ": model: required section is missing");
}

TEST(RunConfigTest, MissingFileIsNotFound) {
  const absl::StatusOr<RunConfig> c = load_run_config("configs/does_not_exist.yaml");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(), "configs/does_not_exist.yaml: cannot open the config file");
}

}  // namespace
}  // namespace gdr

namespace gdr {
namespace {

std::vector<std::string> differences(const RunConfig& saved, const RunConfig& current) {
  absl::StatusOr<std::vector<std::string>> d =
      resume_config_differences(saved.config_text, "saved", current);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *d : std::vector<std::string>{"<error>"};
}

RunConfig tiny(std::vector<ConfigOverride> overrides = {}) {
  absl::StatusOr<RunConfig> c = load_run_config("configs/train_tiny.yaml", overrides);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

TEST(ResumeConfigTest, TheSameConfigHasNoDifferences) {
  EXPECT_TRUE(differences(tiny(), tiny()).empty());
}

TEST(ResumeConfigTest, OutputsAndLoggingMayChange) {
  const RunConfig saved = tiny({{"schedule.total_steps", "30"}});
  EXPECT_TRUE(differences(saved, tiny({{"schedule.total_steps", "30"},
                                       {"train.steps", "50"},
                                       {"train.snapshot_dir", "snap"},
                                       {"train.checkpoint_dir", "ckpt"},
                                       {"train.metrics_path", "m.jsonl"},
                                       {"train.log_every", "5"},
                                       {"train.cuda_graphs", "false"},
                                       {"train.shard_optimizer_state", "true"},
                                       {"kernels.chunk_gemm_overlap", "false"},
                                       {"kernels.pre_gdr_gate_ordered", "two_pass"}}))
                  .empty());
}

TEST(ResumeConfigTest, NamesEveryKeyThatChangesTheComputation) {
  EXPECT_EQ(differences(tiny(), tiny({{"optimizer.lr", "1e-3"},
                                      {"train.seed", "5"},
                                      {"optimizer.betas", "[0.9, 0.99]"},
                                      {"model.rope_theta", "10000"},
                                      {"kernels.attention", "aten"}})),
            (std::vector<std::string>{"model.rope_theta", "optimizer.lr", "optimizer.betas",
                                      "train.seed", "kernels.attention"}));
  // Document masking changes what every step computes, and so does its EOS token.
  EXPECT_EQ(
      differences(tiny(), tiny({{"data.document_masking", "true"}, {"model.eos_token_id", "10"}})),
      (std::vector<std::string>{"model.eos_token_id", "data.document_masking"}));
  // With total_steps 0 the schedule ends at train.steps, so changing it moves the LR.
  EXPECT_EQ(differences(tiny(), tiny({{"train.steps", "60"}})),
            (std::vector<std::string>{"schedule.total_steps (effective: 0 means train.steps)"}));
}

}  // namespace
}  // namespace gdr
