// Forward+backward time of the Qwen3.5-0.8B text model on one GPU (BF16, batch 1,
// sequence 2048) per arm: warm-up, then the median of timed iterations (CUDA events);
// prints ms per step and tokens/s, then one profiled step per arm (PyTorch's Kineto
// profiler) with the top CUDA kernels, their launch count, and GPU-busy vs wall time (a
// launch-bound step shows busy << wall).
//   qwen_step_bench [--arms=none,gate,gate+det,full]
// An arm is a pre_gdr_fusion level, "+det" runs it with deterministic algorithms on (the
// trainer's deterministic_mode; uninitialized-memory fill off as in
// models/qwen/deterministic_mode.cc). GDR_CORE_IMPL (ops/gdr_core.h) picks the GDR core.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <map>
#include <set>
#include <string>
#include <vector>

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
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  std::vector<Arm> ran;
  std::printf("| arm | fwd+bwd ms (median of 5) | tokens/s |\n|---|---|---|\n");
  for (const Arm& arm : arms) {
    try {
      set_deterministic(arm.deterministic);
      model->set_pre_gdr_fusion(arm.fusion);
      std::vector<float> samples;
      for (int i = 0; i < 7; ++i) {
        cudaEvent_t start, stop;
        cudaEventCreate(&start);
        cudaEventCreate(&stop);
        model->zero_grad();
        cudaEventRecord(start, stream);
        model->loss(ids, ids).backward();
        cudaEventRecord(stop, stream);
        cudaEventSynchronize(stop);
        float ms = 0;
        cudaEventElapsedTime(&ms, start, stop);
        cudaEventDestroy(start);
        cudaEventDestroy(stop);
        if (i >= 2) samples.push_back(ms);
      }
      std::sort(samples.begin(), samples.end());
      const float median = samples[samples.size() / 2];
      std::printf("| %s | %.1f | %.0f |\n", arm.name.c_str(), median, seq / (median * 1e-3));
      ran.push_back(arm);
    } catch (const std::exception& e) {
      std::printf("| %s | failed: %s | |\n", arm.name.c_str(),
                  std::string(e.what()).substr(0, 200).c_str());
    }
  }
  // Where the time goes: GPU kernel time of one step, aggregated by kernel name.
  namespace prof = torch::autograd::profiler;
  for (const Arm& arm : ran) {
    set_deterministic(arm.deterministic);
    model->set_pre_gdr_fusion(arm.fusion);
    const std::set<torch::profiler::impl::ActivityType> activities = {
        torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
    const torch::profiler::impl::ProfilerConfig profiler_config(
        torch::profiler::impl::ProfilerState::KINETO);
    prof::prepareProfiler(profiler_config, activities);
    prof::enableProfiler(profiler_config, activities);
    const auto wall_start = std::chrono::steady_clock::now();
    model->zero_grad();
    model->loss(ids, ids).backward();
    cudaDeviceSynchronize();
    const double wall_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall_start)
            .count();
    const auto result = prof::disableProfiler();
    std::map<std::string, std::pair<double, int>> by_kernel;
    double total_us = 0;
    int launches = 0;
    std::map<std::string, std::pair<double, int>> by_cpu_op;  // host: ms (incl. children), calls
    for (const auto& event : result->events()) {
      if (event.deviceType() != c10::DeviceType::CUDA) {
        auto& op = by_cpu_op[event.name().substr(0, 60)];
        op.first += event.durationNs() / 1e6;
        op.second += 1;
        continue;
      }
      const double us = event.durationNs() / 1e3;
      auto& slot = by_kernel[event.name().substr(0, 90)];
      slot.first += us;
      slot.second += 1;
      total_us += us;
      ++launches;
    }
    std::vector<std::pair<double, std::string>> ranked;
    for (const auto& [name, v] : by_kernel) ranked.emplace_back(v.first, name);
    std::sort(ranked.rbegin(), ranked.rend());
    std::printf(
        "\nTop GPU kernels, arm %s (GPU busy %.1f ms of %.1f ms wall under the profiler, %d "
        "kernels and copies):\n| kernel | ms | %% | calls |\n|---|---|---|---|\n",
        arm.name.c_str(), total_us / 1e3, wall_ms, launches);
    for (size_t i = 0; i < ranked.size() && i < 25; ++i) {
      std::printf("| %s | %.2f | %.1f | %d |\n", ranked[i].second.c_str(), ranked[i].first / 1e3,
                  100.0 * ranked[i].first / total_us, by_kernel[ranked[i].second].second);
    }
    // Host side: which operators are called most (the step is host-bound), with their wall
    // time under the profiler including nested operators.
    std::vector<std::pair<int, std::string>> by_calls;
    for (const auto& [name, v] : by_cpu_op) by_calls.emplace_back(v.second, name);
    std::sort(by_calls.rbegin(), by_calls.rend());
    std::printf(
        "\nMost-called host operators, arm %s:\n| operator | calls | ms incl. nested |\n"
        "|---|---|---|\n",
        arm.name.c_str());
    for (size_t i = 0; i < by_calls.size() && i < 30; ++i) {
      std::printf("| %s | %d | %.1f |\n", by_calls[i].second.c_str(), by_calls[i].first,
                  by_cpu_op[by_calls[i].second].first);
    }
  }
  return 0;
}
