// Benchmark of the fused causal-LM cross-entropy on one GPU against the ATen composite
// the model used before (narrow + to(Float) + at::cross_entropy_loss, with autograd):
// fused forward, fused forward + backward (autograd, the way training runs it), the same
// two for the composite, and a device-to-device copy of the same bytes as the bandwidth
// roofline, all in this process with CUDA events (warm-up, then the median of timed
// repetitions). Each fused case is also timed as a CUDA graph of the forward and
// backward ops ("graph": GPU time alone; the eager op includes the host check of the
// targets, one sync, Note [Cross-entropy target check]). Peak memory: the caching
// allocator's peak allocated bytes during one call above what was allocated before it.
// Prints a Markdown table.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "ops/cross_entropy/cross_entropy_op.h"

namespace gdr {
namespace {

constexpr int kWarmup = 5;
constexpr int kRepeats = 30;
constexpr int64_t kIgnore = -100;

double median_ms(const std::function<void()>& fn) {
  return bench::median_event_ms(fn, kWarmup, kRepeats);
}

// GPU time of one call: the call captured alone in a CUDA graph (after one eager call),
// median over replays; -1 when the work cannot be captured.
double graph_ms(const std::function<void()>& fn) {
  return bench::median_graph_ms(fn, 1, 1, kWarmup, kRepeats);
}

// Peak allocated bytes during one call of `fn`, above the bytes allocated before it.
double peak_delta_gib(const std::function<void()>& fn) {
  const c10::DeviceIndex device = c10::cuda::current_device();
  constexpr auto kAggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  cudaDeviceSynchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(device);
  const int64_t before =
      c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[kAggregate].current;
  fn();
  cudaDeviceSynchronize();
  const int64_t peak =
      c10::cuda::CUDACachingAllocator::getDeviceStats(device).allocated_bytes[kAggregate].peak;
  return static_cast<double>(peak - before) / (1 << 30);
}

struct Shape {
  int64_t B, T, V;
};

void bench_shape(const Shape& s, at::ScalarType dtype) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(1);
  const at::Tensor logits = (at::randn({s.B, s.T, s.V}, cuda) * 3).to(dtype);
  const at::Tensor labels = at::randint(0, s.V, {s.B, s.T}, cuda.dtype(at::kLong));
  const at::Tensor g = at::ones({}, cuda);
  const int64_t elem = static_cast<int64_t>(c10::elementSize(dtype));
  // Bytes the fused op must move: the forward reads the scored rows once; the backward
  // reads them again and writes the full [B, T, V] gradient.
  const int64_t fwd_bytes = s.B * (s.T - 1) * s.V * elem;
  const int64_t fb_bytes = 2 * fwd_bytes + s.B * s.T * s.V * elem;

  const double copy_fwd = graph_ms(bench::device_copy(fwd_bytes)),
               copy_fb = graph_ms(bench::device_copy(fb_bytes));

  auto fused_forward = [&] { causal_lm_cross_entropy_forward(logits, labels, kIgnore); };
  auto fused_forward_backward_ops = [&] {
    auto [loss, lse, count] = causal_lm_cross_entropy_forward(logits, labels, kIgnore);
    causal_lm_cross_entropy_backward(g, logits, labels, lse, count, kIgnore);
  };
  auto autograd_step = [&](bool fused) {
    at::Tensor x = logits.detach().requires_grad_(true);
    const at::Tensor loss = fused ? causal_lm_cross_entropy(x, labels, kIgnore)
                                  : causal_lm_cross_entropy_composite(x, labels, kIgnore);
    torch::autograd::grad({loss}, {x}, {g});
  };
  auto composite_forward = [&] {
    at::NoGradGuard no_grad;
    causal_lm_cross_entropy_composite(logits, labels, kIgnore);
  };

