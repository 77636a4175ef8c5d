// The trainer on CUDA with deterministic_mode: two in-process runs are byte-identical,
// resume from step 1 reproduces step 3 byte for byte (fp32 and bf16), CUDA-graph replays
// give the eager run's bits, the loss goes down.
// Runs on a GPU machine (tag gpu; tools/gpu/make_bundle.sh).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <execinfo.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <sstream>
#include <string>

#include "gdr/trainer.h"
#include "tests/gdr/trainer_test_util.h"

namespace gdr {
namespace {

using testing_util::bytes_equal;
using testing_util::make_trainer;
using testing_util::run_steps;
using testing_util::scratch_dir;
using testing_util::tiny_run_config;

// A crash on the GPU machine (no debugger there) prints a backtrace.
void print_backtrace(int sig) {
  void* frames[64];
  const int n = backtrace(frames, 64);
  backtrace_symbols_fd(frames, n, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

class TrainerGpuTest : public testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    std::signal(SIGSEGV, print_backtrace);
    if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  }
  RunConfig config() const {
    return tiny_run_config({{"train.device", "cuda"}, {"train.dtype", GetParam()}});
  }
};

TEST_P(TrainerGpuTest, TwoRunsOfThreeStepsAreByteIdentical) {
  std::unique_ptr<Trainer> a = make_trainer(config());
  std::unique_ptr<Trainer> b = make_trainer(config());
  for (int i = 0; i < 3; ++i) {
    const absl::StatusOr<StepStats> sa = a->train_step();
    const absl::StatusOr<StepStats> sb = b->train_step();
    ASSERT_TRUE(sa.ok()) << sa.status();
    ASSERT_TRUE(sb.ok()) << sb.status();
    EXPECT_EQ(sa->microbatch_losses, sb->microbatch_losses) << "step " << i + 1;
    EXPECT_TRUE(std::isfinite(sa->loss));
  }
  EXPECT_TRUE(bytes_equal(a->master_parameters(), b->master_parameters()));
  EXPECT_TRUE(bytes_equal(a->optimizer_tensors(), b->optimizer_tensors()));
}

// See Note [Microbatch graphs]: replaying the captured microbatches gives the bits of running
// them eagerly. Step 1's first microbatch warms up eagerly; each position k mod 4 has a
// graph of its own, captured at its first use and replayed at every later one. With 6
// microbatches positions 4 and 5 replay graphs 0 and 1 again after the tree summed the
// first group of four, and the last position's graph (1) carries the marks.
TEST_P(TrainerGpuTest, CudaGraphRunEqualsEagerRunByteForByte) {
  for (const int64_t accum : {int64_t{0}, int64_t{6}}) {
    RunConfig graphed_config = config();
    if (accum > 0) graphed_config.train.grad_accum = accum;
    ASSERT_TRUE(graphed_config.train.cuda_graphs) << "graphs are the default";
    RunConfig eager_config = graphed_config;
    eager_config.train.cuda_graphs = false;
    std::unique_ptr<Trainer> graphed = make_trainer(graphed_config);
    std::unique_ptr<Trainer> eager = make_trainer(eager_config);
    const int64_t microbatches = graphed_config.train.grad_accum;
    ASSERT_GE(microbatches, 2);
    for (int i = 0; i < 3; ++i) {
      const absl::StatusOr<StepStats> sg = graphed->train_step();
      const absl::StatusOr<StepStats> se = eager->train_step();
      ASSERT_TRUE(sg.ok()) << sg.status();
      ASSERT_TRUE(se.ok()) << se.status();
      EXPECT_EQ(sg->graph_replays, i == 0 ? microbatches - 1 : microbatches)
          << microbatches << " microbatches, step " << i + 1;
      EXPECT_EQ(se->graph_replays, 0) << "step " << i + 1;
      EXPECT_EQ(sg->microbatch_losses, se->microbatch_losses)
          << microbatches << " microbatches, step " << i + 1;
      EXPECT_EQ(sg->grad_norm, se->grad_norm) << microbatches << " microbatches, step " << i + 1;
    }
    EXPECT_TRUE(bytes_equal(graphed->master_parameters(), eager->master_parameters()))
        << microbatches << " microbatches";
    EXPECT_TRUE(bytes_equal(graphed->optimizer_tensors(), eager->optimizer_tensors()))
        << microbatches << " microbatches";
  }
}

// Note [Recomputation] on CUDA, with CUDA graphs (the recomputing blocks' backward runs a
// nested backward inside the captured microbatch): the same bits as keeping every
// activation, graphed and eager.
TEST_P(TrainerGpuTest, RecomputationIsByteIdenticalWithAndWithoutGraphs) {
  std::unique_ptr<Trainer> plain = make_trainer(config());
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(plain->train_step().ok());
  for (const Recompute recompute : {Recompute::kAttention, Recompute::kFull}) {
    for (const bool graphs : {true, false}) {
      RunConfig c = config();
      c.train.recompute = recompute;
      c.train.cuda_graphs = graphs;
      std::unique_ptr<Trainer> t = make_trainer(c);
      for (int i = 0; i < 2; ++i) {
        const absl::StatusOr<StepStats> s = t->train_step();
        ASSERT_TRUE(s.ok()) << s.status();
      }
      EXPECT_TRUE(bytes_equal(t->master_parameters(), plain->master_parameters()))
          << static_cast<int>(recompute) << " graphs " << graphs;
      EXPECT_TRUE(bytes_equal(t->optimizer_tensors(), plain->optimizer_tensors()))
          << static_cast<int>(recompute) << " graphs " << graphs;
    }
  }
}

// Note [Document masking]: masked microbatches run eagerly whatever train.cuda_graphs says
// (the run says why after the policy line), so the two settings give the same bits, and
// reruns are byte-identical.
TEST_P(TrainerGpuTest, DocumentMaskingRunsEagerlyAndIsByteIdentical) {
  RunConfig masked = config();
  masked.data.document_masking = true;
  masked.model.eos_token_ids = {10};
  masked.train.steps = 2;
  RunConfig eager = masked;
  eager.train.cuda_graphs = false;
  std::unique_ptr<Trainer> a = make_trainer(masked), b = make_trainer(masked),
                           c = make_trainer(eager);
  std::ostringstream log;
  ASSERT_TRUE(a->run(log).ok());
  EXPECT_NE(log.str().find("\ntrain.cuda_graphs: off for this run: with data.document_masking"),
            std::string::npos)
      << log.str();
  EXPECT_NE(log.str().find(" cuda_graphs=false"), std::string::npos) << log.str();
  for (Trainer* t : {b.get(), c.get()}) {
    for (int i = 0; i < 2; ++i) {
      const absl::StatusOr<StepStats> s = t->train_step();
      ASSERT_TRUE(s.ok()) << s.status();
      EXPECT_EQ(s->graph_replays, 0);
      EXPECT_TRUE(std::isfinite(s->loss));
    }
  }
  EXPECT_TRUE(bytes_equal(a->master_parameters(), b->master_parameters()));
  EXPECT_TRUE(bytes_equal(a->master_parameters(), c->master_parameters()));
  EXPECT_TRUE(bytes_equal(a->optimizer_tensors(), c->optimizer_tensors()));
}

TEST_P(TrainerGpuTest, ResumeFromStepOneEqualsTheUninterruptedRunAtStepThree) {
  const std::string dir = scratch_dir(std::string("gpu_resume_") + GetParam());
  std::unique_ptr<Trainer> reference = make_trainer(config());
  run_steps(*reference, 1);
  ASSERT_TRUE(reference->save_checkpoint(checkpoint_step_dir(dir, 1)).ok());
  run_steps(*reference, 2);
  std::unique_ptr<Trainer> resumed = make_trainer(config());
  ASSERT_TRUE(resumed->resume(dir).ok());
  run_steps(*resumed, 2);
  EXPECT_TRUE(bytes_equal(reference->master_parameters(), resumed->master_parameters()));
  EXPECT_TRUE(bytes_equal(reference->optimizer_tensors(), resumed->optimizer_tensors()));
}

TEST_P(TrainerGpuTest, LossGoesDown) {
  std::unique_ptr<Trainer> t = make_trainer(config());
  std::vector<double> losses;
  for (int i = 0; i < 20; ++i) {
    const absl::StatusOr<StepStats> s = t->train_step();
    ASSERT_TRUE(s.ok()) << s.status();
    losses.push_back(s->loss);
  }
  const double first = (losses[0] + losses[1] + losses[2]) / 3;
  const double last = (losses[15] + losses[16] + losses[17] + losses[18] + losses[19]) / 5;
  EXPECT_LT(last, first - 1.0) << "first " << first << " last " << last;
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TrainerGpuTest, testing::Values("fp32", "bf16"));

}  // namespace
}  // namespace gdr
