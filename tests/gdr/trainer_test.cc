// The trainer on the tiny config, CPU: in-process determinism, resume bit-exactness,
// the LR schedule, non-finite handling, BF16 with FP32 masters, and that it learns.
#include "gdr/trainer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "gdr/data.h"
#include "models/qwen/document_bounds.h"
#include "models/qwen/model.h"
#include "tests/gdr/trainer_test_util.h"

namespace gdr {
namespace {

using testing_util::bytes_equal;
using testing_util::make_trainer;
using testing_util::run_steps;
using testing_util::scratch_dir;
using testing_util::tiny_run_config;

TEST(TrainerTest, TwoRunsOfThreeStepsAreByteIdentical) {
  const RunConfig config = tiny_run_config();
  std::unique_ptr<Trainer> a = make_trainer(config);
  std::unique_ptr<Trainer> b = make_trainer(config);
  std::vector<double> losses_a, losses_b;
  for (int i = 0; i < 3; ++i) {
    losses_a.push_back(a->train_step()->loss);
    losses_b.push_back(b->train_step()->loss);
  }
  EXPECT_EQ(losses_a, losses_b);
  EXPECT_TRUE(bytes_equal(a->master_parameters(), b->master_parameters()));
  EXPECT_TRUE(bytes_equal(a->optimizer_tensors(), b->optimizer_tensors()));
  EXPECT_EQ(a->optimizer_tensors().size(), 3 * a->master_parameters().size());
  EXPECT_EQ(a->data_position(), b->data_position());
  // train.cuda_graphs is on by default and ignored on CPU: every microbatch runs eagerly.
  EXPECT_TRUE(config.train.cuda_graphs);
  const absl::StatusOr<StepStats> fourth = a->train_step();
  ASSERT_TRUE(fourth.ok()) << fourth.status();
  EXPECT_EQ(fourth->graph_replays, 0);
}

// See Note [Fused AdamW]: the fused update is the loop's formula on the same state; one step
// from the same start differs only in FP32 rounding (later steps would also see the
// different weights' gradients), and both count steps alike.
TEST(TrainerTest, FusedAndLoopAdamWAgree) {
  std::unique_ptr<Trainer> fused = make_trainer(tiny_run_config({{"optimizer.impl", "fused"}}));
  std::unique_ptr<Trainer> loop = make_trainer(tiny_run_config({{"optimizer.impl", "loop"}}));
  run_steps(*fused, 1);
  run_steps(*loop, 1);
  const io::NamedTensors pf = fused->master_parameters(), pl = loop->master_parameters();
  const io::NamedTensors of = fused->optimizer_tensors(), ol = loop->optimizer_tensors();
  ASSERT_EQ(pf.size(), pl.size());
  ASSERT_EQ(of.size(), ol.size());
  ASSERT_EQ(of.size(), 3 * pf.size());
  for (size_t i = 0; i < pf.size(); ++i) {
    EXPECT_TRUE(at::allclose(pf[i].second, pl[i].second, 1e-6, 1e-7))
        << pf[i].first << " max abs diff "
        << (pf[i].second - pl[i].second).abs().max().item<double>();
  }
  for (size_t i = 0; i < of.size(); ++i) {
    ASSERT_EQ(of[i].first, ol[i].first);
    if (of[i].first.rfind(".step") == of[i].first.size() - 5) {
      EXPECT_EQ(of[i].second.item<int64_t>(), 1) << of[i].first;
      EXPECT_EQ(ol[i].second.item<int64_t>(), 1) << ol[i].first;
    } else {
      EXPECT_TRUE(at::allclose(of[i].second, ol[i].second, 1e-6, 1e-12))
          << of[i].first << " max abs diff "
          << (of[i].second - ol[i].second).abs().max().item<double>();
    }
  }
  // And not trivially: the parameters moved.
  std::unique_ptr<Trainer> fresh = make_trainer(tiny_run_config());
  EXPECT_FALSE(bytes_equal(pf, fresh->master_parameters()));
}

TEST(TrainerTest, ADifferentSeedGivesADifferentRun) {
  std::unique_ptr<Trainer> a = make_trainer(tiny_run_config());
  std::unique_ptr<Trainer> b = make_trainer(tiny_run_config({{"train.seed", "7"}}));
  run_steps(*a, 1);
  run_steps(*b, 1);
  EXPECT_FALSE(bytes_equal(a->master_parameters(), b->master_parameters()));
}

// Resume bit-exactness for both dtypes: with bf16 the checkpoint holds the FP32 masters,
// so the BF16 model is rebuilt from them exactly (Note [Master weights]).
class ResumeTest : public testing::TestWithParam<const char*> {};

TEST_P(ResumeTest, ResumeFromStepOneEqualsTheUninterruptedRunAtStepThree) {
  const RunConfig config = tiny_run_config({{"train.dtype", GetParam()}});
  const std::string dir = scratch_dir(std::string("resume_ckpt_") + GetParam());
  std::unique_ptr<Trainer> reference = make_trainer(config);
  run_steps(*reference, 1);
  ASSERT_TRUE(reference->save_checkpoint(checkpoint_step_dir(dir, 1)).ok());
  run_steps(*reference, 2);

  std::unique_ptr<Trainer> resumed = make_trainer(config);
  ASSERT_TRUE(resumed->resume(dir).ok());  // the checkpoint dir: its latest complete step
  EXPECT_EQ(resumed->step(), 1);
  run_steps(*resumed, 2);
  EXPECT_EQ(resumed->step(), 3);
  EXPECT_TRUE(bytes_equal(reference->master_parameters(), resumed->master_parameters()));
  EXPECT_TRUE(bytes_equal(reference->optimizer_tensors(), resumed->optimizer_tensors()));
  EXPECT_EQ(reference->data_position(), resumed->data_position());
}

INSTANTIATE_TEST_SUITE_P(Dtypes, ResumeTest, testing::Values("fp32", "bf16"));

// Note [Document masking]: with data.document_masking the trainer hands each microbatch its
// rows' document starts (here: after each '\n' of the byte corpus). Checked against the model
// run with starts computed independently from the tokens, and for determinism, resume and
// evaluation.
TEST(TrainerTest, DocumentMaskingHandsTheModelEachRowsDocumentStarts) {
  const RunConfig config =
      tiny_run_config({{"data.document_masking", "true"}, {"model.eos_token_id", "10"}});
  std::unique_ptr<Trainer> trainer = make_trainer(config);
  // The first microbatch, read the way the trainer reads it.
  absl::StatusOr<TokenWindows> windows = TokenWindows::open(config.data, config.train.seed, {10});
  ASSERT_TRUE(windows.ok()) << windows.status();
  const int64_t rows = config.data.micro_batch_size, length = windows->window_length();
  const std::vector<int64_t> tokens = windows->next_batch(rows);
  std::vector<std::vector<int64_t>> starts(rows);
  int64_t documents = 0;
  for (int64_t r = 0; r < rows; ++r) {
    starts[r].push_back(0);
    for (int64_t t = 0; t + 1 < length; ++t) {
      if (tokens[r * length + t] == '\n') starts[r].push_back(t + 1);
    }
    documents += static_cast<int64_t>(starts[r].size());
  }
  ASSERT_GT(documents, rows) << "the first microbatch packs several lines per row";
  absl::StatusOr<DocumentBounds> bounds = DocumentBounds::create(starts, length);
  ASSERT_TRUE(bounds.ok()) << bounds.status();
  const at::Tensor ids = at::tensor(tokens, at::kLong).view({rows, length});
  const double expected = trainer->model().loss(ids, ids, *bounds).item<double>();
  const double unmasked = trainer->model().loss(ids, ids).item<double>();
  const absl::StatusOr<StepStats> step = trainer->train_step();
  ASSERT_TRUE(step.ok()) << step.status();
  EXPECT_EQ(step->microbatch_losses[0], expected);
  EXPECT_NE(step->microbatch_losses[0], unmasked);
  // The run says so in its first line.
  EXPECT_NE(format_run_header(config, file_execution_policy(config), 1000, 1, 1)
                .find(" | pre_gdr_fusion gate | document masking | 512 tokens per step"),
            std::string::npos);
}

TEST(TrainerTest, DocumentMaskingRunsAreByteIdenticalResumableAndEvaluateMasked) {
  const std::vector<ConfigOverride> masking = {{"data.document_masking", "true"},
                                               {"model.eos_token_id", "10"},
                                               {"data.valid_fraction", "0.1"}};
  const RunConfig config = tiny_run_config(masking);
  const std::string dir = scratch_dir("masked_ckpt");
  std::unique_ptr<Trainer> a = make_trainer(config), b = make_trainer(config);
  run_steps(*a, 1);
  ASSERT_TRUE(a->save_checkpoint(checkpoint_step_dir(dir, 1)).ok());
  run_steps(*a, 1);
  run_steps(*b, 2);
  EXPECT_TRUE(bytes_equal(a->master_parameters(), b->master_parameters()));
  EXPECT_TRUE(bytes_equal(a->optimizer_tensors(), b->optimizer_tensors()));
  std::unique_ptr<Trainer> resumed = make_trainer(config);
  ASSERT_TRUE(resumed->resume(dir).ok());
  run_steps(*resumed, 1);
  EXPECT_TRUE(bytes_equal(a->master_parameters(), resumed->master_parameters()));
  EXPECT_TRUE(bytes_equal(a->optimizer_tensors(), resumed->optimizer_tensors()));
  // A checkpoint of a masked run does not resume an unmasked one.
  std::unique_ptr<Trainer> unmasked =
      make_trainer(tiny_run_config({{"data.valid_fraction", "0.1"}, {"model.eos_token_id", "10"}}));
  const absl::Status refused = unmasked->resume(dir);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("data.document_masking"), std::string::npos) << refused;
  // Evaluation masks the validation windows too.
  absl::StatusOr<EvalStats> masked_eval = a->evaluate();
  ASSERT_TRUE(masked_eval.ok()) << masked_eval.status();
  EXPECT_TRUE(std::isfinite(masked_eval->loss));
  std::unique_ptr<Trainer> plain = make_trainer(tiny_run_config({{"data.valid_fraction", "0.1"}}));
  EXPECT_NE(plain->evaluate()->loss, make_trainer(config)->evaluate()->loss);
}

TEST(TrainerTest, ResumeUnderAConfigThatComputesDifferentlyIsRefused) {
  std::unique_ptr<Trainer> first = make_trainer(tiny_run_config());
  run_steps(*first, 1);
  const std::string dir = checkpoint_step_dir(scratch_dir("config_change"), 1);
  ASSERT_TRUE(first->save_checkpoint(dir).ok());
  std::unique_ptr<Trainer> changed = make_trainer(tiny_run_config({{"optimizer.lr", "1e-3"}}));
  const absl::Status s = changed->resume(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), dir +
                             ": the checkpoint was written with a different config "
                             "(optimizer.lr); resuming would not continue the same run "
                             "(allow_config_change overrides this)");
  EXPECT_EQ(changed->step(), 0);
  EXPECT_TRUE(changed->resume(dir, /*allow_config_change=*/true).ok());
  EXPECT_EQ(changed->step(), 1);
}

