// Benchmark of the chunked gated delta rule core on one GPU with step 7 (the inter-chunk
// state pass) as the CUDA scan kernel (gdr_core_impl kernel) against the per-chunk ATen
// loop (composite), the scan on tensor cores ("kernel (tc ...)", the default) and on the FP32
// SIMT kernel ("kernel (simt ...)", chunk_scan_tensor_cores false), the state pass's batched
// products on the 3xTF32 tensor-core GEMM ("... gemm tc)", the default) and on cuBLAS FP32
// ("... cublas)", chunk_gemm_tensor_cores false), the backward's dQd / dP GEMMs beside the
// scan (the default) and after it ("..., in line)", chunk_gemm_overlap false), and steps 1-6
// as the chunk prep kernels (gdr_core_prep kernel; the backward's dM, dK and dQ products on
// tensor cores, the default, and all FP32 SIMT, "kernel (simt)", chunk_prep_tensor_cores
// false) against the ATen ops (aten); each arm is an execution policy set for its timings
// (ops/policy/execution_policy.h): forward (autograd recording, as
// in training) and forward+backward through autograd. Inputs: BF16 (default) or FP32
// q/k/v (--dtype=fp32), q and k L2-normalised beforehand, FP32 g and beta; or
// --dtype=model, what the model hands the core: raw (unnormalised) BF16 q, k with
// --key_heads key heads as slices of one conv-output row, BF16 v (Note [GDR core value
// dtype] in models/qwen/layers.cc; FP32 v before session 8), GdrQkNorm::kL2 (the
// norm and head mapping fused into the prep kernels; the ATen arms normalise and repeat in
// ATen). CUDA events around each host call
// (so host and launch overhead count, which is what the composite loses), warm-up, then the median
// of timed repetitions.
//
// Shapes: B x T (--batch, --lengths / --seq, or --shapes=BxT,... ; --anchor_shapes is the
// list ../shared/tools/gdn_anchor.py times), H value heads and Hk key heads, and with
// --documents=N each row packed with N equal-length documents through
// gated_delta_rule_varlen (B = 1, as FLA's cu_seqlens), so no state crosses a document.
//
// --json: instead of the arms table, one machine-readable line per shape for the process's
// own policy (the defaults plus GDR_* overrides), `GDR {...}` with the keys of
// gdn_anchor.py's `ANCHOR {...}` lines (fwd_ms_eager, fwdbwd_ms_eager, fwd_ms_graph,
// fwdbwd_ms_graph, bwd_bitexact_3_replays) plus B, T, H, Hk, dk, dv, documents: graph =
// kPerGraph calls captured in one CUDA graph, median of kGraphRepeats replays / kPerGraph,
// as gdn_anchor.py's graph_time (its forward under no_grad, here NoGradGuard): GPU time,
// what a graphed training step pays, and the only figure to set beside the anchors'. A
// capture that fails (a host sync inside, say) is reported in the line's graph_error, and
// the run goes on. tools/gpu/gdr_core_vs_anchors.sh runs it beside the anchors.
//
// FLOP count (matmul FLOPs of the whole chunked algorithm, per batch*head and chunk of
// C = 64 rows; elementwise work ignored):
//   forward  F = 2 C^2 dk (Kb K^T) + C^2 (dk + dv) (triangular solve) + 2 C^2 dk (Q K^T)
//              + 6 C dk dv (W S, Qd S, Kend^T V) + 2 C^2 dv (P V)
//   forward+backward = 3 F (the backward does about two matmuls per forward matmul).
// TFLOP/s = FLOPs / time; both implementations get the same count.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_policy.h"
#include "bench/cuda_timing.h"
#include "bench/kernel_profile.h"
#include "kernels/gdr_core/chunk_gemm.h"
#include "kernels/gdr_core/chunk_prep.h"
#include "kernels/gdr_core/chunk_state.h"
#include "ops/gdr_core/chunk_state_op.h"
#include "ops/gdr_core/gdr_core_op.h"

