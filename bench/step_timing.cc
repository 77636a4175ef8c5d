// Step-timing harness: W warm-up + T timed optimizer steps of the trainer on a run config,
// then the median and spread of step time, tokens/s and peak allocated CUDA memory.
// Each step's time is the trainer's own (host clock around the whole step; the step ends
// by reading the losses, which waits for the GPU). For paired comparisons of two arms in
// alternating fresh processes, see bench/step_timing_paired.sh.
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "bench/kernel_profile.h"
#include "gdr/run_config.h"
#include "gdr/trainer.h"

namespace {

constexpr char kUsage[] =
    "usage: step_timing --config=FILE [--set=SECTION.KEY=VALUE ...] [--warmup=5] [--steps=50]\n"
    "                   [--json=PATH] [--profile]\n"
    "Runs W warm-up and T timed optimizer steps and prints the median and spread of the\n"
    "step time, tokens/s and the peak allocated CUDA memory; --json also writes them.\n"
    "--profile: then one more step under the Kineto profiler, with its top GPU kernels\n"
    "(graph replays included), GPU-busy vs wall time and GPU time by launching host operator\n"
    "(eager launches only: add --set=train.cuda_graphs=false to attribute graph-captured work).\n";

int fail(int code, absl::string_view message) {
  std::cerr << "step_timing: error: " << message << "\n";
  return code;
}

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

}  // namespace

int main(int argc, char** argv) {
  std::string config_path, json_path;
  int64_t warmup = 5, steps = 50;
  bool profile = false;
  std::vector<gdr::ConfigOverride> overrides;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help") {
      std::cout << kUsage;
      return 0;
    }
    if (absl::ConsumePrefix(&arg, "--config=")) {
      config_path = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--json=")) {
      json_path = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--warmup=")) {
      if (!absl::SimpleAtoi(arg, &warmup) || warmup < 0)
        return fail(2, "--warmup expects an integer >= 0");
    } else if (absl::ConsumePrefix(&arg, "--steps=")) {
      if (!absl::SimpleAtoi(arg, &steps) || steps < 1)
        return fail(2, "--steps expects an integer >= 1");
    } else if (arg == "--profile") {
      profile = true;
    } else if (absl::ConsumePrefix(&arg, "--set=")) {
      auto o = gdr::parse_config_override(std::string(arg));
      if (!o.ok()) return fail(2, o.status().message());
      overrides.push_back(*o);
    } else {
      return fail(2, std::string("unknown argument '") + argv[i] + "' (see --help)");
    }
  }
  if (config_path.empty()) return fail(2, "--config=FILE is required (see --help)");
  // The harness owns the step count: enough steps for warm-up + timing, no checkpoints.
  overrides.push_back({"train.steps", std::to_string(warmup + steps + (profile ? 1 : 0))});
  auto config = gdr::load_run_config(config_path, overrides);
  if (!config.ok()) return fail(2, config.status().message());
  auto trainer = gdr::Trainer::create(*config);
  if (!trainer.ok()) return fail(2, trainer.status().message());

  const bool cuda = c10::cuda::device_count() > 0;
  std::vector<double> times, rates, host_queue, gpu_wait;
  int64_t replays = 0;
  for (int64_t i = 0; i < warmup + steps; ++i) {
    if (i == warmup && cuda)
      c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
    auto stats = (*trainer)->train_step();
    if (!stats.ok()) return fail(1, stats.status().message());
    if (i >= warmup) {
      times.push_back(stats->step_time_s);
      rates.push_back(stats->tokens_per_s);
      host_queue.push_back(stats->host_queue_s);
      gpu_wait.push_back(stats->gpu_wait_s);
      replays += stats->graph_replays;
    }
  }
  // Allocated: what tensors held at the peak; reserved: what the caching allocator held
  // from the driver (graph pools included), the process's real footprint.
  double peak_gib = 0, peak_reserved_gib = 0;
  if (cuda) {
    const auto device_stats =
        c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
    constexpr auto kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    peak_gib = device_stats.allocated_bytes[kAggregate].peak / 1073741824.0;
    peak_reserved_gib = device_stats.reserved_bytes[kAggregate].peak / 1073741824.0;
  }
  const double median = percentile(times, 0.5), p10 = percentile(times, 0.1),
               p90 = percentile(times, 0.9);
  const double tokens_per_s = percentile(rates, 0.5);
  std::printf(
      "RESULT warmup=%lld steps=%lld median_step_s=%.4f p10_s=%.4f p90_s=%.4f min_s=%.4f "
      "max_s=%.4f "
      "tokens_per_s=%.0f peak_allocated_gib=%.2f peak_reserved_gib=%.2f "
      "median_host_queue_s=%.4f median_gpu_wait_s=%.4f graph_replays=%lld\n",
      static_cast<long long>(warmup), static_cast<long long>(steps), median, p10, p90,
      *std::min_element(times.begin(), times.end()), *std::max_element(times.begin(), times.end()),
      tokens_per_s, peak_gib, peak_reserved_gib, percentile(host_queue, 0.5),
      percentile(gpu_wait, 0.5), static_cast<long long>(replays));
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    out << "{\"median_step_s\": " << median << ", \"p10_s\": " << p10 << ", \"p90_s\": " << p90
        << ", \"tokens_per_s\": " << tokens_per_s << ", \"peak_allocated_gib\": " << peak_gib
        << ", \"peak_reserved_gib\": " << peak_reserved_gib << ", \"steps\": " << steps
        << ", \"warmup\": " << warmup << "}\n";
    if (!out) return fail(2, "cannot write " + json_path);
  }
  if (profile) {
    absl::Status step_status;
    gdr::bench::print_kernel_profile("one optimizer step",
                                     [&] {
                                       auto stats = (*trainer)->train_step();
                                       if (!stats.ok()) step_status = stats.status();
                                     },
                                     {.top_kernels = 40, .top_attributed = 80});
    if (!step_status.ok()) return fail(1, step_status.message());
  }
  return 0;
}