TEST(TrainerTest, AccumulatingTwoMicrobatchesMatchesOneBatchOfTwiceTheSize) {
  // Same 8 windows either way (the data order does not depend on the batch split); the
  // 1/M loss scaling makes the accumulated gradient the gradient of the mean loss.
  // Not bit-equal (different summation order), so compared with a tolerance.
  std::unique_ptr<Trainer> accumulated = make_trainer(tiny_run_config());
  std::unique_ptr<Trainer> single =
      make_trainer(tiny_run_config({{"train.grad_accum", "1"}, {"data.micro_batch_size", "8"}}));
  const absl::StatusOr<StepStats> a = accumulated->train_step();
  const absl::StatusOr<StepStats> b = single->train_step();
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->tokens, b->tokens);
  EXPECT_NEAR(a->loss, b->loss, 1e-5);
  EXPECT_NEAR(a->grad_norm, b->grad_norm, 1e-4 * b->grad_norm);
  EXPECT_EQ(accumulated->data_position(), single->data_position());
}

TEST(TrainerTest, ResumeWithoutTheDataPositionIsCaughtAsDifferent) {
  // The checker must be able to fail: skipping the data state changes the run.
  const RunConfig config = tiny_run_config();
  std::unique_ptr<Trainer> reference = make_trainer(config);
  const Checkpoint at_zero = reference->capture();
  run_steps(*reference, 2);

  std::unique_ptr<Trainer> broken = make_trainer(config);
  run_steps(*broken, 1);
  Checkpoint ckpt = broken->capture();
  ckpt.state.data_position = at_zero.state.data_position;  // "forgot" the data position
  const std::string dir = scratch_dir("broken_ckpt/step_1");
  ASSERT_TRUE(write_checkpoint(dir, ckpt).ok());
  std::unique_ptr<Trainer> resumed = make_trainer(config);
  ASSERT_TRUE(resumed->resume(dir).ok());
  run_steps(*resumed, 1);
  EXPECT_FALSE(bytes_equal(reference->master_parameters(), resumed->master_parameters()));
}

