// GPU tests of the chunk GEMM (tag gpu): kernels::launch_chunk_gemm against an FP64 CPU
// reference for every product of the chunk state pass (O = Qd S + P V, P^T dO, Qd^T dO,
// dW = -dV S^T, dQd = dO S^T, dP = dO V^T, dKend = V G^T) at dk = dv = 128, dk = dv = 64
// and dk = 256 (dv = 128), within the 3xTF32 bound, next to cuBLAS FP32's error; 100
// bit-identical replays of each product while another stream loads the GPU; the chunk
// state pass op (forward and backward through autograd) with GDR_CHUNK_GEMM_TC=1 (the
// kernel) against =0 (at::bmm, cuBLAS FP32) and the FP64 CPU reference op; the refusal of
// an unknown GDR_CHUNK_GEMM_TC value. Both kernel paths (wgmma, the default on sm_90a, and
// mma.sync) against FP64 and each other.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "kernels/gdr_core/chunk_gemm.h"
#include "ops/gdr_core/chunk_state_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/gpu_contention.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

const auto kCuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);

using test_support::bitwise_equal;

// The state pass's GEMMs on the 3xTF32 kernel or cuBLAS FP32, over the current execution
// policy, for a scope.
using ScopedGemmKernel =
    test_support::ScopedPolicyChoice<&ExecutionPolicy::chunk_gemm_tensor_cores>;

// ---------------------------------------------------------------------------
// The launcher against FP64

// One product op(a) op(b) of [batch, r, c] FP32 CUDA tensors.
struct Term {
  at::Tensor a, b;
};

struct Product {
  std::string name;
  bool ta, tb;
  std::vector<Term> terms;
  float alpha = 1.0f;
};

at::Tensor op(const at::Tensor& x, bool transpose) { return transpose ? x.transpose(1, 2) : x; }

// The kernel on the current stream: alpha * sum of op(a) op(b) into a fresh [batch, M, N].
// wgmma: the default path (wgmma on sm_90a), else mma.sync (ChunkGemmArgs::allow_wgmma).
at::Tensor run_kernel(const Product& p, bool wgmma = true) {
  const Term& first = p.terms.front();
  kernels::ChunkGemmArgs args;
  args.batch = first.a.size(0);
  args.m = static_cast<int>(op(first.a, p.ta).size(1));
  args.n = static_cast<int>(op(first.b, p.tb).size(2));
  args.transpose_a = p.ta;
  args.transpose_b = p.tb;
  args.products = static_cast<int>(p.terms.size());
  for (int i = 0; i < args.products; ++i) {
    const at::Tensor& a = p.terms[i].a;
    const at::Tensor& b = p.terms[i].b;
    args.product[i].a = {a.data_ptr<float>(), a.stride(0), a.stride(1)};
    args.product[i].b = {b.data_ptr<float>(), b.stride(0), b.stride(1)};
    args.product[i].k = static_cast<int>(op(a, p.ta).size(2));
  }
  args.alpha = p.alpha;
  args.allow_wgmma = wgmma;
  at::Tensor out = at::empty({args.batch, args.m, args.n}, kCuda);
  args.c = out.data_ptr<float>();
  args.c_stride_batch = out.stride(0);
  args.c_stride_row = out.stride(1);
  EXPECT_TRUE(kernels::chunk_gemm_supports(args)) << p.name;
  const int error = kernels::launch_chunk_gemm(args, c10::cuda::getCurrentCUDAStream().stream());
  EXPECT_EQ(error, 0) << p.name << ": " << cudaGetErrorString(static_cast<cudaError_t>(error));
  return out;
}

// The same with at::bmm (cuBLAS FP32), and in FP64 on the CPU; abs: with |a| and |b|.
at::Tensor run_bmm(const Product& p, bool fp64_cpu, bool abs = false) {
  at::Tensor sum;
  for (const Term& t : p.terms) {
    at::Tensor a = t.a, b = t.b;
    if (fp64_cpu) {
      a = a.to(at::kCPU, at::kDouble);
      b = b.to(at::kCPU, at::kDouble);
    }
    if (abs) {
      a = a.abs();
      b = b.abs();
    }
    const at::Tensor term = at::bmm(op(a, p.ta), op(b, p.tb));
    sum = sum.defined() ? sum + term : term;
  }
  return sum * (abs ? std::fabs(p.alpha) : p.alpha);
}

