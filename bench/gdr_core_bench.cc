// Benchmark of the chunked gated delta rule core on one GPU with step 7 (the inter-chunk
// state pass) as the CUDA scan kernel (GDR_CORE_IMPL=kernel) against the per-chunk ATen
// loop (composite), and steps 1-6 as the chunk prep kernels (GDR_CORE_PREP=kernel, set
// through set_gdr_core_prep) against the ATen ops (aten): forward (autograd recording, as
// in training) and forward+backward through autograd. BF16 (default) or FP32 q/k/v
// (--dtype=fp32: what the model hands the core after its FP32 L2 norm), q and k
// L2-normalised beforehand as the model does, FP32 g and beta. CUDA events around each host call
// (so host and launch overhead count, which is what the composite loses), warm-up, then the median
// of timed repetitions.
//
// FLOP count (matmul FLOPs of the whole chunked algorithm, per batch*head and chunk of
// C = 64 rows; elementwise work ignored):
//   forward  F = 2 C^2 dk (Kb K^T) + C^2 (dk + dv) (triangular solve) + 2 C^2 dk (Q K^T)
//              + 6 C dk dv (W S, Qd S, Kend^T V) + 2 C^2 dv (P V)
//   forward+backward = 3 F (the backward does about two matmuls per forward matmul).
// TFLOP/s = FLOPs / time; both implementations get the same count.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/cuda_timing.h"
#include "ops/gdr_core.h"

namespace gdr {
namespace {

constexpr int kWarmup = 5;
constexpr int kRepeats = 21;

double median_ms(const std::function<void()>& fn) {
  return bench::median_event_ms(fn, kWarmup, kRepeats);
}

double forward_flops(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv) {
  const double C = static_cast<double>(kGdrChunkSize);
  const double N = static_cast<double>((T + kGdrChunkSize - 1) / kGdrChunkSize);
  const double per_chunk =
      2 * C * C * dk + C * C * (dk + dv) + 2 * C * C * dk + 6 * C * dk * dv + 2 * C * C * dv;
  return static_cast<double>(B * H) * N * per_chunk;
}

struct Timings {
  double forward_ms = 0, forward_backward_ms = 0;
};

void bench_length(int64_t T, int64_t H, int64_t dk, int64_t dv, at::ScalarType dtype) {
  const int64_t B = 1;
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(0);
  at::Tensor q = at::randn({B, T, H, dk}, cuda);
  at::Tensor k = at::randn({B, T, H, dk}, cuda);
  q = (q / q.norm(2, -1, true)).to(dtype);
  k = (k / k.norm(2, -1, true)).to(dtype);
  const at::Tensor v = at::randn({B, T, H, dv}, cuda).to(dtype);
  const at::Tensor g = -at::rand({B, T, H}, cuda);
  const at::Tensor beta = at::sigmoid(at::randn({B, T, H}, cuda));
  const at::Tensor grad_o = at::randn({B, T, H, dv}, cuda).to(dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));

