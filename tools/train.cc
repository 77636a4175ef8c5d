// train: runs gdr's trainer from a YAML run config.
//
//   bazel run //tools:train -- --config=configs/train_tiny.yaml [--set=train.steps=5]
//       [--resume=checkpoints/tiny/step_10] [--eval_only]
//
// Exit status: 0 done, 1 training failed (e.g. a non-finite loss with on_nonfinite: stop),
// 2 bad input (flags, config, checkpoint). Errors are one line on stderr.
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "gdr/distributed.h"
#include "gdr/run_config.h"
#include "gdr/trainer.h"

namespace {

constexpr char kUsage[] =
    "usage: train --config=FILE [--set=SECTION.KEY=VALUE ...] [--resume=DIR]\n"
    "             [--allow_config_change] [--eval_only]\n"
    "\n"
    "Trains a Qwen3.5-style model as the run config FILE says (see gdr/run_config.h).\n"
    "  --config=FILE   YAML run config (model, data, optimizer, schedule, train sections)\n"
    "  --set=K=V       override one key, e.g. --set=train.steps=5 (repeatable)\n"
    "  --resume=DIR    continue from a checkpoint: a step_<N> directory, or a checkpoint\n"
    "                  directory (its latest complete step)\n"
    "  --allow_config_change  resume even though the config computes differently from the\n"
    "                  checkpoint's (logging and output paths may always change, and\n"
    "                  train.steps when schedule.total_steps fixes the schedule's end)\n"
    "  --eval_only     no training: evaluate the model (from --resume, train.init_from or\n"
    "                  the seed's init) on the run's validation set once, print the eval\n"
    "                  line and exit (data.valid_fraction / valid_path / valid_prefix;\n"
    "                  train.eval_batches batches); with --resume the config may differ\n"
    "                  from the checkpoint's as long as the model's tensors match\n"
    "  --help          this text\n"
    "Relative paths are taken from the directory `bazel run` was started in.\n"
    "Data parallel: run one process per rank with RANK, WORLD_SIZE, MASTER_ADDR and\n"
    "MASTER_PORT set (torchrun's variables; tools/launch.sh N does it on one machine);\n"
    "GDR_DIST_TIMEOUT_S (default 60) bounds every wait for the other ranks.\n"
    "Exit status: 0 done, 1 training failed, 2 bad input.\n";

int fail(int code, absl::string_view message) {
  std::cerr << "train: error: " << message << "\n";
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  // `bazel run` starts us inside the runfiles tree; paths on the command line and in the
  // config are meant relative to where the user typed the command.
  if (const char* wd = std::getenv("BUILD_WORKING_DIRECTORY"); wd != nullptr && *wd != '\0') {
    if (chdir(wd) != 0) return fail(2, std::string("cannot enter ") + wd);
  }
  std::string config_path, resume;
  bool allow_config_change = false;
  bool eval_only = false;
  std::vector<gdr::ConfigOverride> overrides;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (arg == "--allow_config_change") {
      allow_config_change = true;
    } else if (arg == "--eval_only") {
      eval_only = true;
    } else if (absl::ConsumePrefix(&arg, "--config=")) {
      config_path = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--resume=")) {
      resume = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--set=")) {
      absl::StatusOr<gdr::ConfigOverride> o = gdr::parse_config_override(std::string(arg));
      if (!o.ok()) return fail(2, o.status().message());
      overrides.push_back(*o);
    } else {
      return fail(2, std::string("unknown argument '") + argv[i] + "' (see --help)");
    }
  }
  if (config_path.empty()) return fail(2, "--config=FILE is required (see --help)");

  absl::StatusOr<gdr::RunConfig> config = gdr::load_run_config(config_path, overrides);
  if (!config.ok()) return fail(2, config.status().message());
  absl::StatusOr<gdr::DistEnv> dist = gdr::read_dist_env();
  if (!dist.ok()) return fail(2, dist.status().message());
  std::shared_ptr<gdr::ProcessGroup> group;
  if (dist->world_size > 1) {
    absl::StatusOr<std::unique_ptr<gdr::ProcessGroup>> g =
        gdr::ProcessGroup::create(*dist, config->train.device == gdr::TrainDevice::kCuda);
    if (!g.ok()) return fail(2, g.status().message());
    group = std::move(*g);
  }
  absl::StatusOr<std::unique_ptr<gdr::Trainer>> trainer = gdr::Trainer::create(*config, group);
  if (!trainer.ok()) return fail(2, trainer.status().message());
  if (!resume.empty()) {
    // Evaluating a checkpoint continues no run: any config may read its weights (the
    // tensors must still match the model).
    if (absl::Status s = (*trainer)->resume(resume, allow_config_change || eval_only); !s.ok())
      return fail(2, s.message());
    if (dist->rank == 0) {
      std::cout << "resumed from " << resume << " at step " << (*trainer)->step() << std::endl;
    }
  }
  if (eval_only) {
    absl::StatusOr<gdr::EvalStats> eval = (*trainer)->evaluate();
    if (!eval.ok()) return fail(2, eval.status().message());
    if (dist->rank == 0) std::cout << gdr::format_eval_line(*eval) << std::endl;
    return 0;
  }
  if (absl::Status s = (*trainer)->run(std::cout); !s.ok()) return fail(1, s.message());
  return 0;
}
