// Benchmark of the causal attention op (ops/attention/attention_op.h) at the 0.8B model's attention
// (B = 1, 8 query heads over 2 key heads, head_dim 256, BF16) and longer sequences: the
// cuDNN op with its deterministic and its default backward against ATen's
// scaled_dot_product_attention with deterministic algorithms on (FlashAttention 2 with
// split dQ accumulators) and off (ATen's own choice), all in this process, forward and
// forward+backward through autograd, GPU time from CUDA graphs of kPerGraph calls
// (bench/cuda_timing.h). FLOPs: 4 B Hq T^2 D / 2 forward (causal half), 2.5x that backward.
// Prints a Markdown table.
#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>

#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "ops/attention/attention_op.h"
#include "ops/policy/determinism.h"

namespace gdr {
namespace {

constexpr int kWarmup = 5;
constexpr int kRepeats = 30;
constexpr int kPerGraph = 10;

struct Arm {
  const char* name;
  bool cudnn;
  bool deterministic;
};

void bench_shape(int64_t B, int64_t Hq, int64_t Hkv, int64_t T, int64_t D) {
  const auto o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  at::manual_seed(1);
  const at::Tensor q = at::randn({B, T, Hq, D}, o).transpose(1, 2);
  const at::Tensor k = at::randn({B, T, Hkv, D}, o).transpose(1, 2);
  const at::Tensor v = at::randn({B, T, Hkv, D}, o).transpose(1, 2);
  const at::Tensor grad = at::randn({B, T, Hq, D}, o).transpose(1, 2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const double forward_flop = 4.0 * B * Hq * T * T * D / 2;
  const Arm arms[] = {{"cuDNN op, deterministic backward", true, true},
                      {"cuDNN op, default backward", true, false},
                      {"ATen SDPA, deterministic algorithms", false, true},
                      {"ATen SDPA, default", false, false}};
  double reference_fb = 0;
  for (const Arm& arm : arms) {
    ExecutionPolicy arm_policy = current_execution_policy();
    arm_policy.attention = arm.cudnn ? AttentionBackend::kCudnn : AttentionBackend::kAten;
    const ExecutionPolicyGuard policy(arm_policy);
    at::globalContext().setDeterministicAlgorithms(arm.deterministic, /*warn_only=*/false);
    const DeterministicModeGuard mode(arm.deterministic);
    auto forward = [&] { causal_attention(q, k, v, scale); };
    auto forward_backward = [&] {
      const at::Tensor qq = q.detach().requires_grad_(true);
      const at::Tensor kk = k.detach().requires_grad_(true);
      const at::Tensor vv = v.detach().requires_grad_(true);
      const at::Tensor out = causal_attention(qq, kk, vv, scale);
      torch::autograd::grad({out}, {qq, kk, vv}, {grad});
    };
    const double fwd = bench::median_graph_ms(forward, kPerGraph, 3, kWarmup, kRepeats);
    const double fb = bench::median_graph_ms(forward_backward, kPerGraph, 3, kWarmup, kRepeats);
    if (reference_fb == 0) reference_fb = fb;
    std::printf("| %lld x %lld/%lld x %lld x %lld | %s | %.1f | %.1f | %.0f | %.0f | %.2f |\n",
                static_cast<long long>(B), static_cast<long long>(Hq), static_cast<long long>(Hkv),
                static_cast<long long>(T), static_cast<long long>(D), arm.name, fwd * 1e3, fb * 1e3,
                forward_flop / (fwd * 1e-3) / 1e12, 3.5 * forward_flop / (fb * 1e-3) / 1e12,
                fb / reference_fb);
  }
  at::globalContext().setDeterministicAlgorithms(false, false);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("attention_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  for (int i = 1; i < argc; ++i) {
    std::fprintf(stderr, "attention_bench takes no arguments, got '%s'\n", argv[i]);
    return 2;
  }
  std::printf(
      "| B x Hq/Hkv x T x D | arm | fwd us | fwd+bwd us | fwd TFLOP/s | fwd+bwd TFLOP/s | "
      "fwd+bwd / first arm |\n|---|---|---|---|---|---|---|\n");
  gdr::bench_shape(1, 8, 2, 2048, 256);  // the 0.8B model's attention
  gdr::bench_shape(1, 8, 2, 8192, 256);
  gdr::bench_shape(2, 16, 4, 4096, 128);
  return 0;
}
