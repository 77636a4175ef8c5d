// Benchmark of the pre-GDR gate on one GPU: fused forward, backward (atomic, autotuned)
// and backward (ordered, deterministic), fused forward+backward against the unfused
// libtorch composite with autograd, and a device-to-device copy of the same bytes as
// the bandwidth roofline, all measured in this process with CUDA events (warm-up, then
// the median of timed repetitions). Each case is timed twice: "eager" (events around one
// host call, so host overhead counts when it exceeds the GPU work, as at small shapes)
// and "graph" (kPerGraph calls captured in one CUDA graph and replayed: GPU time alone,
// what a training step that keeps the GPU queue full sees). The eager ordered/atomic
// ratio is paired (bench::median_paired_ratio), not a ratio of the two columns. Prints a
// Markdown table; --tiles also prints every candidate tile's backward time in both modes;
// --roofline splits the backward into its traffic and its element math
// (kernels/pre_gdr_gate/pre_gdr_gate_roofline.h), to judge the bandwidth target against the math.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_flags.h"
#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "kernels/pre_gdr_gate/pre_gdr_gate.h"
#include "kernels/pre_gdr_gate/pre_gdr_gate_roofline.h"
#include "ops/autotune/autotune.h"
#include "ops/policy/determinism.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"

namespace gdr {
namespace {

constexpr int kWarmup = 10;
constexpr int kRepeats = 50;

constexpr int kPerGraph = 20;

// GPU time per call: kPerGraph calls captured in a CUDA graph (after 3 eager calls, which
// autotune), median over replays; -1 when the work cannot be captured.
double graph_ms(const std::function<void()>& fn) {
  return bench::median_graph_ms(fn, kPerGraph, 3, kWarmup, kRepeats);
}

using bench::Timing;

Timing time_both(const std::function<void()>& fn) {
  return bench::median_eager_and_graph_ms(fn, kPerGraph, 3, kWarmup, kRepeats);
}

struct Shape {
  int64_t tokens, heads;
};

// The current policy with the gate's ordered reduction forced to `variant`.
ExecutionPolicy with_ordered(GateOrderedVariant variant) {
  ExecutionPolicy policy = current_execution_policy();
  policy.gate_ordered = variant;
  return policy;
}

void bench_shape(const Shape& shape, at::ScalarType dtype, bool print_tiles, bool print_host) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  at::Tensor a = at::randn({1, shape.tokens, shape.heads}, cuda).to(dtype);
  at::Tensor b = at::randn({1, shape.tokens, shape.heads}, cuda).to(dtype);
  at::Tensor A_log = at::log(at::rand({shape.heads}, cuda) * 15.99 + 0.01);
  at::Tensor dt_bias = at::ones({shape.heads}, cuda);
  at::Tensor grad_g = at::randn({1, shape.tokens, shape.heads}, cuda);
  at::Tensor grad_beta = at::randn({1, shape.tokens, shape.heads}, cuda);
  const int64_t n = shape.tokens * shape.heads;
  const int64_t in_bytes = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t fwd_bytes = n * (2 * in_bytes + 2 * 4);                 // read a, b; write g, beta
  const int64_t bwd_bytes = n * (2 * in_bytes + 2 * 4 + 2 * in_bytes);  // + grads in, da/db out