TEST(TrainerTest, ScheduleWarmsUpLinearlyThenDecaysByCosine) {
  const RunConfig c = tiny_run_config({{"schedule.warmup_steps", "10"},
                                       {"schedule.total_steps", "110"},
                                       {"optimizer.lr", "1.0"},
                                       {"schedule.min_lr_ratio", "0.1"}});
  EXPECT_DOUBLE_EQ(learning_rate_at(c, 1), 0.1);
  EXPECT_DOUBLE_EQ(learning_rate_at(c, 10), 1.0);
  EXPECT_NEAR(learning_rate_at(c, 60), 0.55, 1e-12);  // half-way down the cosine
  EXPECT_NEAR(learning_rate_at(c, 110), 0.1, 1e-12);
  EXPECT_NEAR(learning_rate_at(c, 500), 0.1, 1e-12);
}

TEST(TrainerTest, FormatsTheProgressLine) {
  StepStats s;
  s.step = 3;
  s.loss = 4.12344;
  s.lr = 1e-3;
  s.grad_norm = 1.234;
  s.tokens_per_s = 12345.4;
  s.step_time_s = 0.1234;
  EXPECT_EQ(format_progress_line(s, 20),
            "step 3/20 loss 4.1234 lr 1.00e-03 grad_norm 1.23 tokens/s 12345 step_time 0.123s");
  // Data parallelism adds the reduction's share; a skipped step says so last.
  s.reduce_time_s = 0.0456;
  s.skipped = true;
  EXPECT_EQ(format_progress_line(s, 20),
            "step 3/20 loss 4.1234 lr 1.00e-03 grad_norm 1.23 tokens/s 12345 step_time 0.123s "
            "reduce 0.046s (skipped: non-finite)");
}

