// Forward+backward time of the Qwen3.5-0.8B text model on one GPU (BF16, batch 1,
// sequence 2048) per arm: warm-up, then the median of timed iterations (CUDA events);
// prints ms per step and tokens/s, then one profiled step per arm (PyTorch's Kineto
// profiler) with the top CUDA kernels, their launch count, and GPU-busy vs wall time (a
// launch-bound step shows busy << wall).
//   qwen_step_bench [--arms=none,gate,gate+det,full]
// An arm is a pre_gdr_fusion level, "+det" runs it with deterministic algorithms on (the
// trainer's deterministic_mode; uninitialized-memory fill off as in
// ops/policy/determinism.cc). GDR_CORE_IMPL (ops/gdr_core/gdr_core_op.h) picks the GDR core.
#include <ATen/ATen.h>

#include <cstdio>
#include <cstring>
#include <exception>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "bench/kernel_profile.h"
#include "models/qwen/config.h"
#include "models/qwen/model.h"

namespace {

struct Arm {
  std::string name;
  gdr::PreGdrFusion fusion;
  bool deterministic;
};

bool parse_arms(const std::string& list, std::vector<Arm>* arms) {
  size_t begin = 0;
  while (begin <= list.size()) {
    size_t end = list.find(',', begin);
    if (end == std::string::npos) end = list.size();
    const std::string name = list.substr(begin, end - begin);
    std::string level = name;
    bool det = false;
    if (level.size() > 4 && level.compare(level.size() - 4, 4, "+det") == 0) {
      level.resize(level.size() - 4);
      det = true;
    }
    gdr::PreGdrFusion fusion;
    if (level == "none") {
      fusion = gdr::PreGdrFusion::kNone;
    } else if (level == "gate") {
      fusion = gdr::PreGdrFusion::kGate;
    } else if (level == "full") {
      fusion = gdr::PreGdrFusion::kFull;
    } else {
      std::fprintf(stderr,
                   "qwen_step_bench: --arms: expected none, gate or full (optionally +det) but "
                   "got \"%s\"\n",
                   name.c_str());
      return false;
    }
    arms->push_back({name, fusion, det});
    begin = end + 1;
  }
  return true;
}

void set_deterministic(bool on) {
  at::globalContext().setDeterministicAlgorithms(on, /*warn_only=*/false);
  at::globalContext().setDeterministicFillUninitializedMemory(false);
}

}  // namespace

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("qwen_step_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  std::string arms_arg = "none,gate,gate+det";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: qwen_step_bench [--arms=none,gate,gate+det,full]\n  Times forward+backward "
          "of configs/qwen3_5_0_8b.yaml in BF16 at batch 1 x sequence 2048 per arm.\n");
      return 0;
    }
    if (arg.rfind("--arms=", 0) == 0) {
      arms_arg = arg.substr(7);
    } else {
      std::fprintf(stderr, "qwen_step_bench: unknown argument %s (see --help)\n", arg.c_str());
      return 2;
    }
  }
  std::vector<Arm> arms;
  if (!parse_arms(arms_arg, &arms)) return 2;
  auto config = gdr::load_qwen_config("configs/qwen3_5_0_8b.yaml");
  if (!config.ok()) {
    std::fprintf(stderr, "qwen_step_bench: %s\n", std::string(config.status().message()).c_str());
    return 2;
  }
  gdr::QwenForCausalLM model(*config);
  gdr::init_qwen_weights(*model, 1);
  model->to(at::kCUDA, at::kBFloat16);
  const int64_t seq = 2048;
  const at::Tensor ids = at::randint(0, config->vocab_size, {1, seq},
                                     at::TensorOptions().device(at::kCUDA).dtype(at::kLong));
  std::vector<Arm> ran;
  std::printf("| arm | fwd+bwd ms (median of 5) | tokens/s |\n|---|---|---|\n");
  for (const Arm& arm : arms) {
    try {
      set_deterministic(arm.deterministic);
      model->set_pre_gdr_fusion(arm.fusion);
      // 2 warm-up steps, then the median of 5 timed ones; zero_grad outside the events.
      gdr::bench::EventTimer timer;
      std::vector<double> samples;
      for (int i = 0; i < 7; ++i) {
        model->zero_grad();
        const double ms = timer.time_ms([&] { model->loss(ids, ids).backward(); });
        if (i >= 2) samples.push_back(ms);
      }
      const double median = gdr::bench::median_of(samples);
      std::printf("| %s | %.1f | %.0f |\n", arm.name.c_str(), median, seq / (median * 1e-3));
      ran.push_back(arm);
    } catch (const std::exception& e) {
      std::printf("| %s | failed: %s | |\n", arm.name.c_str(),
                  std::string(e.what()).substr(0, 200).c_str());
    }
  }
  // Where the time goes: GPU kernel time of one step, aggregated by kernel name, and the
  // most-called host operators (the step can be host-bound).
  for (const Arm& arm : ran) {
    set_deterministic(arm.deterministic);
    model->set_pre_gdr_fusion(arm.fusion);
    gdr::bench::print_kernel_profile("arm " + arm.name,
                                     [&] {
                                       model->zero_grad();
                                       model->loss(ids, ids).backward();
                                     },
                                     {.top_kernels = 25, .top_host_operators = 30});
  }
  return 0;
}