  const Timing fwd = time_both([&] { pre_gdr_gate(a, b, A_log, dt_bias); });
  const double copy_fwd = graph_ms(bench::device_copy(fwd_bytes));
  const double copy_bwd = graph_ms(bench::device_copy(bwd_bytes));
  auto backward = [&] { pre_gdr_gate_backward(grad_g, grad_beta, a, b, A_log, dt_bias); };
  Timing bwd_atomic, bwd_ordered;
  std::string atomic_tile, ordered_tile;
  {
    DeterministicModeGuard mode(false);
    bwd_atomic = time_both(backward);
    atomic_tile = kernels::to_string(pre_gdr_gate_last_backward().tile);
  }
  Timing bwd_single_pass;
  {
    DeterministicModeGuard mode(true);
    bwd_ordered = time_both(backward);
    ordered_tile = kernels::to_string(pre_gdr_gate_last_backward().tile);
    if (pre_gdr_gate_last_backward().reduction == kernels::GateReduction::kOrderedSinglePass) {
      ordered_tile += " single-pass";
    }
    const ExecutionPolicyGuard single_pass(with_ordered(GateOrderedVariant::kSinglePass));
    bwd_single_pass = time_both(backward);
  }
  // Eager ordered/atomic paired (bench::median_paired_ratio), not a ratio of the columns.
  const double eager_ratio = bench::median_paired_ratio(
      [&] {
        DeterministicModeGuard mode(true);
        backward();
      },
      [&] {
        DeterministicModeGuard mode(false);
        backward();
      },
      kWarmup, 4 * kRepeats);
  // Fused vs composite forward+backward through autograd (the way training runs it).
  auto fwd_bwd = [&](bool fused) {
    at::Tensor a_ = a.detach().requires_grad_(true), b_ = b.detach().requires_grad_(true);
    at::Tensor A_ = A_log.detach().requires_grad_(true),
               dt_ = dt_bias.detach().requires_grad_(true);
    auto [g, beta] =
        fused ? pre_gdr_gate(a_, b_, A_, dt_) : pre_gdr_gate_composite(a_, b_, A_, dt_);
    torch::autograd::grad({g, beta}, {a_, b_, A_, dt_}, {grad_g, grad_beta});
  };
  Timing fused_fb, composite_fb;
  {
    DeterministicModeGuard mode(false);
    fused_fb = time_both([&] { fwd_bwd(true); });
    composite_fb = time_both([&] { fwd_bwd(false); });
  }

  auto gbs = [](int64_t bytes, double ms) { return bytes / (ms * 1e-3) / 1e9; };
  std::printf(
      "| %lld | %lld | %s | %.1f / %.1f (%.0f GB/s, %.2f of copy) | %.1f / %.1f [%s] | %.1f / %.1f "
      "[%s] | "
      "%.3f / %.3f | %.1f / %.1f | %.0f GB/s, %.2f of copy | %.1f / %.1f | %.1f / %.1f | %.2fx / "
      "%.2fx |\n",
      static_cast<long long>(shape.tokens), static_cast<long long>(shape.heads),
      c10::toString(dtype), fwd.eager * 1e3, fwd.graph * 1e3, gbs(fwd_bytes, fwd.graph),
      copy_fwd / fwd.graph, bwd_atomic.eager * 1e3, bwd_atomic.graph * 1e3, atomic_tile.c_str(),
      bwd_ordered.eager * 1e3, bwd_ordered.graph * 1e3, ordered_tile.c_str(), eager_ratio,
      bwd_ordered.graph / bwd_atomic.graph, bwd_single_pass.eager * 1e3,
      bwd_single_pass.graph * 1e3, gbs(bwd_bytes, bwd_ordered.graph), copy_bwd / bwd_ordered.graph,
      fused_fb.eager * 1e3, fused_fb.graph * 1e3, composite_fb.eager * 1e3,
      composite_fb.graph * 1e3, composite_fb.eager / fused_fb.eager,
      composite_fb.graph / fused_fb.graph);
  std::fflush(stdout);