void poison_first_parameter(Trainer& trainer) {
  at::NoGradGuard no_grad;
  trainer.model().named_parameters()[0].value().fill_(NAN);
}

TEST(TrainerTest, NonFiniteLossStopsNamingTheStep) {
  std::unique_ptr<Trainer> t = make_trainer(tiny_run_config());
  run_steps(*t, 1);
  poison_first_parameter(*t);
  const absl::StatusOr<StepStats> s = t->train_step();
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(
      s.status().message(),
      "step 2: non-finite loss nan in microbatch 1 of 2; stopping (train.on_nonfinite: stop)");
}

TEST(TrainerTest, NonFiniteStepIsSkippedWhenConfigured) {
  std::unique_ptr<Trainer> t = make_trainer(tiny_run_config({{"train.on_nonfinite", "skip"}}));
  poison_first_parameter(*t);
  const io::NamedTensors before = t->master_parameters();
  std::vector<at::Tensor> copies;
  for (const auto& [name, p] : before) copies.push_back(p.clone());
  const absl::StatusOr<StepStats> s = t->train_step();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->skipped);
  EXPECT_EQ(t->step(), 1);
  EXPECT_TRUE(t->optimizer_tensors().empty());  // no optimizer update happened
  for (size_t i = 1; i < copies.size(); ++i) {
    EXPECT_TRUE(at::equal(copies[i], t->master_parameters()[i].second)) << before[i].first;
  }
}

TEST(TrainerTest, Bf16RunsTheModelInBf16WithFp32Masters) {
  std::unique_ptr<Trainer> t = make_trainer(tiny_run_config({{"train.dtype", "bf16"}}));
  const absl::StatusOr<StepStats> s = t->train_step();
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(std::isfinite(s->loss));
  EXPECT_EQ(t->model().named_parameters()[0].value().scalar_type(), at::kBFloat16);
  for (const auto& [name, p] : t->master_parameters()) EXPECT_EQ(p.scalar_type(), at::kFloat);
  for (const auto& [name, p] : t->optimizer_tensors()) {
    if (name.find(".exp_avg") != std::string::npos) {
      EXPECT_EQ(p.scalar_type(), at::kFloat);
    }
  }
  // The BF16 model holds the masters rounded.
  const at::Tensor master = t->master_parameters()[0].second;
  EXPECT_TRUE(at::equal(master.to(at::kBFloat16), t->model().named_parameters()[0].value()));
}

