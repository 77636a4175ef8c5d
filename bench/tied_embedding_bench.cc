// Benchmark of the tied embedding's weight gradient (ops/tied_embedding/tied_embedding_op.h) on one
// GPU at the 0.8B model's shapes (W [248320, 1024], N tokens of Zipf-like ids): the tail that Note
// [Tied embedding gradient] replaces, i.e. the composite's dense embedding gradient
// (at::embedding_dense_backward: zero fill + scatter) plus the [V, H] add into the LM
// head's dW, against the fused rows op adding into dW in place; then lookup + LM head
// forward + backward through autograd, fused against the composite (torch::nn::Embedding's
// at::embedding + matmul), where the two GEMMs dominate. CUDA events (warm-up, then the
// median; bench/cuda_timing.h), eager and graph (kPerGraph calls in one CUDA graph: GPU
// time alone). Prints a Markdown table.
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
#include "ops/tied_embedding/tied_embedding_op.h"

namespace gdr {
namespace {

constexpr int kWarmup = 5;
constexpr int kRepeats = 30;
constexpr int kPerGraph = 5;
constexpr int64_t kVocab = 248320;
constexpr int64_t kHidden = 1024;

using bench::Timing;

Timing time_both(const std::function<void()>& fn) {
  return bench::median_eager_and_graph_ms(fn, kPerGraph, 3, kWarmup, kRepeats);
}

void print_row(int64_t tokens, at::ScalarType dtype, const char* what, const Timing& t) {
  std::printf("| %lld | %s | %s | %.1f | %.1f |\n", static_cast<long long>(tokens),
              c10::toString(dtype), what, t.eager * 1e3, t.graph * 1e3);
}

// Log-uniform ids over [0, V) (id k about as often as 1/k), on the GPU.
at::Tensor zipf_ids(int64_t tokens) {
  const at::Tensor u = at::rand({tokens}, at::TensorOptions().dtype(at::kDouble));
  return ((u * std::log(static_cast<double>(kVocab))).exp().floor().to(at::kLong) - 1)
      .clamp(0, kVocab - 1)
      .to(at::kCUDA);
}

void bench_case(int64_t tokens, at::ScalarType dtype) {
  const auto cuda = at::TensorOptions().device(at::kCUDA).dtype(dtype);
  at::manual_seed(1);
  const at::Tensor ids = zipf_ids(tokens);
  const at::Tensor ids_2d = ids.reshape({1, tokens});
  const at::Tensor weight = at::randn({kVocab, kHidden}, cuda) * 0.02;
  const at::Tensor rows = at::randn({tokens, kHidden}, cuda);
  at::Tensor dw = at::randn({kVocab, kHidden}, cuda) * 1e-3;
  const at::Tensor probe = at::randn({1, tokens, kVocab}, cuda) * 1e-4;

  const Timing composite_tail = time_both([&] {
    const at::Tensor dense = at::embedding_dense_backward(rows, ids, kVocab, -1, false);
    dw.add_(dense);
  });
  const Timing fused_tail = time_both([&] { tied_embedding_add_rows_(dw, ids, rows); });

  auto fwd_bwd = [&](bool fused) {
    const at::Tensor w = weight.detach().requires_grad_(true);
    at::Tensor logits;
    if (fused) {
      const TiedEmbeddingStatePtr state = make_tied_embedding_state();
      const at::Tensor h = tied_embedding_lookup(ids_2d, w, state);
      logits = tied_lm_head(h * 1.5, w, state);
    } else {
      logits = (at::embedding(w, ids_2d) * 1.5).matmul(w.t());
    }
    torch::autograd::grad({logits}, {w}, {probe});
  };
  const Timing composite_fb = time_both([&] { fwd_bwd(false); });
  const Timing fused_fb = time_both([&] { fwd_bwd(true); });
  print_row(tokens, dtype, "composite W-gradient tail (dense backward + [V, H] add)",
            composite_tail);
  print_row(tokens, dtype, "fused W-gradient tail (rows op in place)", fused_tail);
  print_row(tokens, dtype, "composite lookup + LM head fwd+bwd", composite_fb);
  print_row(tokens, dtype, "fused lookup + LM head fwd+bwd", fused_fb);
  std::fflush(stdout);
}

}  // namespace
}  // namespace gdr

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("tied_embedding_bench");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  std::vector<at::ScalarType> dtypes = {at::kBFloat16};
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help") {
      std::printf(
          "usage: tied_embedding_bench [--all-dtypes]\n"
          "  Times the tied embedding's weight-gradient tail (ATen's dense embedding backward\n"
          "  plus the [V, H] add, against the fused rows op) and lookup + LM head\n"
          "  forward+backward (composite against the fused pair) at W [248320, 1024] for\n"
          "  2048 and 8192 tokens; BF16, or BF16 and FP32 with --all-dtypes.\n");
      return 0;
    }
    if (arg == "--all-dtypes") {
      dtypes = {at::kBFloat16, at::kFloat};
    } else {
      std::fprintf(stderr, "tied_embedding_bench: unknown argument '%s' (see --help)\n", argv[i]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf(
      "GPU: %s, %d SMs; warm-up %d, median of %d; times in us (eager / graph)\n\n| tokens | "
      "dtype | case | eager us | graph us |\n|---|---|---|---|---|\n",
      prop.name, prop.multiProcessorCount, gdr::kWarmup, gdr::kRepeats);
  for (at::ScalarType dtype : dtypes) {
    for (int64_t tokens : {2048, 8192}) gdr::bench_case(tokens, dtype);
  }
  return 0;
}