namespace gdr {
namespace {

constexpr int kWarmup = 5;
constexpr int kRepeats = 21;
// Graph timing as gdn_anchor.py's graph_time: 3 eager calls first, 20 calls per graph, the
// median of 5 replays after one.
constexpr int kGraphWarmupCalls = 3;
constexpr int kPerGraph = 20;
constexpr int kGraphWarmup = 1;
constexpr int kGraphRepeats = 5;

const char* name_of(GdrCoreImpl impl) {
  return impl == GdrCoreImpl::kKernel ? "kernel" : "composite";
}
const char* name_of(GdrCorePrep prep) { return prep == GdrCorePrep::kKernel ? "kernel" : "aten"; }

double median_ms(const std::function<void()>& fn) {
  return bench::median_event_ms(fn, kWarmup, kRepeats);
}

// T tokens per row in `documents` equal documents (each padded to whole chunks on its own).
double forward_flops(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv,
                     int64_t documents = 1) {
  const double C = static_cast<double>(kGdrChunkSize);
  const int64_t L = T / documents;
  const double N = static_cast<double>(documents * ((L + kGdrChunkSize - 1) / kGdrChunkSize));
  const double per_chunk =
      2 * C * C * dk + C * C * (dk + dv) + 2 * C * C * dk + 6 * C * dk * dv + 2 * C * C * dv;
  return static_cast<double>(B * H) * N * per_chunk;
}

struct Timings {
  double forward_ms = 0, forward_backward_ms = 0;
};

// How the core's inputs arrive (--dtype).
enum class Inputs { kBf16, kFp32, kModel };

// One case of the benchmark: B rows of T tokens, each row `documents` packed documents.
struct Shape {
  int64_t B = 1, T = 0;
};

// "2048" for B = 1 (the table's old T column), else "4 x 2048"; " / 4 docs" when packed.
std::string shape_name(const Shape& shape, int64_t documents) {
  std::string name = shape.B == 1 ? std::to_string(shape.T)
                                  : std::to_string(shape.B) + " x " + std::to_string(shape.T);
  if (documents > 1) name += " / " + std::to_string(documents) + " docs";
  return name;
}

// The core's inputs for one shape, its call and its forward+backward (autograd), built once
// and timed under several policies.
struct CoreCase {
  std::vector<at::Tensor> leaves;  // q, k, v, g, beta; leaves that require grad
  at::Tensor grad_o;
  GdrQkNorm qk_norm = GdrQkNorm::kNone;
  double scale = 1.0;
  std::vector<int64_t> cu_seqlens;  // empty: one document per row

