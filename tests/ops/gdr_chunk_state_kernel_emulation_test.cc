// The chunk state scan kernel run on the CPU: kernels/gdr_core/chunk_state_kernel.cuh is
// compiled as host code with stand-ins for the CUDA built-ins (one std::thread per CUDA
// thread, a barrier for __syncthreads, function statics for __shared__, one block at a
// time) and checked against a plain FP64 loop written from the recurrence in
// kernels/gdr_core/chunk_state.h: every dk the kernel supports, one and several dv tiles,
// both walk directions, operands that are strided and offset views of wider rows. The
// same cases run the tensor-core kernel (kernels/gdr_core/chunk_state_tc_kernel.cuh), whose
// warp-collective mma.sync and cvt.rna.tf32 are emulated here (per-warp scratch and
// barrier; see the stand-ins below), with a bound that only 3xTF32 meets. Then the CUDA
// op's own code (chunk_state_internal::forward_via_scan / backward_via_scan) runs with
// each emulated kernel against the CPU reference op. This proves the kernel's
// indexing and barriers and the op's layouts and formulas on machines without a GPU;
// speed, streams and the real hardware are the GPU test's business.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kernels/gdr_core/chunk_state.h"
#include "ops/gdr_core/chunk_state_op.h"

// Host stand-ins for the CUDA built-ins the kernels use (and nothing else; see the NOTEs
// in the .cuh files): threadIdx, blockIdx, __syncthreads, the per-warp barriers and
// run_grid from tests/ops/emulated_cuda.h. Blocks run one after another, so function
// statics serve as shared memory.
#include "tests/ops/chunk_state_outputs.h"
#include "tests/ops/emulated_cp_async.h"
#include "tests/ops/emulated_cuda.h"
#include "tests/ops/emulated_mma_tf32.h"

// CUDA's float4: 16-byte aligned, so the kernel's float4 loads and stores of shared
// memory and of operands it checked for 16-byte alignment are plain host accesses.
struct alignas(16) float4 {
  float x, y, z, w;
};

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#include "kernels/gdr_core/chunk_state_kernel.cuh"

// ---------------------------------------------------------------------------
// Host stand-ins for the tensor-core kernel's device helpers

// tf32_round, tf32_as_float, mma_m16n8k8_tf32: tests/ops/emulated_mma_tf32.h (above).

// cp_async_16, cp_async_4, cp_async_wait_all: tests/ops/emulated_cp_async.h.

// Dynamic shared memory: one block at a time.
constexpr int kTcSharedFloats = 227 * 1024 / 4;  // sm_90's opt-in limit per block
alignas(16) float g_tc_shared[kTcSharedFloats];
float* chunk_state_tc_shared() { return g_tc_shared; }

#define GDR_CHUNK_STATE_TC_HOST_HELPERS
#include "kernels/gdr_core/chunk_state_tc_kernel.cuh"
#undef GDR_CHUNK_STATE_TC_HOST_HELPERS
#undef __global__
#undef __device__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __align__

static_assert(gdr::kernels::chunk_state_tc_detail::TcLayout<256>::kFloats <= kTcSharedFloats,
              "the emulated dynamic shared memory must hold the largest layout");

