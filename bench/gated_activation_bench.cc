// Benchmark of the fused gated activations (ops/gated_activation/gated_activation_op.h) on one GPU
// at the 0.8B model's shapes: silu(gate) * x for the MLP ([1, 2048, 3584]) and x * sigmoid(gate)
// for gated attention ([1, 2048, 2048], the gate split off q_proj's output as in the model), fused
// against the ATen composite (the model's path before the op), with a device copy of the same bytes
// as the bandwidth roofline, all in this process with CUDA events (warm-up, then the median;
// bench/cuda_timing.h), eager (events around one host call) and graph (kPerGraph calls in one CUDA
// graph: GPU time alone). Compulsory traffic: forward reads gate and x and writes y (3 tensors),
// backward reads dy, gate, x and writes both gradients (5), forward+backward 8. Prints a Markdown
// table.
#include <ATen/ATen.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "ops/gated_activation/gated_activation_op.h"

namespace gdr {
namespace {

constexpr int kWarmup = 10;
constexpr int kRepeats = 50;
constexpr int kPerGraph = 20;

using bench::Timing;

Timing time_both(const std::function<void()>& fn) {
  return bench::median_eager_and_graph_ms(fn, kPerGraph, 3, kWarmup, kRepeats);
}

void print_row(const char* shape, at::ScalarType dtype, const char* what, const Timing& t,
               int64_t bytes) {
  const double copy =
      bench::median_graph_ms(bench::device_copy(bytes), kPerGraph, 3, kWarmup, kRepeats);
  std::printf("| %s | %s | %s | %.1f | %.1f | %.0f | %.2f |\n", shape, c10::toString(dtype), what,
              t.eager * 1e3, t.graph * 1e3, t.graph > 0 ? bytes / (t.graph * 1e-3) / 1e9 : 0.0,
              t.graph > 0 ? copy / t.graph : 0.0);
}

void bench_case(GatedActivationKind kind, at::ScalarType dtype) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(1);
  const bool silu = kind == GatedActivationKind::kSilu;
  const char* shape = silu ? "MLP 2048 x 3584 (silu)" : "attention 2048 x 8 x 256 (sigmoid)";
  at::Tensor gate, x;
  if (silu) {
    gate = (at::randn({1, 2048, 3584}, cuda) * 3).to(dtype);
    x = at::randn({1, 2048, 3584}, cuda).to(dtype);
  } else {
    const at::Tensor projection = (at::randn({1, 2048, 8, 512}, cuda) * 3).to(dtype);
    gate = at::split(projection, 256, -1)[1];
    x = at::randn({1, 2048, 2048}, cuda).to(dtype);
  }
  const at::Tensor dy = at::randn(x.sizes(), cuda).to(dtype);
  const int64_t tensor_bytes = x.numel() * static_cast<int64_t>(c10::elementSize(dtype));
  auto fwd_bwd = [&](bool fused) {
    at::Tensor g = gate.detach().requires_grad_(true), xv = x.detach().requires_grad_(true);
    const at::Tensor y =
        fused ? gated_activation_fused(g, xv, kind) : gated_activation_composite(g, xv, kind);
    torch::autograd::grad({y}, {g, xv}, {dy});
  };
  const Timing fused_fwd = time_both([&] { gated_activation_forward(gate, x, kind); });
  const Timing fused_bwd = time_both([&] { gated_activation_backward(dy, gate, x, kind); });
  const Timing fused_fb = time_both([&] { fwd_bwd(true); });
  const Timing aten_fwd = time_both([&] { gated_activation_composite(gate, x, kind); });
  const Timing aten_fb = time_both([&] { fwd_bwd(false); });
  print_row(shape, dtype, "fused forward", fused_fwd, 3 * tensor_bytes);
  print_row(shape, dtype, "fused backward (op)", fused_bwd, 5 * tensor_bytes);
  print_row(shape, dtype, "fused fwd+bwd (autograd)", fused_fb, 8 * tensor_bytes);
  print_row(shape, dtype, "ATen forward", aten_fwd, 3 * tensor_bytes);
  print_row(shape, dtype, "ATen fwd+bwd (autograd)", aten_fb, 8 * tensor_bytes);
  std::printf(
      "|  |  | ATen / fused: forward %.2fx / %.2fx, fwd+bwd %.2fx / %.2fx (eager / graph) |"
      "  |  |  |  |\n",
      aten_fwd.eager / fused_fwd.eager, aten_fwd.graph / fused_fwd.graph,
      aten_fb.eager / fused_fb.eager, aten_fb.graph / fused_fb.graph);
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("gated_activation_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  std::vector<at::ScalarType> dtypes = {at::kBFloat16};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: gated_activation_bench [--all-dtypes]\n"
          "  Times the fused gated activations (forward, backward, forward+backward through\n"
          "  autograd) against the ATen composite and a device copy of the same bytes at the\n"
          "  0.8B model's MLP and attention shapes; BF16, or BF16, FP16 and FP32 with\n"
          "  --all-dtypes.\n");
      return 0;
    }
    if (arg == "--all-dtypes") {
      dtypes = {at::kBFloat16, at::kHalf, at::kFloat};
    } else {
      std::fprintf(stderr, "gated_activation_bench: unknown argument '%s' (see --help)\n", argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "GPU: %s, %d SMs; warm-up %d, median of %d; times in us (eager / graph); GB/s and copy "
      "ratio from graph times\n\n| shape | dtype | case | eager us | graph us | GB/s | copy time / "
      "op time |\n|---|---|---|---|---|---|---|\n",
      prop.name, prop.multiProcessorCount, gdr::kWarmup, gdr::kRepeats);
  for (at::ScalarType dtype : dtypes) {
    gdr::bench_case(gdr::GatedActivationKind::kSilu, dtype);
    gdr::bench_case(gdr::GatedActivationKind::kSigmoid, dtype);
  }
  return 0;
}
