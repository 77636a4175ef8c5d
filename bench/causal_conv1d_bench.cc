// Benchmark of the fused causal depthwise conv1d + SiLU (ops/causal_conv1d/causal_conv1d_op.h) on
// one GPU: the kernel's forward, backward (op alone) and forward+backward through autograd, against
// the ATen composition (pad + cuDNN depthwise conv1d + SiLU, forward and forward+backward
// through autograd, the model's path before the op), with a device-to-device copy of the
// same bytes as the bandwidth roofline, all measured in this process with CUDA events
// (warm-up, then the median of timed repetitions; bench/cuda_timing.h). Each case is timed
// twice: "eager" (events around one host call, so host overhead counts where it exceeds
// the GPU work) and "graph" (kPerGraph calls captured in one CUDA graph and replayed: GPU
// time alone). Bandwidth is the op's compulsory traffic over the graph time: forward
// reads x and writes y (2 * B*T*C elements), backward reads x and dy and writes dx (3),
// forward+backward 5; the copy ratio is (copy time of those bytes) / (op time), 1.0 being
// as fast as a copy. Prints a Markdown table.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
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

#include "bench/bench_flags.h"
#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "ops/causal_conv1d/causal_conv1d_op.h"

namespace gdr {
namespace {

constexpr int kWarmup = 10;
constexpr int kRepeats = 50;
constexpr int kPerGraph = 20;

// GPU time per call: kPerGraph calls captured in a CUDA graph (after 3 eager calls, in
// which cuDNN picks its algorithms), median over replays; -1 when it cannot be captured.
double graph_ms(const std::function<void()>& fn) {
  return bench::median_graph_ms(fn, kPerGraph, 3, kWarmup, kRepeats);
}

using bench::Timing;

Timing time_both(const std::function<void()>& fn) {
  return bench::median_eager_and_graph_ms(fn, kPerGraph, 3, kWarmup, kRepeats);
}

// Graph time of the copy baseline for `bytes` of compulsory traffic.
double copy_ms(int64_t bytes) { return graph_ms(bench::device_copy(bytes)); }

struct Shape {
  int64_t batch, seq;
};

void print_row(const Shape& shape, int64_t channels, int64_t taps, at::ScalarType dtype,
               const char* what, const Timing& t, int64_t bytes, double copy) {
  const double gbs = t.graph > 0 ? bytes / (t.graph * 1e-3) / 1e9 : 0.0;
  std::printf("| %lld x %lld | %lld | %lld | %s | %s | %.1f | %.1f | %.0f | %.2f |\n",
              static_cast<long long>(shape.batch), static_cast<long long>(shape.seq),
              static_cast<long long>(channels), static_cast<long long>(taps), c10::toString(dtype),
              what, t.eager * 1e3, t.graph * 1e3, gbs, t.graph > 0 ? copy / t.graph : 0.0);
}

void bench_shape(const Shape& shape, int64_t channels, int64_t taps, at::ScalarType dtype) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::manual_seed(1);
  const at::Tensor x = at::randn({shape.batch, shape.seq, channels}, cuda).to(dtype);
  const at::Tensor w = ((at::rand({channels, 1, taps}, cuda) * 2 - 1) / 2).to(dtype);
  const at::Tensor g = at::randn({shape.batch, shape.seq, channels}, cuda).to(dtype);
  const int64_t elements = x.numel() * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t fwd_bytes = 2 * elements, bwd_bytes = 3 * elements, fwd_bwd_bytes = 5 * elements;

  auto fwd_bwd = [&](bool kernel) {
    at::Tensor xv = x.detach().requires_grad_(true), wv = w.detach().requires_grad_(true);
    const at::Tensor y = kernel ? causal_conv1d_silu(xv, wv) : causal_conv1d_silu_composite(xv, wv);
    torch::autograd::grad({y}, {xv, wv}, {g});
  };
  const Timing kernel_fwd = time_both([&] { causal_conv1d_silu_forward(x, w); });
  const Timing kernel_bwd = time_both([&] { causal_conv1d_silu_backward(g, x, w); });
  const Timing kernel_fb = time_both([&] { fwd_bwd(true); });
  // The composition's forward as the model ran it: its [B, T, C] view made contiguous is
  // what the q/k/v split then copies, so that copy is not counted here.
  const Timing aten_fwd = time_both([&] { causal_conv1d_silu_composite(x, w); });
  const Timing aten_fb = time_both([&] { fwd_bwd(false); });
  const double copy_fwd = copy_ms(fwd_bytes), copy_bwd = copy_ms(bwd_bytes),
               copy_fb = copy_ms(fwd_bwd_bytes);

