// Benchmark of the linear group op (ops/linear_group/linear_group_op.h) on one GPU at the 0.8B
// model's groups (x [1, 2048, 1024] BF16; GDN in_proj_qkv / z / b / a, attention q / k / v, MLP
// gate / up): forward+backward through autograd, the group against the composite (one
// at::linear per weight; autograd adds the input gradients with one add kernel per extra
// consumer), all in this process with CUDA events (warm-up, then the median;
// bench/cuda_timing.h), eager (events around one host call) and graph (kPerGraph calls in
// one CUDA graph: GPU time alone). Prints a Markdown table.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "ops/linear_group/linear_group_op.h"

namespace gdr {
namespace {

constexpr int kWarmup = 10;
constexpr int kRepeats = 50;
constexpr int kPerGraph = 10;

using bench::Timing;

Timing time_both(const std::function<void()>& fn) {
  return bench::median_eager_and_graph_ms(fn, kPerGraph, 3, kWarmup, kRepeats);
}

void bench_group(const char* name, const std::vector<int64_t>& outs) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(1);
  const int64_t T = 2048, in = 1024;
  const at::Tensor x = at::randn({1, T, in}, cuda).to(at::kBFloat16);
  std::vector<at::Tensor> weights, dys;
  for (int64_t out : outs) {
    weights.push_back((at::randn({out, in}, cuda) / std::sqrt(double(in))).to(at::kBFloat16));
    dys.push_back(at::randn({1, T, out}, cuda).to(at::kBFloat16));
  }
  auto fwd_bwd = [&](bool fused) {
    const at::Tensor xv = x.detach().requires_grad_(true);
    std::vector<at::Tensor> ws, inputs{xv};
    for (const at::Tensor& w : weights) ws.push_back(w.detach().requires_grad_(true));
    inputs.insert(inputs.end(), ws.begin(), ws.end());
    const std::vector<at::Tensor> ys =
        fused ? linear_group(xv, ws) : linear_group_composite(xv, ws);
    torch::autograd::grad(ys, inputs, dys);
  };
  const Timing fused = time_both([&] { fwd_bwd(true); });
  const Timing composite = time_both([&] { fwd_bwd(false); });
  std::printf("| %s | %.1f | %.1f | %.1f | %.1f | %.1f |\n", name, composite.eager * 1e3,
              fused.eager * 1e3, composite.graph * 1e3, fused.graph * 1e3,
              (composite.graph - fused.graph) * 1e3);
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("linear_group_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: linear_group_bench\n"
          "  Times forward+backward (autograd) of the 0.8B model's projection groups on\n"
          "  x [1, 2048, 1024] BF16: the linear group op against one at::linear per weight.\n");
      return 0;
    }
    std::fprintf(stderr, "linear_group_bench: unknown argument '%s' (see --help)\n", argv[i]);
    return 2;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "GPU: %s, %d SMs; warm-up %d, median of %d; forward+backward times in us\n\n"
      "| group | composite eager | group eager | composite graph | group graph | graph saved "
      "|\n|---|---|---|---|---|---|\n",
      prop.name, prop.multiProcessorCount, gdr::kWarmup, gdr::kRepeats);
  gdr::bench_group("GDN qkv / z / b / a (6144, 2048, 16, 16)", {6144, 2048, 16, 16});
  gdr::bench_group("attention q / k / v (4096, 512, 512)", {4096, 512, 512});
  gdr::bench_group("MLP gate / up (3584, 3584)", {3584, 3584});
  return 0;
}
