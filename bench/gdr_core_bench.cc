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
#include <cstdlib>
#include <functional>
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

const char* name_of(GdrCoreImpl impl) {
  return impl == GdrCoreImpl::kKernel ? "kernel" : "composite";
}
const char* name_of(GdrCorePrep prep) { return prep == GdrCorePrep::kKernel ? "kernel" : "aten"; }

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

// How the core's inputs arrive (--dtype).
enum class Inputs { kBf16, kFp32, kModel };

void bench_length(int64_t T, int64_t H, int64_t Hk, int64_t dk, int64_t dv, Inputs inputs,
                  bool profile) {
  const int64_t B = 1;
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
  const at::Tensor grad_o = at::randn({B, T, H, dv}, cuda).to(v_dtype);
  const double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  const GdrQkNorm qk_norm = model ? GdrQkNorm::kL2 : GdrQkNorm::kNone;

  std::vector<at::Tensor> leaves = {q, k, v, g, beta};
  for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
  auto run = [&] {
    return gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], scale,
                                    std::nullopt, false, kGdrChunkSize, qk_norm);
  };
  auto forward = [&] { run(); };
  auto forward_backward = [&] {
    auto [o, s] = run();
    torch::autograd::grad({o}, leaves, {grad_o});
  };

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

  const double f = forward_flops(B, T, H, dk, dv);
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
    std::printf(
        "| %lld | %lld | %lld/%lld | %s | %s | %.3f | %.2fx | %.2f | %.3f | %.2fx | %.2f |\n",
        static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(dk),
        static_cast<long long>(dv), step7.c_str(), prep.c_str(), t[i].forward_ms,
        base.forward_ms / t[i].forward_ms, tflops(f, t[i].forward_ms), t[i].forward_backward_ms,
        base.forward_backward_ms / t[i].forward_backward_ms,
        tflops(3 * f, t[i].forward_backward_ms));
  }
  if (profile) {
    // The default arm (kernel scan and prep, tensor cores), forward+backward.
    const ExecutionPolicyGuard arm_policy(arm_policy_of(arms[0]));
    bench::print_kernel_profile("forward+backward, T = " + std::to_string(T) + ", default arm",
                                forward_backward, {.top_kernels = 20});
  }
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("gdr_core_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  std::vector<int64_t> lengths = {2048, 16384};
  int64_t heads = 16, key_heads = 0, dk = 128, dv = 128;
  gdr::Inputs inputs = gdr::Inputs::kBf16;
  bool profile = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: gdr_core_bench [--lengths=T,...] [--heads=H] [--key_heads=Hk] [--dk=D] "
          "[--dv=D] [--dtype=bf16|fp32|model] [--profile]\n"
          "  Times gated_delta_rule_chunked (B=1) forward and forward+backward with\n"
          "  step 7 as the CUDA chunk state kernel (kernel) and as the per-chunk ATen loop\n"
          "  (composite), and steps 1-6 (prep) as the chunk prep kernels (kernel) or ATen ops\n"
          "  (aten): rows kernel/kernel, kernel/aten, composite/aten. Inputs: bf16 / fp32 =\n"
          "  L2-normalised q/k/v of that dtype with H heads; model = what the model hands the\n"
          "  core: raw BF16 q/k with Hk key heads (slices of one conv row), BF16 v,\n"
          "  GdrQkNorm::kL2. Defaults: --lengths=2048,16384 --heads=16 --key_heads=H --dk=128\n"
          "  --dv=128 --dtype=bf16. --profile: after each length's rows, the top GPU kernels\n"
          "  of one forward+backward of the first (default) arm.\n"
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
    } else if (arg == "--profile") {
      profile = true;
    } else if (arg == "--dtype=bf16" || arg == "--dtype=fp32" || arg == "--dtype=model") {
      inputs = arg == "--dtype=fp32"    ? gdr::Inputs::kFp32
               : arg == "--dtype=model" ? gdr::Inputs::kModel
                                        : gdr::Inputs::kBf16;
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
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const char* input_names[] = {"BF16 q/k/v", "FP32 q/k/v",
                               "raw BF16 q/k (fused L2 norm, Hk key heads), BF16 v"};
  std::printf(
      "GPU: %s, %d SMs; B=1, %s, Hk = %lld; warm-up %d, median of %d; eager times in ms "
      "(CUDA events around the host call)\n\n",
      prop.name, prop.multiProcessorCount, input_names[static_cast<int>(inputs)],
      static_cast<long long>(key_heads), gdr::kWarmup, gdr::kRepeats);
  std::printf(
      "| T | H | dk/dv | step 7 | prep | forward ms | vs composite | fwd TFLOP/s | fwd+bwd ms | "
      "vs composite | fwd+bwd TFLOP/s |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (int64_t T : lengths) gdr::bench_length(T, heads, key_heads, dk, dv, inputs, profile);
  return 0;
}