  const double f_fwd = median_ms(fused_forward), f_fwd_graph = graph_ms(fused_forward);
  const double f_fb = median_ms([&] { autograd_step(true); });
  const double f_fb_graph = graph_ms(fused_forward_backward_ops);
  const double c_fwd = median_ms(composite_forward);
  const double c_fb = median_ms([&] { autograd_step(false); });
  const double m_f_fwd = peak_delta_gib(fused_forward), m_c_fwd = peak_delta_gib(composite_forward);
  const double m_f_fb = peak_delta_gib([&] { autograd_step(true); });
  const double m_c_fb = peak_delta_gib([&] { autograd_step(false); });

  auto gbs = [](int64_t bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; };
  std::printf(
      "| %lldx%lldx%lld %s | forward | %.3f / %.3f | %.0f GB/s, %.2f of copy | %.3f | %.2fx | "
      "%.2f / %.2f |\n",
      static_cast<long long>(s.B), static_cast<long long>(s.T), static_cast<long long>(s.V),
      c10::toString(dtype), f_fwd, f_fwd_graph, gbs(fwd_bytes, f_fwd_graph), copy_fwd / f_fwd_graph,
      c_fwd, c_fwd / f_fwd, m_f_fwd, m_c_fwd);
  std::printf(
      "| %lldx%lldx%lld %s | forward+backward | %.3f / %.3f | %.0f GB/s, %.2f of copy | %.3f | "
      "%.2fx | %.2f / %.2f |\n",
      static_cast<long long>(s.B), static_cast<long long>(s.T), static_cast<long long>(s.V),
      c10::toString(dtype), f_fb, f_fb_graph, gbs(fb_bytes, f_fb_graph), copy_fb / f_fb_graph, c_fb,
      c_fb / f_fb, m_f_fb, m_c_fb);
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("cross_entropy_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  std::vector<gdr::Shape> shapes = {{1, 2048, 248320}, {4, 2048, 248320}};
  at::ScalarType dtype = at::kBFloat16;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: cross_entropy_bench [--shapes=BxTxV,...] [--dtype=bf16|f16|f32]\n"
          "  Times the fused causal-LM cross-entropy (forward; forward+backward through\n"
          "  autograd) against the ATen composite (narrow + to(Float) + cross_entropy_loss),\n"
          "  with effective GB/s, the ratio to a device copy of the same bytes, and the peak\n"
          "  allocated memory of one call above what was allocated before it.\n"
          "  --shapes  B x T x V list (default 1x2048x248320,4x2048x248320)\n"
          "  --dtype   logits dtype (default bf16)\n");
      return 0;
    }
    if (arg.rfind("--shapes=", 0) == 0) {
      shapes.clear();
      std::stringstream list(arg.substr(9));
      std::string item;
      while (std::getline(list, item, ',')) {
        long long b = 0, t = 0, v = 0;
        if (std::sscanf(item.c_str(), "%lldx%lldx%lld", &b, &t, &v) != 3 || b <= 0 || t < 2 ||
            v <= 0) {
          std::fprintf(stderr,
                       "cross_entropy_bench: --shapes expects BxTxV with B >= 1, T >= 2, V >= 1, "
                       "got '%s'\n",
                       item.c_str());
          return 2;
        }
        shapes.push_back({b, t, v});
      }
    } else if (arg.rfind("--dtype=", 0) == 0) {
      const std::string d = arg.substr(8);
      if (d == "bf16") {
        dtype = at::kBFloat16;
      } else if (d == "f16") {
        dtype = at::kHalf;
      } else if (d == "f32") {
        dtype = at::kFloat;
      } else {
        std::fprintf(stderr, "cross_entropy_bench: --dtype expects bf16, f16 or f32, got '%s'\n",
                     d.c_str());
        return 2;
      }
    } else {
      std::fprintf(stderr, "cross_entropy_bench: unknown argument '%s' (see --help)\n",
                   arg.c_str());
      return 2;
    }
  }
  std::printf(
      "| B x T x V dtype | pass | fused ms eager / graph | fused bandwidth (graph) | composite ms "
      "| composite / fused (eager) | peak GiB fused / composite |\n"
      "|---|---|---|---|---|---|---|\n");
  for (const gdr::Shape& s : shapes) gdr::bench_shape(s, dtype);
  return 0;
}
