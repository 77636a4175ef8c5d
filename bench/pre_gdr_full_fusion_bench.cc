// Benchmark of full pre-GDR fusion on one GPU: the fused op's forward and forward+backward
// against the unfused ATen path (conv1d + SiLU + split + L2 norm + repeat + gate: the
// model's pre_gdr_fusion none, gdr::pre_gdr_full_fusion_composite) with autograd, at the
// Qwen3.5-0.8B training shape (B*T = 8192, BF16) and a larger one. CUDA events around one
// host call, warm-up then the median of timed repetitions (as bench/pre_gdr_gate_bench.cc
// "eager"). Effective bandwidth counts the fused path's compulsory bytes (see the header
// of kernels/pre_gdr_gate/pre_gdr_full_fusion.cu) for both paths, so the unfused column shows how
// far its extra passes put it from the same work. Prints a Markdown table.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench_flags.h"
#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "ops/pre_gdr_gate/pre_gdr_full_fusion_op.h"

namespace gdr {
namespace {

constexpr int kWarmup = 10;
constexpr int kRepeats = 50;

double median_ms(const std::function<void()>& fn) {
  return bench::median_event_ms(fn, kWarmup, kRepeats);
}

struct Shape {
  int64_t batch, seq;
  GdnHeads heads;
};

void bench_shape(const Shape& s, at::ScalarType dtype) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const int64_t B = s.batch, T = s.seq, C = s.heads.conv_dim(), Hv = s.heads.num_v_heads;
  const int64_t dk = s.heads.head_k_dim, dv = s.heads.head_v_dim;
  const at::Tensor qkv = at::randn({B, T, C}, cuda).to(dtype);
  const at::Tensor conv_weight = (at::randn({C, 1, 4}, cuda) * 0.5).to(dtype);
  const at::Tensor a = at::randn({B, T, Hv}, cuda).to(dtype);
  const at::Tensor b = at::randn({B, T, Hv}, cuda).to(dtype);
  const at::Tensor A_log = at::log(at::rand({Hv}, cuda) * 15.99 + 0.01);
  const at::Tensor dt_bias = at::ones({Hv}, cuda);
  const at::Tensor grad_q = at::randn({B, T, Hv, dk}, cuda);
  const at::Tensor grad_k = at::randn({B, T, Hv, dk}, cuda);
  const at::Tensor grad_v = at::randn({B, T, Hv, dv}, cuda);
  const at::Tensor grad_g = at::randn({B, T, Hv}, cuda);
  const at::Tensor grad_beta = at::randn({B, T, Hv}, cuda);

  auto forward = [&](bool fused, bool with_grad) {
    at::Tensor x = qkv.detach().requires_grad_(with_grad);
    at::Tensor w = conv_weight.detach().requires_grad_(with_grad);
    at::Tensor a_ = a.detach().requires_grad_(with_grad), b_ = b.detach().requires_grad_(with_grad);
    at::Tensor A_ = A_log.detach().requires_grad_(with_grad);
    at::Tensor dt_ = dt_bias.detach().requires_grad_(with_grad);
    const GdrInputs out =
        fused ? pre_gdr_full_fusion(x, w, a_, b_, A_, dt_, s.heads)
              : pre_gdr_full_fusion_composite(x, w, a_, b_, A_, dt_, s.heads, /*fused_gate=*/false);
    if (with_grad) {
      torch::autograd::grad({out.q, out.k, out.v, out.g, out.beta}, {x, w, a_, b_, A_, dt_},
                            {grad_q, grad_k, grad_v, grad_g, grad_beta});
    }
  };
  const double fused_fwd = median_ms([&] { forward(true, false); });
  const double unfused_fwd = median_ms([&] { forward(false, false); });
  const double fused_fb = median_ms([&] { forward(true, true); });
  const double unfused_fb = median_ms([&] { forward(false, true); });

  // Compulsory bytes of the fused path: forward reads qkv, a, b and writes q, k, v, g, beta;
  // backward reads qkv, a, b and the five upstream gradients and writes grad_qkv, grad_a,
  // grad_b (parameters and their gradients are negligible).
  const int64_t in_bytes = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t tokens = B * T;
  const int64_t qkv_bytes = tokens * C * in_bytes;
  const int64_t core_bytes = tokens * Hv * (2 * dk + dv) * 4;
  const int64_t gate_in = 2 * tokens * Hv * in_bytes, gate_out = 2 * tokens * Hv * 4;
  const int64_t fwd_bytes = qkv_bytes + core_bytes + gate_in + gate_out;
  const int64_t bwd_bytes = qkv_bytes + gate_in + core_bytes + gate_out + qkv_bytes + gate_in;
  auto gbs = [](int64_t bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; };
  std::printf(
      "| %lld x %lld | %lld/%lld/%lld/%lld | %s | %.1f (%.0f GB/s) | %.1f (%.0f GB/s) | %.2fx | "
      "%.1f (%.0f GB/s) | %.1f (%.0f GB/s) | %.2fx |\n",
      static_cast<long long>(B), static_cast<long long>(T),
      static_cast<long long>(s.heads.num_k_heads), static_cast<long long>(Hv),
      static_cast<long long>(dk), static_cast<long long>(dv), c10::toString(dtype), fused_fwd * 1e3,
      gbs(fwd_bytes, fused_fwd), unfused_fwd * 1e3, gbs(fwd_bytes, unfused_fwd),
      unfused_fwd / fused_fwd, fused_fb * 1e3, gbs(fwd_bytes + bwd_bytes, fused_fb),
      unfused_fb * 1e3, gbs(fwd_bytes + bwd_bytes, unfused_fb), unfused_fb / fused_fb);
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("pre_gdr_full_fusion_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  std::vector<at::ScalarType> dtypes = {at::kBFloat16};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: pre_gdr_full_fusion_bench [--dtypes=bf16,f32]\n"
          "  Times full pre-GDR fusion (fused forward, fused forward+backward) against the\n"
          "  unfused ATen path at the 0.8B training shape (2 x 4096 tokens, Hk = Hv = 16,\n"
          "  dk = dv = 128) and a larger one (4 x 4096 tokens, Hk = 16, Hv = 32). Times are\n"
          "  medians in us; GB/s counts the fused path's compulsory bytes for both columns.\n"
          "  --dtypes  activation dtypes (default bf16)\n");
      return 0;
    }
    if (arg.rfind("--dtypes=", 0) == 0) {
      if (!gdr::bench::parse_dtype_list("pre_gdr_full_fusion_bench", arg.substr(9), false,
                                        dtypes)) {
        return 2;
      }
    } else {
      std::fprintf(stderr, "pre_gdr_full_fusion_bench: unknown argument '%s' (see --help)\n",
                   argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("GPU: %s, %d SMs; warm-up %d, median of %d; times in us\n\n", prop.name,
              prop.multiProcessorCount, gdr::kWarmup, gdr::kRepeats);
  std::printf(
      "| B x T | Hk/Hv/dk/dv | dtype | fused fwd | unfused fwd | unfused/fused | fused fwd+bwd | "
      "unfused fwd+bwd | unfused/fused |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  const std::vector<gdr::Shape> shapes = {
      {2, 4096, {16, 16, 128, 128}},  // Qwen3.5-0.8B training shape (B*T = 8192)
      {4, 4096, {16, 32, 128, 128}},  // larger: 16k tokens, Hv = 2 Hk
  };
  for (at::ScalarType dtype : dtypes) {
    for (const gdr::Shape& shape : shapes) gdr::bench_shape(shape, dtype);
  }
  return 0;
}