  if (print_host) {
    // Host cost of one call: back-to-back calls with no synchronisation, so the GPU
    // (2-5 us of work per call here) never holds the host back; the wall time per call
    // is what the host spends in the op, dispatcher and launches.
    auto host_us = [](const std::function<void()>& fn) {
      for (int i = 0; i < 20; ++i) fn();
      cudaDeviceSynchronize();
      constexpr int kCalls = 200;
      const auto start = std::chrono::steady_clock::now();
      for (int i = 0; i < kCalls; ++i) fn();
      const auto end = std::chrono::steady_clock::now();
      cudaDeviceSynchronize();
      return std::chrono::duration<double, std::micro>(end - start).count() / kCalls;
    };
    double atomic_us, two_pass_us, single_pass_us;
    {
      DeterministicModeGuard mode(false);
      atomic_us = host_us(backward);
    }
    {
      DeterministicModeGuard mode(true);
      {
        const ExecutionPolicyGuard two_pass(with_ordered(GateOrderedVariant::kTwoPass));
        two_pass_us = host_us(backward);
      }
      const ExecutionPolicyGuard single_pass(with_ordered(GateOrderedVariant::kSinglePass));
      single_pass_us = host_us(backward);
    }
    std::printf(
        "host us/call tokens=%lld heads=%lld %s: forward %.2f, backward atomic %.2f, "
        "ordered two-pass %.2f, ordered single-pass %.2f\n",
        static_cast<long long>(shape.tokens), static_cast<long long>(shape.heads),
        c10::toString(dtype), host_us([&] { pre_gdr_gate(a, b, A_log, dt_bias); }), atomic_us,
        two_pass_us, single_pass_us);
  }
  if (!print_tiles) return;
  const kernels::GateShape gshape{1, shape.tokens, shape.heads};
  for (const kernels::GateTile& tile : kernels::pre_gdr_gate_candidate_tiles()) {
    ExecutionPolicy fixed_tile = current_execution_policy();
    fixed_tile.gate_tile = tile;
    const ExecutionPolicyGuard tile_policy(fixed_tile);
    double t_atomic, t_ordered;
    {
      DeterministicModeGuard mode(false);
      t_atomic = graph_ms(backward);
    }
    {
      DeterministicModeGuard mode(true);
      t_ordered = graph_ms(backward);
    }
    std::printf(
        "tile %s tokens=%lld heads=%lld %s graph_us atomic=%.2f ordered=%.2f static_cost=%.3f\n",
        kernels::to_string(tile).c_str(), static_cast<long long>(shape.tokens),
        static_cast<long long>(shape.heads), c10::toString(dtype), t_atomic * 1e3, t_ordered * 1e3,
        kernels::gate_tile_static_cost(tile, gshape, static_cast<int>(c10::elementSize(dtype))));
  }
  std::fflush(stdout);
}

// The roofline probes at one shape, graph-timed, next to the copy of the backward's bytes
// and the backward itself in both modes. Heads must be a multiple of 4.
void bench_roofline(const Shape& shape, at::ScalarType dtype) {
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor a = at::randn({shape.tokens, shape.heads}, cuda).to(dtype);
  const at::Tensor b = at::randn({shape.tokens, shape.heads}, cuda).to(dtype);
  const at::Tensor A_log = at::log(at::rand({shape.heads}, cuda) * 15.99 + 0.01);
  const at::Tensor dt_bias = at::ones({shape.heads}, cuda);
  const at::Tensor grad_g = at::randn({shape.tokens, shape.heads}, cuda);
  const at::Tensor grad_beta = at::randn({shape.tokens, shape.heads}, cuda);
  at::Tensor da = at::empty_like(a), db = at::empty_like(b);
  int device = 0, multiprocessors = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  at::Tensor sink =
      at::empty({kernels::gate_roofline_sink_floats(shape.heads, multiprocessors)}, cuda);
  kernels::GateRooflineArgs args;
  args.tokens = shape.tokens;
  args.heads = shape.heads;
  args.input_kind = dtype == at::kFloat  ? kernels::ScalarKind::kFloat32
                    : dtype == at::kHalf ? kernels::ScalarKind::kFloat16
                                         : kernels::ScalarKind::kBFloat16;
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.grad_g = grad_g.data_ptr<float>();
  args.grad_beta = grad_beta.data_ptr<float>();
  args.A_log = A_log.data_ptr<float>();
  args.dt_bias = dt_bias.data_ptr<float>();
  args.da = da.data_ptr();
  args.db = db.data_ptr();
  args.sink = sink.data_ptr<float>();
  auto probe_us = [&](kernels::GateRooflineProbe probe) {
    int status = 0;
    const double ms = graph_ms([&] {
      const int launched = kernels::launch_gate_roofline_probe(
          args, probe, multiprocessors, c10::cuda::getCurrentCUDAStream().stream());
      if (launched != 0) status = launched;
    });
    TORCH_CHECK(status == 0, "pre_gdr_gate_bench --roofline: probe launch failed: ",
                cudaGetErrorString(static_cast<cudaError_t>(status)));
    return ms * 1e3;
  };
  const double traffic = probe_us(kernels::GateRooflineProbe::kTraffic);
  const double math = probe_us(kernels::GateRooflineProbe::kMath);
  const double both = probe_us(kernels::GateRooflineProbe::kTrafficAndMath);
  const int64_t in_bytes = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t bwd_bytes = shape.tokens * shape.heads * (4 * in_bytes + 2 * 4);
  const double copy = graph_ms(bench::device_copy(bwd_bytes)) * 1e3;
  auto backward = [&] { pre_gdr_gate_backward(grad_g, grad_beta, a, b, A_log, dt_bias); };
  double atomic, ordered;
  {
    DeterministicModeGuard mode(false);
    atomic = graph_ms(backward) * 1e3;
  }
  {
    DeterministicModeGuard mode(true);
    ordered = graph_ms(backward) * 1e3;
  }
  std::printf(
      "roofline tokens=%lld heads=%lld %s graph_us: copy=%.2f traffic=%.2f math=%.2f "
      "traffic+math=%.2f backward atomic=%.2f ordered=%.2f (ordered %.2f of copy)\n",
      static_cast<long long>(shape.tokens), static_cast<long long>(shape.heads),
      c10::toString(dtype), copy, traffic, math, both, atomic, ordered, copy / ordered);
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("pre_gdr_gate_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  bool print_tiles = false;
  bool print_host = false;
  bool print_roofline = false;
  std::vector<gdr::Shape> shapes = {{8192, 16}, {16384, 32}, {32768, 48}, {65536, 64}};
  std::vector<at::ScalarType> dtypes = {at::kBFloat16, at::kFloat};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: pre_gdr_gate_bench [--tiles] [--host] [--roofline] [--shapes=TxH,...] "
          "[--dtypes=bf16,f32]\n"
          "  Times the pre-GDR gate (fused forward, atomic and ordered backward, fused vs\n"
          "  composite forward+backward) against a device copy of the same bytes.\n"
          "  --tiles   also time every candidate tile of the backward in both modes (each dtype)\n"
          "  --host    also print the host time per call of the forward and each backward\n"
          "  --roofline  also time the backward's traffic alone, its element math alone and\n"
          "            both (kernels/pre_gdr_gate/pre_gdr_gate_roofline.h); shapes with heads %% 4 "
          "== 0\n"
          "  --shapes  tokens x heads list (default 8192x16,16384x32,32768x48,65536x64)\n"
          "  --dtypes  activation dtypes (default bf16,f32)\n");
      return 0;
    }
    if (arg == "--tiles") {
      print_tiles = true;
    } else if (arg == "--host") {
      print_host = true;
    } else if (arg == "--roofline") {
      print_roofline = true;
    } else if (arg.rfind("--shapes=", 0) == 0) {
      shapes.clear();
      std::stringstream list(arg.substr(9));
      std::string item;
      while (std::getline(list, item, ',')) {
        long long t = 0, h = 0;
        if (std::sscanf(item.c_str(), "%lldx%lld", &t, &h) != 2 || t <= 0 || h <= 0) {
          std::fprintf(stderr, "pre_gdr_gate_bench: --shapes expects TOKENSxHEADS, got '%s'\n",
                       item.c_str());
          return 2;
        }
        shapes.push_back({t, h});
      }
    } else if (arg.rfind("--dtypes=", 0) == 0) {
      if (!gdr::bench::parse_dtype_list("pre_gdr_gate_bench", arg.substr(9), false, dtypes)) {
        return 2;
      }
    } else {
      std::fprintf(stderr, "pre_gdr_gate_bench: unknown argument '%s' (see --help)\n", argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "GPU: %s, %d SMs; warm-up %d, median of %d; times in us as eager / graph "
      "(see the header of bench/pre_gdr_gate_bench.cc); bandwidth from graph times\n\n",
      prop.name, prop.multiProcessorCount, gdr::kWarmup, gdr::kRepeats);
  std::printf(
      "| tokens | Hv | dtype | forward | backward atomic [tile] | backward ordered [tile] | "
      "ordered/atomic | single-pass ordered | ordered backward BW | fused fwd+bwd | "
      "composite fwd+bwd | composite/fused |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (at::ScalarType dtype : dtypes) {
    for (const gdr::Shape& shape : shapes) gdr::bench_shape(shape, dtype, false, print_host);
  }
  if (print_tiles) {
    std::printf("\n");
    for (const at::ScalarType dtype : dtypes) {
      for (const gdr::Shape& shape : shapes) gdr::bench_shape(shape, dtype, true, false);
    }
  }
  if (print_roofline) {
    std::printf("\n");
    for (const at::ScalarType dtype : dtypes) {
      for (const gdr::Shape& shape : shapes) {
        if (shape.heads % 4 == 0) gdr::bench_roofline(shape, dtype);
      }
    }
  }
  return 0;
}