  std::tuple<at::Tensor, at::Tensor> run() const {
    if (!cu_seqlens.empty()) {
      return gated_delta_rule_varlen(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale,
                                     cu_seqlens, std::nullopt, false, qk_norm);
    }
    return gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale,
                                    std::nullopt, false, kGdrChunkSize, qk_norm);
  }
  void forward() const { run(); }
  std::vector<at::Tensor> forward_backward() const {
    auto [o, s] = run();
    return torch::autograd::grad({o}, leaves, {grad_o});
  }
};

CoreCase make_case(const Shape& shape, int64_t H, int64_t Hk, int64_t dk, int64_t dv, Inputs inputs,
                   int64_t documents) {
  const int64_t B = shape.B, T = shape.T;
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const bool model = inputs == Inputs::kModel;
  const at::ScalarType qk_dtype = inputs == Inputs::kFp32 ? at::kFloat : at::kBFloat16;
  const at::ScalarType v_dtype = inputs == Inputs::kFp32 ? at::kFloat : at::kBFloat16;
  at::manual_seed(0);
  at::Tensor q, k;
  if (model) {
    const at::Tensor conv = at::randn({B, T, 2 * Hk * dk}, cuda).to(qk_dtype);
    q = conv.narrow(-1, 0, Hk * dk).view({B, T, Hk, dk});
    k = conv.narrow(-1, Hk * dk, Hk * dk).view({B, T, Hk, dk});
  } else {
    q = at::randn({B, T, H, dk}, cuda);
    k = at::randn({B, T, H, dk}, cuda);
    q = (q / q.norm(2, -1, true)).to(qk_dtype);
    k = (k / k.norm(2, -1, true)).to(qk_dtype);
  }
  const at::Tensor v = at::randn({B, T, H, dv}, cuda).to(v_dtype);
  const at::Tensor g = -at::rand({B, T, H}, cuda);
  const at::Tensor beta = at::sigmoid(at::randn({B, T, H}, cuda));
  CoreCase c;
  c.grad_o = at::randn({B, T, H, dv}, cuda).to(v_dtype);
  c.scale = 1.0 / std::sqrt(static_cast<double>(dk));
  c.qk_norm = model ? GdrQkNorm::kL2 : GdrQkNorm::kNone;
  c.leaves = {q, k, v, g, beta};
  for (at::Tensor& t : c.leaves) t = t.detach().requires_grad_(true);
  if (documents > 1) {
    for (int64_t i = 0; i <= documents; ++i) c.cu_seqlens.push_back(i * (T / documents));
  }
  return c;
}

void bench_length(const Shape& shape, int64_t H, int64_t Hk, int64_t dk, int64_t dv, Inputs inputs,
                  bool profile, int64_t documents) {
  const int64_t B = shape.B, T = shape.T;
  const CoreCase c = make_case(shape, H, Hk, dk, dv, inputs, documents);
  auto forward = [&] { c.forward(); };
  auto forward_backward = [&] { c.forward_backward(); };

  // Arms (execution policies over the process's own): step 7 (gdr_core_impl) and steps 1-6
  // (gdr_core_prep) each as kernel or ATen, the step 7 kernel on tensor cores (3xTF32, the
  // default) or the FP32 SIMT kernel (chunk_scan_tensor_cores), its batched products on the
  // tensor-core GEMM (3xTF32, the default) or cuBLAS FP32 (chunk_gemm_tensor_cores); the prep
  // backward's dM, dK and dQ products on tensor cores (the default) or FP32 SIMT
  // (chunk_prep_tensor_cores); the backward's dQd / dP GEMMs beside the scan on a side stream
  // (the default) or in line (chunk_gemm_overlap); the first arm is the default
  // configuration, the last (all ATen) the baseline of the "vs composite" columns.
  struct Arm {
    GdrCoreImpl impl;
    GdrCorePrep prep;
    bool scan_tc;
    bool prep_tc = true;
    bool gemm_tc = true;
    bool gemm_overlap = true;
  };
  constexpr int kArms = 7;
  const Arm arms[kArms] = {{GdrCoreImpl::kKernel, GdrCorePrep::kKernel, true},
                           {GdrCoreImpl::kKernel, GdrCorePrep::kKernel, true, true, true, false},
                           {GdrCoreImpl::kKernel, GdrCorePrep::kKernel, true, true, false},
                           {GdrCoreImpl::kKernel, GdrCorePrep::kKernel, true, false},
                           {GdrCoreImpl::kKernel, GdrCorePrep::kKernel, false},
                           {GdrCoreImpl::kKernel, GdrCorePrep::kAten, true},
                           {GdrCoreImpl::kComposite, GdrCorePrep::kAten, true}};
  // The tensor-core prep exists for dk <= 128 only (kernels::chunk_prep_uses_tensor_cores):
  // elsewhere the default arms run the SIMT prep and the SIMT arm would time it again, so
  // it is left out.
  const bool prep_has_tc = kernels::chunk_prep_uses_tensor_cores(dk, dv, true);
  auto arm_policy_of = [](const Arm& arm) {
    ExecutionPolicy policy = current_execution_policy();
    policy.gdr_core_impl = arm.impl;
    policy.gdr_core_prep = arm.prep;
    policy.chunk_scan_tensor_cores = arm.scan_tc;
    policy.chunk_prep_tensor_cores = arm.prep_tc;
    policy.chunk_gemm_tensor_cores = arm.gemm_tc;
    policy.chunk_gemm_overlap = arm.gemm_overlap;
    return policy;
  };
  auto skipped = [&](const Arm& arm) {
    return arm.prep == GdrCorePrep::kKernel && !arm.prep_tc && !prep_has_tc;
  };
  Timings t[kArms];
  for (int i = 0; i < kArms; ++i) {
    if (skipped(arms[i])) continue;
    const ExecutionPolicyGuard arm_policy(arm_policy_of(arms[i]));
    const int64_t gemm_launches = kernels::chunk_gemm_launch_count();
    const int64_t side_runs = chunk_state_internal::backward_side_stream_runs();
    forward_backward();
    if (arms[i].impl == GdrCoreImpl::kKernel &&
        (chunk_state_internal::backward_side_stream_runs() != side_runs) !=
            (arms[i].gemm_tc && arms[i].gemm_overlap)) {
      std::fprintf(stderr, "gdr_core_bench: the backward's dQd / dP GEMMs ran %s, expected %s\n",
                   arms[i].gemm_overlap ? "in line" : "on the side stream",
                   arms[i].gemm_overlap ? "on the side stream" : "in line");
    }
    if (gdr_core_last_step7() != arms[i].impl || gdr_core_last_prep() != arms[i].prep) {
      std::fprintf(stderr, "gdr_core_bench: ran step 7 %s / prep %s, expected %s / %s\n",
                   name_of(gdr_core_last_step7()), name_of(gdr_core_last_prep()),
                   name_of(arms[i].impl), name_of(arms[i].prep));
    }
    if (arms[i].impl == GdrCoreImpl::kKernel &&
        kernels::chunk_state_scan_last_used_tensor_cores() != arms[i].scan_tc) {
      std::fprintf(stderr, "gdr_core_bench: the scan ran on %s, expected %s\n",
                   arms[i].scan_tc ? "SIMT" : "tensor cores",
                   arms[i].scan_tc ? "tensor cores" : "SIMT");
    }
    if (arms[i].impl == GdrCoreImpl::kKernel &&
        (kernels::chunk_gemm_launch_count() != gemm_launches) != arms[i].gemm_tc) {
      std::fprintf(stderr, "gdr_core_bench: the state pass's products ran on %s, expected %s\n",
                   arms[i].gemm_tc ? "cuBLAS" : "the tensor-core GEMM",
                   arms[i].gemm_tc ? "the tensor-core GEMM" : "cuBLAS");
    }
    const bool expect_prep_tc = arms[i].prep_tc && prep_has_tc;
    if (arms[i].prep == GdrCorePrep::kKernel &&
        kernels::chunk_prep_last_used_tensor_cores() != expect_prep_tc) {
      std::fprintf(stderr, "gdr_core_bench: the prep ran on %s, expected %s\n",
                   expect_prep_tc ? "SIMT" : "tensor cores",
                   expect_prep_tc ? "tensor cores" : "SIMT");
    }
    t[i].forward_ms = median_ms(forward);
    t[i].forward_backward_ms = median_ms(forward_backward);
  }

  const double f = forward_flops(B, T, H, dk, dv, documents);
  auto tflops = [](double flops, double ms) { return flops / (ms * 1e-3) / 1e12; };
  const Timings& base = t[kArms - 1];
  for (int i = 0; i < kArms; ++i) {
    if (skipped(arms[i])) continue;
    const std::string step7 =
        std::string(name_of(arms[i].impl)) +
        (arms[i].impl != GdrCoreImpl::kKernel
             ? ""
             : std::string(arms[i].scan_tc ? " (tc" : " (simt") +
                   (arms[i].gemm_tc ? ", gemm tc" : ", cublas") +
                   (arms[i].gemm_tc && !arms[i].gemm_overlap ? ", in line)" : ")"));
    const std::string prep =
        std::string(name_of(arms[i].prep)) +
        (arms[i].prep == GdrCorePrep::kKernel && !arms[i].prep_tc ? " (simt)" : "");
    std::printf("| %s | %lld | %lld/%lld | %s | %s | %.3f | %.2fx | %.2f | %.3f | %.2fx | %.2f |\n",
                shape_name(shape, documents).c_str(), static_cast<long long>(H),
                static_cast<long long>(dk), static_cast<long long>(dv), step7.c_str(), prep.c_str(),
                t[i].forward_ms, base.forward_ms / t[i].forward_ms, tflops(f, t[i].forward_ms),
                t[i].forward_backward_ms, base.forward_backward_ms / t[i].forward_backward_ms,
                tflops(3 * f, t[i].forward_backward_ms));
  }
  if (profile) {
    // The default arm (kernel scan and prep, tensor cores), forward+backward.
    const ExecutionPolicyGuard arm_policy(arm_policy_of(arms[0]));
    bench::print_kernel_profile(
        "forward+backward, " + shape_name(shape, documents) + ", default arm", forward_backward,
        {.top_kernels = 20});
  }
  std::fflush(stdout);
}

// Milliseconds as gdn_anchor.py rounds them (4 decimals).
double round4(double ms) { return std::round(ms * 1e4) / 1e4; }

// The --json line of one shape (see the header): the process's policy, eager and graph
// times of the forward and of forward+backward, and whether three forward+backward runs
// gave bit-identical gradients; failures are reported in the line, not thrown.
void bench_json(const Shape& shape, int64_t H, int64_t Hk, int64_t dk, int64_t dv, Inputs inputs,
                int64_t documents) {
  const char* input_names[] = {"bf16", "fp32", "model"};
  nlohmann::ordered_json r = {{"impl", "gdr"},
                              {"B", shape.B},
                              {"T", shape.T},
                              {"H", H},
                              {"Hk", Hk},
                              {"dk", dk},
                              {"dv", dv},
                              {"documents", documents},
                              {"inputs", input_names[static_cast<int>(inputs)]}};
  // The message without libtorch's backtrace, on one line, short enough for a table cell.
  auto short_error = [](const std::exception& e) {
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    std::string what = c10_error != nullptr ? c10_error->what_without_backtrace() : e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    return what.substr(0, 300);
  };
  try {
    const CoreCase c = make_case(shape, H, Hk, dk, dv, inputs, documents);
    auto forward = [&] { c.forward(); };
    auto forward_backward = [&] { c.forward_backward(); };
    try {
      r["fwd_ms_eager"] = round4(median_ms(forward));
      r["fwdbwd_ms_eager"] = round4(median_ms(forward_backward));
      r["step7"] = name_of(gdr_core_last_step7());
      r["prep"] = name_of(gdr_core_last_prep());
    } catch (const std::exception& e) {
      r["eager_error"] = short_error(e);
    }
    std::string error;
    double ms = 0;
    {
      // As gdn_anchor.py: the forward graph records no autograd state.
      const at::NoGradGuard no_grad;
      ms = bench::median_graph_ms(forward, kPerGraph, kGraphWarmupCalls, kGraphWarmup,
                                  kGraphRepeats, &error);
    }
    if (ms >= 0) r["fwd_ms_graph"] = round4(ms);
    std::string graph_error = ms < 0 ? "fwd: " + error : "";
    ms = bench::median_graph_ms(forward_backward, kPerGraph, kGraphWarmupCalls, kGraphWarmup,
                                kGraphRepeats, &error);
    if (ms >= 0) r["fwdbwd_ms_graph"] = round4(ms);
    if (ms < 0) graph_error += (graph_error.empty() ? "" : "; ") + ("fwd+bwd: " + error);
    if (!graph_error.empty()) {
      std::replace(graph_error.begin(), graph_error.end(), '\n', ' ');
      r["graph_error"] = graph_error.substr(0, 300);
    }
    try {
      std::vector<at::Tensor> runs;
      for (int i = 0; i < 3; ++i) {
        std::vector<at::Tensor> grads = c.forward_backward();
        for (at::Tensor& g : grads) g = g.to(at::kFloat).flatten();
        runs.push_back(at::cat(grads));
      }
      r["bwd_bitexact_3_replays"] = at::equal(runs[0], runs[1]) && at::equal(runs[0], runs[2]);
    } catch (const std::exception& e) {
      r["replay_error"] = short_error(e);
    }
  } catch (const std::exception& e) {
    r["error"] = short_error(e);
  }
  std::printf("GDR %s\n", r.dump().c_str());
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

namespace {

// Parses "B x T" items of --shapes ("4x2048,1x8192") into `out`; false on a bad item.
bool parse_shapes(const std::string& list, std::vector<gdr::Shape>& out) {
  out.clear();
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ',')) {
    long long b = 0, t = 0;
    char tail = 0;
    if (std::sscanf(item.c_str(), "%lldx%lld%c", &b, &t, &tail) != 2 || b <= 0 || t <= 0) {
      std::fprintf(stderr, "gdr_core_bench: --shapes expects BxT items, got '%s'\n", item.c_str());
      return false;
    }
    out.push_back({b, t});
  }
  return !out.empty();
}

// Parses a comma-separated list of positive integers; false on a bad item.
bool parse_lengths(const char* flag, const std::string& list, std::vector<int64_t>& out) {
  out.clear();
  std::stringstream items(list);
  std::string item;
  long long value = 0;
  while (std::getline(items, item, ',')) {
    if (std::sscanf(item.c_str(), "%lld", &value) != 1 || value <= 0) {
      std::fprintf(stderr, "gdr_core_bench: %s expects positive integers, got '%s'\n", flag,
                   item.c_str());
      return false;
    }
    out.push_back(value);
  }
  return !out.empty();
}

}  // namespace

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("gdr_core_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  std::vector<int64_t> lengths = {2048, 16384};
  std::vector<gdr::Shape> shapes;  // --shapes / --anchor_shapes; else batch x lengths
  int64_t batch = 1, heads = 16, key_heads = 0, dk = 128, dv = 128, documents = 1;
  gdr::Inputs inputs = gdr::Inputs::kBf16;
  bool profile = false, json = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: gdr_core_bench [--lengths=T,... | --seq=T,...] [--batch=B] [--shapes=BxT,...]\n"
          "       [--anchor_shapes] [--documents=N] [--heads=H] [--key_heads=Hk] [--dk=D]\n"
          "       [--dv=D] [--dtype=bf16|fp32|model] [--profile] [--json]\n"
          "  Times gated_delta_rule_chunked forward and forward+backward with\n"
          "  step 7 as the CUDA chunk state kernel (kernel) and as the per-chunk ATen loop\n"
          "  (composite), and steps 1-6 (prep) as the chunk prep kernels (kernel) or ATen ops\n"
          "  (aten): rows kernel/kernel, kernel/aten, composite/aten. Inputs: bf16 / fp32 =\n"
          "  L2-normalised q/k/v of that dtype with H heads; model = what the model hands the\n"
          "  core: raw BF16 q/k with Hk key heads (slices of one conv row), BF16 v,\n"
          "  GdrQkNorm::kL2. Defaults: --lengths=2048,16384 --batch=1 --heads=16 --key_heads=H\n"
          "  --dk=128 --dv=128 --dtype=bf16. --shapes=BxT,... replaces --batch x --lengths;\n"
          "  --anchor_shapes = 1x2048,4x2048,1x8192,1x16384,1x65536 (gdn_anchor.py's).\n"
          "  --documents=N: each row is N equal documents through gated_delta_rule_varlen\n"
          "  (needs B = 1 and T a multiple of N). --profile: after each shape's rows, the top\n"
          "  GPU kernels of one forward+backward of the first (default) arm.\n"
          "  --json: no arms table; per shape one line 'GDR {json}' for the process's policy\n"
          "  with gdn_anchor.py's keys (eager and CUDA-graph-replay ms of fwd and fwd+bwd,\n"
          "  bwd_bitexact_3_replays), B, T, H, Hk, dk, dv, documents.\n"
          "  'vs composite' is composite time / this row's time; TFLOP/s counts the matmul\n"
          "  FLOPs of the whole chunked algorithm (formula in bench/gdr_core_bench.cc).\n");
      return 0;
    }
    long long value = 0;
    if (arg.rfind("--lengths=", 0) == 0) {
      if (!parse_lengths("--lengths", arg.substr(10), lengths)) return 2;
    } else if (arg.rfind("--seq=", 0) == 0) {
      if (!parse_lengths("--seq", arg.substr(6), lengths)) return 2;
    } else if (arg.rfind("--shapes=", 0) == 0) {
      if (!parse_shapes(arg.substr(9), shapes)) return 2;
    } else if (arg == "--anchor_shapes") {
      shapes = {{1, 2048}, {4, 2048}, {1, 8192}, {1, 16384}, {1, 65536}};
    } else if (arg == "--profile") {
      profile = true;
    } else if (arg == "--json") {
      json = true;
    } else if (arg == "--dtype=bf16" || arg == "--dtype=fp32" || arg == "--dtype=model") {
      inputs = arg == "--dtype=fp32"    ? gdr::Inputs::kFp32
               : arg == "--dtype=model" ? gdr::Inputs::kModel
                                        : gdr::Inputs::kBf16;
    } else if (std::sscanf(argv[i], "--batch=%lld", &value) == 1 && value > 0) {
      batch = value;
    } else if (std::sscanf(argv[i], "--documents=%lld", &value) == 1 && value > 0) {
      documents = value;
    } else if (std::sscanf(argv[i], "--heads=%lld", &value) == 1 && value > 0) {
      heads = value;
    } else if (std::sscanf(argv[i], "--key_heads=%lld", &value) == 1 && value > 0) {
      key_heads = value;
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
  if (shapes.empty()) {
    for (int64_t T : lengths) shapes.push_back({batch, T});
  }
  if (key_heads == 0) key_heads = heads;
  if (inputs != gdr::Inputs::kModel && key_heads != heads) {
    std::fprintf(stderr,
                 "gdr_core_bench: --key_heads needs --dtype=model (got Hk = %lld, H = %lld)\n",
                 static_cast<long long>(key_heads), static_cast<long long>(heads));
    return 2;
  }
  if (heads % key_heads != 0) {
    std::fprintf(stderr,
                 "gdr_core_bench: --heads must be a multiple of --key_heads but got H = %lld, "
                 "Hk = %lld\n",
                 static_cast<long long>(heads), static_cast<long long>(key_heads));
    return 2;
  }
  for (const gdr::Shape& shape : shapes) {
    // Packed documents are one row (gated_delta_rule_varlen's contract), split evenly.
    if (documents > 1 && (shape.B != 1 || shape.T % documents != 0)) {
      std::fprintf(stderr,
                   "gdr_core_bench: --documents=%lld needs B = 1 and T a multiple of it, got "
                   "%lld x %lld\n",
                   static_cast<long long>(documents), static_cast<long long>(shape.B),
                   static_cast<long long>(shape.T));
      return 2;
    }
  }
  if (json) {
    for (const gdr::Shape& shape : shapes) {
      gdr::bench_json(shape, heads, key_heads, dk, dv, inputs, documents);
    }
    return 0;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const char* input_names[] = {"BF16 q/k/v", "FP32 q/k/v",
                               "raw BF16 q/k (fused L2 norm, Hk key heads), BF16 v"};
  std::printf(
      "GPU: %s, %d SMs; %s, Hk = %lld%s; warm-up %d, median of %d; eager times in ms "
      "(CUDA events around the host call)\n\n",
      prop.name, prop.multiProcessorCount, input_names[static_cast<int>(inputs)],
      static_cast<long long>(key_heads),
      documents > 1 ? (", " + std::to_string(documents) + " packed documents per row").c_str() : "",
      gdr::kWarmup, gdr::kRepeats);
  std::printf(
      "| B x T | H | dk/dv | step 7 | prep | forward ms | vs composite | fwd TFLOP/s | fwd+bwd ms "
      "| vs composite | fwd+bwd TFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const gdr::Shape& shape : shapes) {
    gdr::bench_length(shape, heads, key_heads, dk, dv, inputs, profile, documents);
  }
  return 0;
}