  std::vector<at::Tensor> leaves = {q, k, v, g, beta};
  for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
  auto forward = [&] {
    gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale);
  };
  auto forward_backward = [&] {
    auto [o, s] =
        gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale);
    torch::autograd::grad({o}, leaves, {grad_o});
  };

  // Arms: step 7 and steps 1-6 ("prep", GDR_CORE_PREP) each as kernel or ATen; the last
  // arm (all ATen) is the baseline of the "vs composite" columns.
  struct Arm {
    GdrCoreImpl impl;
    GdrCorePrep prep;
  };
  const Arm arms[3] = {{GdrCoreImpl::kKernel, GdrCorePrep::kKernel},
                       {GdrCoreImpl::kKernel, GdrCorePrep::kAten},
                       {GdrCoreImpl::kComposite, GdrCorePrep::kAten}};
  Timings t[3];
  for (int i = 0; i < 3; ++i) {
    set_gdr_core_impl(arms[i].impl);
    set_gdr_core_prep(arms[i].prep);
    forward();
    if (gdr_core_last_step7() != arms[i].impl || gdr_core_last_prep() != arms[i].prep) {
      std::fprintf(stderr, "gdr_core_bench: ran step 7 %s / prep %s, expected %s / %s\n",
                   to_string(gdr_core_last_step7()), to_string(gdr_core_last_prep()),
                   to_string(arms[i].impl), to_string(arms[i].prep));
    }
    t[i].forward_ms = median_ms(forward);
    t[i].forward_backward_ms = median_ms(forward_backward);
  }
  set_gdr_core_impl(std::nullopt);
  set_gdr_core_prep(std::nullopt);

  const double f = forward_flops(B, T, H, dk, dv);
  auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  for (int i = 0; i < 3; ++i) {
    std::printf(
        "| %lld | %lld | %lld/%lld | %s | %s | %.3f | %.2fx | %.2f | %.3f | %.2fx | %.2f |\n",
        static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(dk),
        static_cast<long long>(dv), to_string(arms[i].impl), to_string(arms[i].prep),
        t[i].forward_ms, t[2].forward_ms / t[i].forward_ms, tflops(f, t[i].forward_ms),
        t[i].forward_backward_ms, t[2].forward_backward_ms / t[i].forward_backward_ms,
        tflops(3 * f, t[i].forward_backward_ms));
  }
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  std::vector<int64_t> lengths = {2048, 16384};
  int64_t heads = 16, dk = 128, dv = 128;
  at::ScalarType dtype = at::kBFloat16;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: gdr_core_bench [--lengths=T,...] [--heads=H] [--dk=D] [--dv=D] "
          "[--dtype=bf16|fp32]\n"
          "  Times gated_delta_rule_chunked (B=1, BF16 or FP32 q/k/v) forward and "
          "forward+backward with\n"
          "  step 7 as the CUDA chunk state kernel (kernel) and as the per-chunk ATen loop\n"
          "  (composite), and steps 1-6 (prep) as the chunk prep kernels (kernel) or ATen ops\n"
          "  (aten): rows kernel/kernel, kernel/aten, composite/aten. Defaults: "
          "--lengths=2048,16384 --heads=16 --dk=128 --dv=128 --dtype=bf16 (fp32 is what the\n"
          "  model hands the core).\n"
          "  'vs composite' is composite time / this row's time; TFLOP/s counts the matmul\n"
          "  FLOPs of the whole chunked algorithm (formula in bench/gdr_core_bench.cc).\n");
      return 0;
    }
    long long value = 0;
    if (arg.rfind("--lengths=", 0) == 0) {
      lengths.clear();
      std::stringstream list(arg.substr(10));
      std::string item;
      while (std::getline(list, item, ',')) {
        if (std::sscanf(item.c_str(), "%lld", &value) != 1 || value <= 0) {
          std::fprintf(stderr, "gdr_core_bench: --lengths expects positive integers, got '%s'\n",
                       item.c_str());
          return 2;
        }
        lengths.push_back(value);
      }
    } else if (arg == "--dtype=bf16" || arg == "--dtype=fp32") {
      dtype = arg == "--dtype=fp32" ? at::kFloat : at::kBFloat16;
    } else if (std::sscanf(argv[i], "--heads=%lld", &value) == 1 && value > 0) {
      heads = value;
    } else if (std::sscanf(argv[i], "--dk=%lld", &value) == 1 && value > 0) {
      dk = value;
    } else if (std::sscanf(argv[i], "--dv=%lld", &value) == 1 && value > 0) {
      dv = value;
    } else {
      std::fprintf(stderr, "gdr_core_bench: unknown or invalid argument '%s' (see --help)\n",
                   argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "GPU: %s, %d SMs; B=1, %s q/k/v; warm-up %d, median of %d; eager times in ms "
      "(CUDA events around the host call)\n\n",
      prop.name, prop.multiProcessorCount, dtype == at::kFloat ? "FP32" : "BF16", gdr::kWarmup,
      gdr::kRepeats);
  std::printf(
      "| T | H | dk/dv | step 7 | prep | forward ms | vs composite | fwd TFLOP/s | fwd+bwd ms | "
      "vs composite | fwd+bwd TFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t T : lengths) gdr::bench_length(T, heads, dk, dv, dtype);
  return 0;
}
