#include "bench/kernel_profile.h"

#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <utility>
#include <vector>

namespace gdr::bench {
namespace {

// name -> (total, count), ranked by `rank_by` descending.
using Totals = std::map<std::string, std::pair<double, int>>;

template <typename Key>
std::vector<std::pair<Key, std::string>> ranked(const Totals& totals, Key (*rank_by)(double, int)) {
  std::vector<std::pair<Key, std::string>> out;
  for (const auto& [name, v] : totals) out.emplace_back(rank_by(v.first, v.second), name);
  std::sort(out.rbegin(), out.rend());
  return out;
}

}  // namespace

void print_kernel_profile(const std::string& title, const std::function<void()>& work,
                          const KernelProfileOptions& options) {
  namespace prof = torch::autograd::profiler;
  const std::set<torch::profiler::impl::ActivityType> activities = {
      torch::profiler::impl::ActivityType::CPU, torch::profiler::impl::ActivityType::CUDA};
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
  cudaDeviceSynchronize();
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  const auto wall_start = std::chrono::steady_clock::now();
  work();
  cudaDeviceSynchronize();
  const double wall_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - wall_start)
          .count();
  const auto result = prof::disableProfiler();

  Totals kernels_us;  // GPU: us, launches
  Totals host_ms;     // host: ms including nested operators, calls
  double busy_us = 0;
  int launches = 0;
  for (const auto& event : result->events()) {
    if (event.deviceType() != c10::DeviceType::CUDA) {
      auto& op = host_ms[event.name().substr(0, 60)];
      op.first += event.durationNs() / 1e6;
      op.second += 1;
      continue;
    }
    const double us = event.durationNs() / 1e3;
    auto& slot = kernels_us[event.name().substr(0, 90)];
    slot.first += us;
    slot.second += 1;
    busy_us += us;
    ++launches;
  }
  std::printf(
      "\nTop GPU kernels, %s (GPU busy %.2f ms of %.2f ms wall under the profiler, %d kernels "
      "and copies):\n| kernel | ms | %% | calls |\n|---|---|---|---|\n",
      title.c_str(), busy_us / 1e3, wall_ms, launches);
  const auto by_time = ranked<double>(kernels_us, [](double total, int) { return total; });
  for (size_t i = 0; i < by_time.size() && static_cast<int>(i) < options.top_kernels; ++i) {
    const auto& [us, name] = by_time[i];
    std::printf("| %s | %.3f | %.1f | %d |\n", name.c_str(), us / 1e3, 100.0 * us / busy_us,
                kernels_us.at(name).second);
  }
  if (options.top_host_operators <= 0) return;
  std::printf(
      "\nMost-called host operators, %s:\n| operator | calls | ms incl. nested |\n|---|---|---|\n",
      title.c_str());
  const auto by_calls = ranked<int>(host_ms, [](double, int calls) { return calls; });
  for (size_t i = 0; i < by_calls.size() && static_cast<int>(i) < options.top_host_operators; ++i) {
    const auto& [calls, name] = by_calls[i];
    std::printf("| %s | %d | %.1f |\n", name.c_str(), calls, host_ms.at(name).first);
  }
}

}  // namespace gdr::bench