TEST(TrainerTest, RunLogsProgressAndLearns) {
  RunConfig config = tiny_run_config({{"train.steps", "20"}});
  config.train.metrics_path = scratch_dir("metrics/learn.jsonl");
  std::unique_ptr<Trainer> t = make_trainer(config);
  std::ostringstream log;
  ASSERT_TRUE(t->run(log).ok());
  EXPECT_EQ(t->step(), 20);
  EXPECT_NE(log.str().find("step 20/20 loss "), std::string::npos) << log.str();
  // The first line says what runs (format_run_header).
  const std::string first_line = log.str().substr(0, log.str().find('\n'));
  EXPECT_EQ(first_line,
            "run: 184.0K parameters (4 layers: 3 linear_attention + 1 full_attention, hidden 64) "
            "| cpu fp32 | deterministic on | pre_gdr_fusion gate | 512 tokens per step (1 rank x "
            "2 microbatches x 4 x 64) | steps 1..20")
      << log.str();
  // The second line is the whole execution policy (Note [Execution policy]).
  const size_t second = log.str().find('\n') + 1;
  EXPECT_EQ(log.str().substr(second, log.str().find('\n', second) - second),
            "execution policy: " + describe_execution_policy(file_execution_policy(config)))
      << log.str();
  // The loss read back from the metrics file: the mean of the last 5 steps is well below
  // the first 3 (about 5.4 -> 3.3 on this config).
  std::ifstream metrics(config.train.metrics_path);
  std::vector<double> losses;
  for (std::string line; std::getline(metrics, line);) {
    const size_t at = line.find("\"loss\":");
    ASSERT_NE(at, std::string::npos) << line;
    losses.push_back(std::stod(line.substr(at + 7)));
  }
  ASSERT_EQ(losses.size(), 20u);
  // Every line also says where the host's time went (Note [Host-bound steps]): both parts
  // present, non-negative, and together within the step time.
  std::ifstream timing(config.train.metrics_path);
  for (std::string line; std::getline(timing, line);) {
    auto field = [&](const std::string& key) {
      const size_t at = line.find("\"" + key + "\":");
      EXPECT_NE(at, std::string::npos) << key << " missing: " << line;
      return at == std::string::npos ? -1.0 : std::stod(line.substr(at + key.size() + 3));
    };
    const double queue = field("host_queue_s"), wait = field("gpu_wait_s");
    EXPECT_GE(queue, 0.0) << line;
    EXPECT_GE(wait, 0.0) << line;
    EXPECT_LE(queue + wait, field("step_time_s")) << line;
  }
  const double first = (losses[0] + losses[1] + losses[2]) / 3;
  double last = 0;
  for (int i = 15; i < 20; ++i) last += losses[i] / 5;
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
}

// Note [Evaluation]: a run that evaluates after every step computes the same bits as one
// that never evaluates.
// Note [Recomputation]: train.recompute trades compute for activation memory and nothing
// else: the steps' losses, weights and optimizer state are the plain run's bits.
TEST(TrainerTest, RecomputationNeverChangesTheTrainingBits) {
  for (const char* dtype : {"fp32", "bf16"}) {
    std::unique_ptr<Trainer> plain = make_trainer(tiny_run_config({{"train.dtype", dtype}}));
    std::vector<double> plain_losses;
    for (int i = 0; i < 2; ++i) plain_losses.push_back(plain->train_step()->loss);
    for (const char* recompute : {"attention", "full"}) {
      const RunConfig config =
          tiny_run_config({{"train.dtype", dtype}, {"train.recompute", recompute}});
      EXPECT_EQ(static_cast<int>(config.train.recompute), recompute[0] == 'a' ? 1 : 2);
      std::unique_ptr<Trainer> t = make_trainer(config);
      std::vector<double> losses;
      for (int i = 0; i < 2; ++i) losses.push_back(t->train_step()->loss);
      EXPECT_EQ(losses, plain_losses) << dtype << " " << recompute;
      EXPECT_TRUE(bytes_equal(t->master_parameters(), plain->master_parameters()))
          << dtype << " " << recompute;
      EXPECT_TRUE(bytes_equal(t->optimizer_tensors(), plain->optimizer_tensors()))
          << dtype << " " << recompute;
    }
  }
}