namespace gdr::kernels {
namespace {

// As launch_chunk_state_scan: the tensor-core kernel where
// chunk_state_scan_uses_tensor_cores says so, else the SIMT kernel.
template <int DK>
void run_emulated(const ChunkStateScanArgs& args) {
  const int64_t blocks = args.batch_heads * (args.dv / kChunkStateTileDv);
  if (chunk_state_scan_uses_tensor_cores(args.dk, args.dv, args.allow_tensor_cores)) {
    test_support::run_grid(blocks, kChunkStateThreads, [&args](int64_t) {
      chunk_state_tc_detail::chunk_state_scan_tc_kernel<DK>(args);
    });
  } else {
    test_support::run_grid(blocks, kChunkStateThreads, [&args](int64_t) {
      chunk_state_detail::chunk_state_scan_kernel<DK>(args);
    });
  }
}

void run_emulated(const ChunkStateScanArgs& args) {
  switch (args.dk) {
    case 64: return run_emulated<64>(args);
    case 128: return run_emulated<128>(args);
    case 256: return run_emulated<256>(args);
    default: FAIL() << "unsupported dk " << args.dk;
  }
}

struct ScanCase {
  int dk, dv;
  bool reverse;
  bool quads = false;  // pitches and offsets that let the kernel take its float4 slab loads
  bool tc = false;     // the tensor-core kernel (else the SIMT kernel)
};

class ChunkStateKernelEmulation : public ::testing::TestWithParam<ScanCase> {};

TEST_P(ChunkStateKernelEmulation, MatchesThePlainRecurrenceInFp64) {
  const ScanCase c = GetParam();
  const int BH = 2, N = 3, C = kChunkStateChunk, dk = c.dk, dv = c.dv;
  // Row pitches wider than the rows, and `left` starting 2 floats in: the layouts of
  // narrow() views such as W inside the solve's [U | W] output (scalar slab loads). With
  // `quads`, pitches and the offset are multiples of 4 floats (float4 slab loads).
  const int pitch_k = dk + (c.quads ? 4 : 5), pitch_v = dv + 3, left_off = c.quads ? 4 : 2;
  std::mt19937 rng(dk * 31 + dv + (c.reverse ? 7 : 0));
  std::normal_distribution<float> normal;
  auto fill = [&](std::vector<float>& x, float scale) {
    for (float& e : x) e = scale * normal(rng);
  };
  std::vector<float> base(BH * N * C * pitch_v), left(BH * N * C * pitch_k + left_off),
      right(BH * N * C * pitch_k), extra(BH * N * dk * dv), g_last(BH * N), carry_in(BH * dk * dv),
      dot_with(BH * N * dk * dv);
  fill(base, 1.0f);
  fill(left, 0.05f);
  fill(right, 0.05f);
  fill(extra, 1.0f);
  fill(carry_in, 1.0f);
  fill(dot_with, 1.0f);
  for (float& d : g_last) d = -std::fabs(normal(rng));
  std::vector<float> rows(BH * N * C * dv, NAN), carries(BH * N * dk * dv, NAN),
      carry_final(BH * dk * dv, NAN), dot_out(BH * N * chunk_state_dot_partials(dv), NAN);

  // Forward configuration with an initial carry, no extra and no dot; backward
  // configuration with an extra term, a zero initial carry and the dGlast dot partials:
  // the two ways the op calls it.
  ChunkStateScanArgs args;
  args.batch_heads = BH;
  args.chunks = N;
  args.dk = dk;
  args.dv = dv;
  args.reverse = c.reverse;
  args.base = {base.data(), int64_t{N} * C * pitch_v, int64_t{C} * pitch_v, pitch_v};
  args.left = {left.data() + left_off, int64_t{N} * C * pitch_k, int64_t{C} * pitch_k, pitch_k};
  args.right = {right.data(), int64_t{N} * C * pitch_k, int64_t{C} * pitch_k, pitch_k};
  if (c.quads) {  // else the case would silently test the scalar path again
    ASSERT_EQ(reinterpret_cast<uintptr_t>(args.left.data) % 16, 0u);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(args.right.data) % 16, 0u);
  }
  args.left_sign = c.reverse ? 1.0f : -1.0f;
  args.right_sign = c.reverse ? -1.0f : 1.0f;
  args.extra = c.reverse ? extra.data() : nullptr;
  args.g_last = g_last.data();
  args.carry_in = c.reverse ? nullptr : carry_in.data();
  args.rows_out = rows.data();
  args.carries_out = carries.data();
  args.carry_final = carry_final.data();
  if (c.reverse) {
    args.dot_with = dot_with.data();
    args.dot_out = dot_out.data();
  }
  args.allow_tensor_cores = c.tc;
  g_mma_count = 0;
  run_emulated(args);
  if (c.tc) {
    EXPECT_GT(g_mma_count, 0) << "the tensor-core kernel did not run";
  } else {
    EXPECT_EQ(g_mma_count, 0) << "the SIMT kernel was asked for";
  }