// The chunk state pass's products at (dk, dv), `batch` chunks, entries ~ N(0, 1/k) for the
// left factors and N(0, 1) for the right ones (every product O(1)).
std::vector<Product> state_pass_products(int64_t batch, int64_t dk, int64_t dv, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t C = 64;
  auto randn = [&](int64_t r, int64_t c, double scale) {
    return at::randn({batch, r, c}, kCuda) * scale;
  };
  const double rk = 1.0 / std::sqrt(static_cast<double>(dk));
  const double rc = 1.0 / std::sqrt(static_cast<double>(C));
  const double rv = 1.0 / std::sqrt(static_cast<double>(dv));
  const at::Tensor qd = randn(C, dk, rk), s = randn(dk, dv, 1.0), p = randn(C, C, rc).tril();
  const at::Tensor v = randn(C, dv, 1.0), dO = randn(C, dv, rc), dV = randn(C, dv, rv);
  const at::Tensor g = randn(dk, dv, 1.0), v_left = randn(C, dv, rv), dO_left = randn(C, dv, rv);
  return {
      {"O = Qd S + P V", false, false, {{qd, s}, {p, v}}},
      {"P^T dO", true, false, {{p, dO}}},
      {"Qd^T dO", true, false, {{qd * std::sqrt(static_cast<double>(dk)) * rc, dO}}},
      {"dW = -dV S^T", false, true, {{dV, s}}, -1.0f},
      {"dQd = dO S^T", false, true, {{dO_left, s}}},
      {"dP = dO V^T", false, true, {{dO_left, v}}},
      {"dKend = V G^T", false, true, {{v_left, g}}},
  };
}

TEST(ChunkGemmGpu, EveryStatePassProductMatchesFp64WithinThe3xTf32Bound) {
  struct Dims {
    int64_t dk, dv;
  };
  for (const bool wgmma : {true, false})
    for (const Dims d : {Dims{128, 128}, Dims{64, 64}, Dims{256, 128}}) {
      for (const Product& p : state_pass_products(37, d.dk, d.dv, 11 + d.dk)) {
        const std::string context = p.name + " dk " + std::to_string(d.dk) + " dv " +
                                    std::to_string(d.dv) + (wgmma ? " (default)" : " (mma.sync)");
        const at::Tensor got = run_kernel(p, wgmma).to(at::kCPU, at::kDouble);
        const at::Tensor cublas = run_bmm(p, false).to(at::kCPU, at::kDouble);
        const at::Tensor ref = run_bmm(p, true);
        const at::Tensor abs_sum = run_bmm(p, true, true);
        ASSERT_EQ(got.sizes(), ref.sizes()) << context;
        int64_t k_total = 0;
        for (const Term& t : p.terms) k_total += op(t.a, p.ta).size(2);
        // The bound of //tests/ops:gdr_chunk_gemm_kernel_emulation_test (3 2^-22 |a b| per
        // product for the split, K/8 + 2 accumulator roundings of at most sum |a b| per
        // element) with 2^-21 instead of 2^-23 per accumulator step: the tensor cores' FP32
        // accumulation aligns the mma's addends to the largest and truncates, a few ulp per
        // mma at worst. That slack no longer tells plain TF32 apart at K = 320, so the
        // FP32-level check below (plain TF32: ~3e-4) does.
        const at::Tensor bound =
            (3.0 * std::ldexp(1.0, -22) + (k_total / 8.0 + 2.0) * std::ldexp(1.0, -21)) * abs_sum +
            1e-30;
        const at::Tensor err = (got - ref).abs();
        const double ratio = (err / bound).max().item<double>();
        const double max_ref = ref.abs().max().item<double>();
        const double rel = err.max().item<double>() / max_ref;
        const double rel_cublas = (cublas - ref).abs().max().item<double>() / max_ref;
        std::printf(
            "%s: kernel %.2e, cuBLAS FP32 %.2e (max |error| / max |ref|), error / bound %.3f\n",
            context.c_str(), rel, rel_cublas, ratio);
        EXPECT_FALSE(at::isnan(got).any().item<bool>()) << context;
        EXPECT_LE(ratio, 1.0) << context << ": an element outside the 3xTF32 bound";
        EXPECT_LE(rel, 1e-5) << context << ": not FP32-level";
      }
    }
}