  print_row(shape, channels, taps, dtype, "kernel forward", kernel_fwd, fwd_bytes, copy_fwd);
  print_row(shape, channels, taps, dtype, "kernel backward (op)", kernel_bwd, bwd_bytes, copy_bwd);
  print_row(shape, channels, taps, dtype, "kernel fwd+bwd (autograd)", kernel_fb, fwd_bwd_bytes,
            copy_fb);
  print_row(shape, channels, taps, dtype, "ATen forward", aten_fwd, fwd_bytes, copy_fwd);
  print_row(shape, channels, taps, dtype, "ATen fwd+bwd (autograd)", aten_fb, fwd_bwd_bytes,
            copy_fb);
  std::printf(
      "|  |  |  |  | ATen / kernel: forward %.2fx / %.2fx, fwd+bwd %.2fx / %.2fx (eager / "
      "graph) |  |  |  |  |\n",
      aten_fwd.eager / kernel_fwd.eager, aten_fwd.graph / kernel_fwd.graph,
      aten_fb.eager / kernel_fb.eager, aten_fb.graph / kernel_fb.graph);
  std::fflush(stdout);
}

template <typename T, typename Parse>
bool parse_list(const std::string& list, const char* flag, std::vector<T>& out,
                const Parse& parse) {
  out.clear();
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ',')) {
    T value;
    if (!parse(item, value)) {
      std::fprintf(stderr, "causal_conv1d_bench: bad %s item '%s' (see --help)\n", flag,
                   item.c_str());
      return false;
    }
    out.push_back(value);
  }
  return !out.empty();
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("causal_conv1d_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  std::vector<gdr::Shape> shapes = {{2, 2048}, {8, 2048}};
  std::vector<at::ScalarType> dtypes = {at::kBFloat16};
  long long channels = 6144, taps = 4;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: causal_conv1d_bench [--shapes=BxT,...] [--channels=C] [--taps=K] "
          "[--dtypes=bf16,f16,f32]\n"
          "  Times the fused causal depthwise conv1d + SiLU (forward, backward, forward+backward\n"
          "  through autograd) against the ATen composition (pad + cuDNN conv1d + SiLU) and a\n"
          "  device copy of the same bytes; eager and CUDA-graph times, median of %d after %d\n"
          "  warm-up calls.\n"
          "  --shapes    batch x tokens list (default 2x2048,8x2048: B*T = 4096 and 16384)\n"
          "  --channels  C = conv_dim (default 6144, the 0.8B model's)\n"
          "  --taps      K in [2, 4] (default 4)\n"
          "  --dtypes    activation and weight dtypes (default bf16)\n",
          gdr::kRepeats, gdr::kWarmup);
      return 0;
    }
    bool ok = true;
    if (arg.rfind("--shapes=", 0) == 0) {
      ok = gdr::parse_list<gdr::Shape>(
          arg.substr(9), "--shapes", shapes, [](const std::string& item, gdr::Shape& s) {
            long long b = 0, t = 0;
            if (std::sscanf(item.c_str(), "%lldx%lld", &b, &t) != 2 || b <= 0 || t <= 0) {
              return false;
            }
            s = {b, t};
            return true;
          });
    } else if (arg.rfind("--channels=", 0) == 0) {
      ok = std::sscanf(arg.c_str() + 11, "%lld", &channels) == 1 && channels > 0;
    } else if (arg.rfind("--taps=", 0) == 0) {
      ok = std::sscanf(arg.c_str() + 7, "%lld", &taps) == 1 && taps >= 2 && taps <= 4;
    } else if (arg.rfind("--dtypes=", 0) == 0) {
      if (!gdr::bench::parse_dtype_list("causal_conv1d_bench", arg.substr(9), true, dtypes)) {
        return 2;
      }
    } else {
      std::fprintf(stderr, "causal_conv1d_bench: unknown argument '%s' (see --help)\n", argv[i]);
      return 2;
    }
    if (!ok) {
      std::fprintf(stderr, "causal_conv1d_bench: bad value in '%s' (see --help)\n", argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "GPU: %s, %d SMs; warm-up %d, median of %d; times in us (eager / graph, see the header "
      "of bench/causal_conv1d_bench.cc); GB/s and copy ratio from graph times\n\n",
      prop.name, prop.multiProcessorCount, gdr::kWarmup, gdr::kRepeats);
  std::printf(
      "| B x T | C | K | dtype | case | eager us | graph us | GB/s | copy time / op time |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|\n");
  for (at::ScalarType dtype : dtypes) {
    for (const gdr::Shape& shape : shapes) gdr::bench_shape(shape, channels, taps, dtype);
  }
  return 0;
}