  double max_err = 0.0;
  auto check = [&](double expected, float got) {
    max_err = std::max(max_err, std::isnan(got) ? INFINITY : std::fabs(expected - got));
  };
  for (int bh = 0; bh < BH; ++bh) {
    std::vector<double> X(dk * dv, 0.0);
    if (args.carry_in) {
      for (int e = 0; e < dk * dv; ++e) X[e] = carry_in[bh * dk * dv + e];
    }
    for (int step = 0; step < N; ++step) {
      const int n = c.reverse ? N - 1 - step : step;
      const int bhn = bh * N + n;
      const float* L = left.data() + left_off + (bh * N + n) * C * pitch_k;
      const float* Rt = right.data() + (bh * N + n) * C * pitch_k;
      const float* Bs = base.data() + (bh * N + n) * C * pitch_v;
      const double decay = std::exp(double{g_last[bhn]});
      for (int e = 0; e < dk * dv; ++e) check(X[e], carries[bhn * dk * dv + e]);
      if (args.dot_with) {
        double dot = 0.0, partials = 0.0;
        for (int e = 0; e < dk * dv; ++e) dot += double{dot_with[bhn * dk * dv + e]} * X[e];
        const int64_t per = chunk_state_dot_partials(dv);
        for (int64_t e = 0; e < per; ++e) partials += dot_out[bhn * per + e];
        // A sum of dk * dv O(1) products: compare relative to its magnitude.
        check(decay * dot / std::sqrt(static_cast<double>(dk) * dv),
              partials / std::sqrt(static_cast<double>(dk) * dv));
      }
      std::vector<double> R(C * dv);
      for (int r = 0; r < C; ++r) {
        for (int j = 0; j < dv; ++j) {
          double acc = 0.0;
          for (int k = 0; k < dk; ++k) acc += double{L[r * pitch_k + k]} * X[k * dv + j];
          R[r * dv + j] = Bs[r * pitch_v + j] + args.left_sign * acc;
          check(R[r * dv + j], rows[(bhn * C + r) * dv + j]);
        }
      }
      std::vector<double> next(dk * dv);
      for (int i = 0; i < dk; ++i) {
        for (int j = 0; j < dv; ++j) {
          double acc = 0.0;
          for (int r = 0; r < C; ++r) acc += double{Rt[r * pitch_k + i]} * R[r * dv + j];
          const double e = args.extra ? extra[bhn * dk * dv + i * dv + j] : 0.0;
          next[i * dv + j] = decay * X[i * dv + j] + e + args.right_sign * acc;
        }
      }
      X = next;
    }
    for (int e = 0; e < dk * dv; ++e) check(X[e], carry_final[bh * dk * dv + e]);
  }
  std::printf("max |error| %.3g\n", max_err);
  // FP32 sums of at most 256 terms of O(1) values against FP64.
  EXPECT_LT(max_err, 1e-4);
  if (c.tc) {
    // 3xTF32 (Note in kernels/gdr_core/chunk_state_tc_kernel.cuh): each product a b is
    // a_big b_big + a_big b_small + a_small b_big, off by the dropped a_small b_small and
    // the rounding of small, both <= 2^-22 |a b| (big and small each keep 11 significant
    // bits, RNA), plus FP32 accumulation: per sum of K terms
    // ~ (2^-21 + K 2^-24) sum |a b|, worst case ~1e-5 of the sums' magnitudes here (X,
    // R are O(1)-O(10)), typically far less (measured 3e-7 .. 9e-7 under emulation). Plain
    // TF32 (both small terms dropped) errs by ~2^-11 of the terms: measured 8e-4 .. 9e-4
    // on the dk = 128 cases, so the bound below tells them apart.
    EXPECT_LT(max_err, 1e-5) << "not FP32-level: is a 3xTF32 term missing?";
  }
}

std::vector<ScanCase> scan_cases() {
  const std::vector<ScanCase> shapes = {
      {64, 16, false},       {64, 48, true},        {128, 16, true},       {128, 32, false},
      {256, 16, false},      {256, 32, true},       {64, 16, true, true},  {128, 32, false, true},
      {256, 16, true, true}, {128, 48, true, true}, {128, 16, false, true}};
  std::vector<ScanCase> cases;
  for (const bool tc : {false, true}) {
    for (ScanCase c : shapes) {
      c.tc = tc;
      cases.push_back(c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Shapes, ChunkStateKernelEmulation, ::testing::ValuesIn(scan_cases()),
                         [](const ::testing::TestParamInfo<ScanCase>& info) {
                           return std::string(info.param.tc ? "tc_" : "simt_") + "dk" +
                                  std::to_string(info.param.dk) + "_dv" +
                                  std::to_string(info.param.dv) +
                                  (info.param.reverse ? "_reverse" : "_forward") +
                                  (info.param.quads ? "_quads" : "");
                         });

// ---------------------------------------------------------------------------
// The CUDA op's code with the emulated kernel

struct OpCase {
  int64_t B, H, N, dk, dv;
  bool initial_state, grad_final_state;
};

double relative_error(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kDouble);
  return (x.to(at::kDouble) - r).abs().max().item<double>() /
         (r.abs().max().item<double>() + 1e-30);
}

TEST(ChunkStateScanImplementation, WithTheEmulatedKernelsMatchesTheReferenceOp) {
  const char* names[] = {"o",   "final_state", "states", "v_new",   "du",       "dw",
                         "dqd", "dp",          "dkend",  "dg_last", "d_initial"};
  for (const bool tc : {false, true}) {
    for (const OpCase& c :
         {OpCase{1, 2, 3, 64, 32, true, true}, OpCase{2, 1, 2, 64, 16, false, false}}) {
      at::manual_seed(c.N);
      const int64_t C = kChunkStateChunk;
      const auto f64 = at::TensorOptions().dtype(at::kDouble);
      const double row = 0.5 / std::sqrt(static_cast<double>(c.dk));
      const at::Tensor u = at::randn({c.B, c.H, c.N, C, c.dv}, f64);
      const at::Tensor w = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
      const at::Tensor qd = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
      const at::Tensor p = at::randn({c.B, c.H, c.N, C, C}, f64).tril() * 0.1;
      const at::Tensor kend = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
      const at::Tensor g_last = -3.0 * at::rand({c.B, c.H, c.N}, f64);
      std::optional<at::Tensor> s0, grad_s;
      if (c.initial_state) s0 = at::randn({c.B, c.H, c.dk, c.dv}, f64);
      if (c.grad_final_state) grad_s = at::randn({c.B, c.H, c.dk, c.dv}, f64);
      const at::Tensor grad_o = at::randn({c.B, c.H, c.N, C, c.dv}, f64);

      const auto ref_f = chunk_state_pass(u, w, qd, p, kend, g_last, s0);
      const std::vector<at::Tensor> ref = test_support::state_pass_outputs(
          ref_f, chunk_state_pass_backward(grad_o, grad_s, w, qd, p, kend, g_last,
                                           std::get<2>(ref_f), std::get<3>(ref_f)));

      auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
      const test_support::Fp32CoreLayouts x32 = test_support::fp32_core_layouts(u, w, grad_o);
      std::optional<at::Tensor> s0_32, grad_s32;
      if (s0) s0_32 = f32(*s0);
      if (grad_s) grad_s32 = f32(*grad_s);
      const chunk_state_internal::ScanLauncher scan = [tc](const ChunkStateScanArgs& args) {
        ChunkStateScanArgs a = args;
        a.allow_tensor_cores = tc;
        run_emulated(a);
      };
      const auto got_f = chunk_state_internal::forward_via_scan(
          x32.u, x32.w, f32(qd), f32(p), f32(kend), f32(g_last), s0_32, scan);
      const std::vector<at::Tensor> got = test_support::state_pass_outputs(
          got_f, chunk_state_internal::backward_via_scan(
                     x32.grad_o, grad_s32, x32.w, f32(qd), f32(p), f32(kend), f32(g_last),
                     std::get<2>(got_f), std::get<3>(got_f), scan));
      for (size_t i = 0; i < got.size(); ++i) {
        ASSERT_EQ(got[i].sizes(), ref[i].sizes()) << names[i];
        EXPECT_EQ(got[i].scalar_type(), at::kFloat) << names[i];
        EXPECT_LE(relative_error(got[i], ref[i]), 1e-4)
            << (tc ? "tensor cores" : "SIMT") << " N=" << c.N << " " << names[i];
      }
    }
  }
}

}  // namespace
}  // namespace gdr::kernels