// The default path (wgmma on the H200) against mma.sync on the same inputs: one
// m64n64k8 step sums its eight products as eight m16n8k8 steps do, so the two give the
// same bits (Note [Chunk GEMM on wgmma]: training bits do not depend on the path); a
// layout or descriptor error in either gives O(1) differences. Off sm_90a both are the
// mma.sync path.
TEST(ChunkGemmGpu, TheWgmmaAndMmaSyncPathsGiveTheSameBits) {
  for (const Product& p : state_pass_products(512, 128, 128, 23)) {
    const at::Tensor a = run_kernel(p, true), b = run_kernel(p, false);
    const double rel = ((a - b).abs().max() / b.abs().max()).item<double>();
    const int64_t same = at::eq(a.view(at::kInt), b.view(at::kInt)).sum().item<int64_t>();
    std::printf(
        "%s: default vs mma.sync max |difference| / max |C| %.2e, %lld of %lld "
        "elements bitwise equal\n",
        p.name.c_str(), rel, static_cast<long long>(same), static_cast<long long>(a.numel()));
    EXPECT_TRUE(bitwise_equal(a, b)) << p.name;
  }
}

TEST(ChunkGemmGpu, HundredReplaysOfEachProductAreBitwiseIdenticalUnderLoad) {
  // The training shape: T = 2048, H = 16 (512 chunks), dk = dv = 128.
  const std::vector<Product> products = state_pass_products(512, 128, 128, 5);
  std::vector<at::Tensor> first;
  for (const Product& p : products) first.push_back(run_kernel(p));
  std::optional<test_support::GpuContention> load(std::in_place);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  std::vector<int> mismatches(products.size(), 0);
  for (int replay = 0; replay < 100; ++replay) {
    for (size_t i = 0; i < products.size(); ++i) {
      at::Tensor again;
      if (replay % 2 == 0) {
        again = run_kernel(products[i]);
      } else {  // every other replay on a side stream
        c10::cuda::getCurrentCUDAStream().synchronize();
        c10::cuda::CUDAStreamGuard guard(side);
        again = run_kernel(products[i]);
        side.synchronize();
      }
      mismatches[i] += bitwise_equal(again, first[i]) ? 0 : 1;
    }
  }
  load.reset();
  for (size_t i = 0; i < products.size(); ++i) {
    EXPECT_EQ(mismatches[i], 0) << products[i].name
                                << ": the chunk GEMM must give identical bits on every replay";
  }
}

// ---------------------------------------------------------------------------
// The chunk state pass op with GDR_CHUNK_GEMM_TC=1 against =0

double relative_error(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kCPU, at::kDouble);
  const at::Tensor d = x.to(at::kCPU, at::kDouble) - r;
  return d.abs().max().item<double>() / (r.abs().max().item<double>() + 1e-30);
}

struct OpInputs {
  at::Tensor u, w, qd, p, kend, g_last, initial_state, w_o, w_s;
};

OpInputs make_op_inputs(int64_t B, int64_t H, int64_t N, int64_t dk, int64_t dv, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t C = 64;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const double row = 0.5 / std::sqrt(static_cast<double>(dk));
  OpInputs x;
  x.u = at::randn({B, H, N, C, dv}, f64);
  x.w = at::randn({B, H, N, C, dk}, f64) * row;
  x.qd = at::randn({B, H, N, C, dk}, f64) * row;
  x.p = at::randn({B, H, N, C, C}, f64).tril() * 0.1;
  x.kend = at::randn({B, H, N, C, dk}, f64) * row;
  x.g_last = -3.0 * at::rand({B, H, N}, f64);
  x.initial_state = at::randn({B, H, dk, dv}, f64);
  x.w_o = at::randn({B, H, N, C, dv}, f64);
  x.w_s = at::randn({B, H, dk, dv}, f64);
  return x;
}