TEST(TrainerTest, EvaluationNeverChangesTheTrainingBits) {
  const RunConfig plain = tiny_run_config({{"data.valid_fraction", "0.1"}});
  const RunConfig evaluating = tiny_run_config(
      {{"data.valid_fraction", "0.1"}, {"train.eval_every", "1"}, {"train.eval_batches", "3"}});
  std::unique_ptr<Trainer> a = make_trainer(plain);
  std::unique_ptr<Trainer> b = make_trainer(evaluating);
  std::vector<double> losses_a, losses_b;
  absl::StatusOr<EvalStats> first, again;
  for (int i = 0; i < 3; ++i) {
    losses_a.push_back(a->train_step()->loss);
    losses_b.push_back(b->train_step()->loss);
    first = b->evaluate();
    ASSERT_TRUE(first.ok()) << first.status();
    again = b->evaluate();
    ASSERT_TRUE(again.ok());
    EXPECT_EQ(first->loss, again->loss) << "the same windows every time";
  }
  EXPECT_EQ(losses_a, losses_b);
  EXPECT_TRUE(bytes_equal(a->master_parameters(), b->master_parameters()));
  EXPECT_TRUE(bytes_equal(a->optimizer_tensors(), b->optimizer_tensors()));
  EXPECT_EQ(a->data_position(), b->data_position());
  EXPECT_EQ(first->step, 3);
  EXPECT_EQ(first->batches, 3);
  EXPECT_EQ(first->tokens, 3 * 4 * 64);  // 3 batches of micro_batch_size 4 x seq_len 64
  EXPECT_TRUE(std::isfinite(first->loss));
  EXPECT_DOUBLE_EQ(first->perplexity, std::exp(first->loss));
  // Without a validation set there is nothing to evaluate.
  std::unique_ptr<Trainer> none = make_trainer(tiny_run_config());
  EXPECT_EQ(none->evaluate().status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(none->evaluate().status().message(),
            "evaluate: the run has no validation set (data.valid_fraction, data.valid_path or "
            "data.valid_prefix)");
}

TEST(TrainerTest, RunLogsEvaluationEveryEvalEveryStepsAndAfterTheLast) {
  RunConfig config = tiny_run_config({{"train.steps", "5"},
                                      {"data.valid_fraction", "0.1"},
                                      {"train.eval_every", "2"},
                                      {"train.eval_batches", "2"}});
  config.train.metrics_path = scratch_dir("metrics/eval.jsonl");
  std::unique_ptr<Trainer> t = make_trainer(config);
  std::ostringstream log;
  ASSERT_TRUE(t->run(log).ok());
  std::vector<int64_t> eval_steps;
  std::istringstream lines(log.str());
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("eval step ", 0) == 0) eval_steps.push_back(std::stoll(line.substr(10)));
  }
  EXPECT_EQ(eval_steps, (std::vector<int64_t>{2, 4, 5})) << log.str();
  int eval_lines = 0;
  std::ifstream metrics(config.train.metrics_path);
  for (std::string line; std::getline(metrics, line);) {
    if (line.find("\"eval_loss\":") != std::string::npos) {
      ++eval_lines;
      EXPECT_NE(line.find("\"eval_perplexity\":"), std::string::npos) << line;
      EXPECT_NE(line.find("\"eval_tokens\":512"), std::string::npos) << line;  // 2 x 4 x 64
    }
  }
  EXPECT_EQ(eval_lines, 3);
}

TEST(TrainerTest, EvaluationRefusesTokenIdsBeyondTheVocabulary) {
  std::unique_ptr<Trainer> t =
      make_trainer(tiny_run_config({{"model.vocab_size", "100"}, {"data.valid_fraction", "0.1"}}));
  const absl::Status status = t->evaluate().status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  const std::string message(status.message());
  EXPECT_EQ(message.rfind("evaluation: token id ", 0), 0u) << message;
  EXPECT_NE(message.find(" of batch 1 is outside the vocabulary [0, 100) of model.vocab_size; "
                         "check that the validation data was tokenized for this model"),
            std::string::npos)
      << message;
}

TEST(TrainerTest, FormatsTheEvalLine) {
  EvalStats s;
  s.step = 10;
  s.loss = 4.12345;
  s.perplexity = std::exp(4.12345);
  s.batches = 8;
  s.tokens = 2048;
  s.time_s = 0.0512;
  EXPECT_EQ(format_eval_line(s),
            "eval step 10 loss 4.1235 perplexity 61.77 (8 batches, 2048 tokens, 0.05s)");
}

TEST(TrainerTest, CudaIsRefusedWithoutADevice) {
  if (at::hasCUDA()) GTEST_SKIP() << "a CUDA device is present";
  const absl::StatusOr<std::unique_ptr<Trainer>> t =
      Trainer::create(tiny_run_config({{"train.device", "cuda"}}));
  EXPECT_EQ(
      t.status().message(),
      "configs/train_tiny.yaml: train.device: cuda requested but no CUDA device is available");
}

}  // namespace
}  // namespace gdr
