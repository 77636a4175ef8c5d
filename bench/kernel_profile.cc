#include "bench/kernel_profile.h"

#include <cuda_runtime_api.h>
#include <kineto/ActivityType.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <set>
#include <unordered_map>
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

bool is(const torch::autograd::profiler::KinetoEvent& event, libkineto::ActivityType type) {
  return event.activityType() == static_cast<uint8_t>(type);
}

bool is_gpu_work(const torch::autograd::profiler::KinetoEvent& event) {
  return is(event, libkineto::ActivityType::CONCURRENT_KERNEL) ||
         is(event, libkineto::ActivityType::GPU_MEMCPY) ||
         is(event, libkineto::ActivityType::GPU_MEMSET);
}

// GPU time keyed by "operator | kernel" (a markdown row prefix). A kernel/memcpy/memset
// shares its CUPTI correlation id with the host runtime call that launched it
// (cudaLaunchKernel, cudaMemcpyAsync, ...); the launch is attributed to the host operators
// (TorchOp events: aten::*, autograd nodes, record_function scopes) open on the launching
// thread at the call's start. Runtime events carry the thread id of the operator they were
// linked to, and autograd's backward runs on its own device thread, so ops are matched per
// thread.
Totals attribute_to_operators(const std::vector<torch::autograd::profiler::KinetoEvent>& events) {
  using libkineto::ActivityType;
  using Event = torch::autograd::profiler::KinetoEvent;
  std::unordered_map<uint64_t, const Event*> launch_by_correlation;
  std::map<uint64_t, std::vector<const Event*>> ops_by_thread;
  for (const auto& event : events) {
    if (is(event, ActivityType::CUDA_RUNTIME) || is(event, ActivityType::CUDA_DRIVER)) {
      launch_by_correlation[event.correlationId()] = &event;
    } else if (is(event, ActivityType::CPU_OP) || is(event, ActivityType::USER_ANNOTATION)) {
      ops_by_thread[event.startThreadId()].push_back(&event);
    }
  }
  Totals out;
  auto add = [&out](const std::string& op, const Event& gpu) {
    auto& slot = out[op + " | " + gpu.name().substr(0, 60)];
    slot.first += gpu.durationNs() / 1e3;
    slot.second += 1;
  };
  // Eager launches per thread, as (launch start, GPU event).
  std::map<uint64_t, std::vector<std::pair<uint64_t, const Event*>>> launches_by_thread;
  for (const auto& event : events) {
    if (!is_gpu_work(event)) continue;
    const auto it = launch_by_correlation.find(event.correlationId());
    if (it == launch_by_correlation.end()) {
      add("(no launch record)", event);
    } else if (it->second->name().find("GraphLaunch") != std::string::npos) {
      add("(CUDA graph replay)", event);
    } else {
      launches_by_thread[it->second->startThreadId()].emplace_back(it->second->startNs(), &event);
    }
  }
  for (auto& [thread, launches] : launches_by_thread) {
    auto& ops = ops_by_thread[thread];
    // Sweep ops and launches in time order; `open` holds the ops containing the current launch
    // in start order (outer first: a parent starting at the same ns as its child ends later).
    std::sort(ops.begin(), ops.end(), [](const Event* a, const Event* b) {
      return a->startNs() != b->startNs() ? a->startNs() < b->startNs() : a->endNs() > b->endNs();
    });
    std::sort(launches.begin(), launches.end(),
              [](const auto& a, const auto& b) { return a.first < b.first; });
    std::vector<const Event*> open;
    size_t next_op = 0;
    for (const auto& [launch_ns, gpu] : launches) {
      while (next_op < ops.size() && ops[next_op]->startNs() <= launch_ns)
        open.push_back(ops[next_op++]);
      open.erase(std::remove_if(open.begin(), open.end(),
                                [t = launch_ns](const Event* op) { return op->endNs() < t; }),
                 open.end());
      if (open.empty()) {
        add("(no operator)", *gpu);
        continue;
      }
      // The outermost op (the autograd node, or the op the model called) and the two
      // innermost ones: the context and the op that launched.
      std::string chain;
      for (size_t i = 0; i < open.size(); ++i) {
        if (i > 0 && i + 2 < open.size()) {
          if (i == 1) chain += " > ...";
          continue;
        }
        chain += (chain.empty() ? "" : " > ") + open[i]->name().substr(0, 60);
      }
      add(chain, *gpu);
    }
  }
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
  if (options.top_host_operators > 0) {
    std::printf(
        "\nMost-called host operators, %s:\n| operator | calls | ms incl. nested |\n"
        "|---|---|---|\n",
        title.c_str());
    const auto by_calls = ranked<int>(host_ms, [](double, int calls) { return calls; });
    for (size_t i = 0; i < by_calls.size() && static_cast<int>(i) < options.top_host_operators;
         ++i) {
      const auto& [calls, name] = by_calls[i];
      std::printf("| %s | %d | %.1f |\n", name.c_str(), calls, host_ms.at(name).first);
    }
  }
  if (options.top_attributed > 0) {
    const Totals attributed = attribute_to_operators(result->events());
    std::printf(
        "\nGPU time by launching host operator, %s (outermost op > ... > the two innermost):\n"
        "| operator | kernel | ms | calls |\n|---|---|---|---|\n",
        title.c_str());
    const auto rows = ranked<double>(attributed, [](double total, int) { return total; });
    for (size_t i = 0; i < rows.size() && static_cast<int>(i) < options.top_attributed; ++i) {
      const auto& [us, row] = rows[i];
      std::printf("| %s | %.3f | %d |\n", row.c_str(), us / 1e3, attributed.at(row).second);
    }
  }
}

}  // namespace gdr::bench