// o, final_state, states, v_new, then the gradients of u, w, qd, p, kend, g_last,
// initial_state of sum(o * w_o) + sum(final_state * w_s), through autograd.
std::vector<at::Tensor> run_pass(const OpInputs& x, bool cuda) {
  auto cvt = [cuda](const at::Tensor& t) {
    return cuda ? t.to(kCuda) : t;  // FP32 on the GPU, FP64 on the CPU
  };
  std::vector<at::Tensor> leaves = {cvt(x.u),    cvt(x.w),      cvt(x.qd),           cvt(x.p),
                                    cvt(x.kend), cvt(x.g_last), cvt(x.initial_state)};
  for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
  auto [o, s, states, v_new] =
      chunk_state_pass(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], leaves[6]);
  const at::Tensor loss = (o * cvt(x.w_o)).sum() + (s * cvt(x.w_s)).sum();
  std::vector<at::Tensor> out = {o.detach(), s.detach(), states, v_new};
  for (const at::Tensor& g : torch::autograd::grad({loss}, leaves)) out.push_back(g);
  return out;
}

TEST(ChunkGemmGpu, StatePassWithTheKernelMatchesCublasAndTheFp64Reference) {
  const char* names[] = {"o",   "final_state", "states", "v_new",   "du",       "dw",
                         "dqd", "dp",          "dkend",  "dg_last", "d_initial"};
  struct Dims {
    int64_t B, H, N, dk, dv;
  };
  for (const Dims d : {Dims{1, 4, 8, 128, 128}, Dims{2, 2, 5, 64, 64}, Dims{1, 2, 3, 256, 128},
                       Dims{1, 3, 4, 128, 48}}) {
    const std::string context = "dk " + std::to_string(d.dk) + " dv " + std::to_string(d.dv);
    const OpInputs x = make_op_inputs(d.B, d.H, d.N, d.dk, d.dv, 3 + d.dk + d.dv);
    const std::vector<at::Tensor> ref = run_pass(x, false);
    std::vector<at::Tensor> got[2];
    for (const bool tc : {false, true}) {
      const ScopedGemmKernel kernel(tc);
      const int64_t launches = kernels::chunk_gemm_launch_count();
      got[tc] = run_pass(x, true);
      // One forward GEMM and six backward ones with the kernel; none with cuBLAS.
      EXPECT_EQ(kernels::chunk_gemm_launch_count() - launches, tc ? 7 : 0) << context;
    }
    ASSERT_EQ(got[true].size(), ref.size());
    for (size_t i = 0; i < ref.size(); ++i) {
      ASSERT_EQ(got[true][i].sizes(), got[false][i].sizes()) << context << " " << names[i];
      EXPECT_EQ(got[true][i].strides(), got[false][i].strides()) << context << " " << names[i];
      EXPECT_EQ(got[true][i].scalar_type(), at::kFloat) << context << " " << names[i];
      const double err_tc = relative_error(got[true][i], ref[i]);
      const double err_cublas = relative_error(got[false][i], ref[i]);
      const double between = relative_error(got[true][i], got[false][i]);
      std::printf("%s %s: GEMM kernel %.2e, cuBLAS %.2e (vs FP64), between %.2e\n", context.c_str(),
                  names[i], err_tc, err_cublas, between);
      // Both FP32-level (3xTF32 or FP32 FFMA) after an FP32 scan: the state pass's own
      // tolerance against FP64 (//tests/ops:gdr_chunk_state_gpu_test), and as accurate as
      // cuBLAS up to rounding luck.
      EXPECT_LE(err_tc, 1e-4) << context << " " << names[i];
      EXPECT_LE(err_tc, std::max(1e-5, 4.0 * err_cublas)) << context << " " << names[i];
      EXPECT_LE(between, 1e-4) << context << " " << names[i];
    }
  }
}

TEST(ChunkGemmGpu, AnUnknownGemmKernelSettingIsRefusedNamingTheVariable) {
  EXPECT_EQ(test_support::policy_error("GDR_CHUNK_GEMM_TC", "yes"),
            "GDR_CHUNK_GEMM_TC: expected true, false, 1 or 0, but got 'yes'");
}

}  // namespace
}  // namespace gdr
