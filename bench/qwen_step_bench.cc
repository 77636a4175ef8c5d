// Forward+backward time of the Qwen3.5-0.8B text model on one GPU (BF16, batch 1,
// sequence 2048) for the `none` and `gate` pre-GDR fusion levels: warm-up, then the
// median of timed iterations (CUDA events); prints ms per step and tokens/s, then one
// profiled step per fusion level (PyTorch's Kineto profiler) with the top CUDA kernels.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "models/qwen/config.h"
#include "models/qwen/model.h"

int main(int argc, char** argv) {
  if (argc > 1 && std::strcmp(argv[1], "--help") == 0) {
    std::printf(
        "usage: qwen_step_bench\n  Times forward+backward of configs/qwen3_5_0_8b.yaml in BF16 at\n"
        "  batch 1 x sequence 2048 for pre_gdr_fusion none and gate.\n");
    return 0;
  }
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
  std::printf("| fusion | fwd+bwd ms (median of 5) | tokens/s |\n|---|---|---|\n");
  for (auto fusion : {gdr::PreGdrFusion::kNone, gdr::PreGdrFusion::kGate}) {
    model->set_pre_gdr_fusion(fusion);
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
      if (i >= 2) samples.push_back(ms);
    }
    std::sort(samples.begin(), samples.end());
    const float median = samples[samples.size() / 2];
    std::printf("| %s | %.1f | %.0f |\n", std::string(gdr::pre_gdr_fusion_name(fusion)).c_str(),
                median, seq / (median * 1e-3));
  }
  // Where the time goes: GPU kernel time of one step, aggregated by kernel name.
  namespace prof = torch::autograd::profiler;
  for (auto fusion : {gdr::PreGdrFusion::kNone, gdr::PreGdrFusion::kGate}) {
    model->set_pre_gdr_fusion(fusion);
    const std::set<torch::profiler::impl::ActivityType> activities = {
        torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
    const torch::profiler::impl::ProfilerConfig config(
        torch::profiler::impl::ProfilerState::KINETO);
    prof::prepareProfiler(config, activities);
    prof::enableProfiler(config, activities);
    model->zero_grad();
    model->loss(ids, ids).backward();
    cudaDeviceSynchronize();
    const auto result = prof::disableProfiler();
    std::map<std::string, std::pair<double, int>> by_kernel;
    double total_us = 0;
    for (const auto& event : result->events()) {
      if (event.deviceType() != c10::DeviceType::CUDA) continue;
      const double us = event.durationNs() / 1e3;
      auto& slot = by_kernel[event.name().substr(0, 90)];
      slot.first += us;
      slot.second += 1;
      total_us += us;
    }
    std::vector<std::pair<double, std::string>> ranked;
    for (const auto& [name, v] : by_kernel) ranked.emplace_back(v.first, name);
    std::sort(ranked.rbegin(), ranked.rend());
    std::printf(
        "\nTop GPU kernels, fusion %s (GPU busy %.1f ms in one step):\n| kernel | ms | %% | calls "
        "|\n|---|---|---|---|\n",
        std::string(gdr::pre_gdr_fusion_name(fusion)).c_str(), total_us / 1e3);
    for (size_t i = 0; i < ranked.size() && i < 12; ++i) {
      std::printf("| %s | %.2f | %.1f | %d |\n", ranked[i].second.c_str(), ranked[i].first / 1e3,
                  100.0 * ranked[i].first / total_us, by_kernel[ranked[i].second].second);
    }
  }
  return 0;
}
