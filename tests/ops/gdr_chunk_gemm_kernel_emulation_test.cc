// The chunk GEMM kernel run on the CPU: kernels/gdr_core/chunk_gemm_kernel.cuh is compiled as
// host code with stand-ins for the CUDA built-ins (one std::thread per CUDA thread, a
// barrier for __syncthreads, a NaN-filled buffer per block for the dynamic shared memory,
// one block at a time), its mma.sync, wgmma and cvt.rna.tf32 emulated (tests/ops/
// emulated_mma_tf32.h, emulated_wgmma_tf32.h: they read only the TF32 bits, so a missing
// split shows), both paths run (wgmma, which sm_90a code takes, and mma.sync) and
// required to agree bit for bit, and checked against an FP64 loop over the contract of
// kernels/gdr_core/chunk_gemm.h: every
// product of the chunk state pass at dk = dv = 64, dk = dv = 128 and dk = 256, dv = 128,
// i.e. both transposes the pass uses (A^T B, A B^T) and plain A B, one and two
// products, alpha = -1; then beta != 0, A^T B^T, N not a multiple of 64, K not a multiple
// of the 32-deep slab, operands whose pitches rule out the 16-byte copies and a C whose
// pitch rules out the 8-byte stores. Then the CUDA op's own code
// (chunk_state_internal::forward_via_scan / backward_via_scan) runs with the emulated GEMM
// (and the emulated FP32 SIMT scan) against the CPU reference op and against its at::bmm
// path. This proves the kernel's indexing, pipeline and barriers and the op's wiring on
// machines without a GPU; speed, streams and the real hardware are the GPU test's
// business.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "kernels/gdr_core/chunk_gemm.h"
#include "kernels/gdr_core/chunk_state.h"
#include "ops/gdr_core/chunk_state_op.h"

// Host stand-ins for the CUDA built-ins the kernels use (see the NOTEs in the .cuh files):
// threadIdx, blockIdx, __syncthreads and the per-warp barriers from
// tests/ops/emulated_cuda.h, the tensor-core primitives (cvt.rna.tf32, the warp-collective
// mma.sync m16n8k8, counted in g_mma_count) from tests/ops/emulated_mma_tf32.h.
#include "tests/ops/chunk_state_outputs.h"
#include "tests/ops/emulated_cp_async.h"
#include "tests/ops/emulated_cuda.h"
#include "tests/ops/emulated_mma_tf32.h"
#include "tests/ops/emulated_wgmma_tf32.h"

// cp_async_16, cp_async_4, cp_async_wait_all: tests/ops/emulated_cp_async.h.

// The SIMT scan kernel, for the op-level test (CUDA's float4: 16-byte aligned).
struct alignas(16) float4 {
  float x, y, z, w;
};

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define GDR_CHUNK_GEMM_HOST_HELPERS
#include "kernels/gdr_core/chunk_gemm_kernel.cuh"
#include "kernels/gdr_core/chunk_state_kernel.cuh"
#undef GDR_CHUNK_GEMM_HOST_HELPERS
#undef __global__
#undef __device__
#undef __forceinline__
#undef __shared__
#undef __launch_bounds__
#undef __align__

namespace gdr::kernels {
namespace {

// As launch_chunk_gemm: every block of the grid in turn, kChunkGemmThreads host threads
// each, on a shared-memory buffer refilled with NaN per block (a read of a slot nobody
// wrote for this block then shows in the result). `wgmma`: the sm_90a path (Note [Chunk
// GEMM on wgmma]), else the mma.sync path of the other targets.
void run_emulated_gemm(const ChunkGemmArgs& args, bool wgmma) {
  ASSERT_TRUE(chunk_gemm_supports(args));
  const int64_t blocks = chunk_gemm_blocks(args);
  std::vector<float> smem(chunk_gemm_detail::kSharedFloats + 4);
  float* const aligned = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(smem.data()) + 15) /
                                                  16 * 16);  // dynamic smem: 16 B
  g_shared_window = reinterpret_cast<const char*>(aligned);
  constexpr int kWarps = kChunkGemmThreads / 32;
  static_assert(kWarps <= kMaxWarps, "one emulated warp barrier per warp");
  pthread_barrier_init(&g_block_barrier, nullptr, kChunkGemmThreads);
  for (int w = 0; w < kWarps; ++w) pthread_barrier_init(&g_warp_barrier[w], nullptr, 32);
  for (int64_t b = 0; b < blocks; ++b) {
    std::fill(smem.begin(), smem.end(), NAN);
    std::vector<std::thread> threads;
    for (int t = 0; t < kChunkGemmThreads; ++t) {
      threads.emplace_back([&args, aligned, b, t, wgmma] {
        blockIdx.x = static_cast<unsigned>(b);
        threadIdx.x = static_cast<unsigned>(t);
        using namespace chunk_gemm_detail;
        auto run = [&](auto w) {
          constexpr bool W = decltype(w)::value;
          if (args.transpose_a) {
            args.transpose_b ? chunk_gemm_block<true, true, W>(args, aligned)
                             : chunk_gemm_block<true, false, W>(args, aligned);
          } else {
            args.transpose_b ? chunk_gemm_block<false, true, W>(args, aligned)
                             : chunk_gemm_block<false, false, W>(args, aligned);
          }
        };
        wgmma ? run(std::true_type{}) : run(std::false_type{});
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
  for (int w = 0; w < kWarps; ++w) pthread_barrier_destroy(&g_warp_barrier[w]);
  pthread_barrier_destroy(&g_block_barrier);
}

// ---------------------------------------------------------------------------
// The kernel against an FP64 loop

struct GemmCase {
  std::string name;
  int batch, m, n;
  bool ta, tb;
  int k0, k1;  // k1 = 0: one product
  float alpha = 1.0f, beta = 0.0f;
  bool odd_pitches = false;  // operand pitches / offsets that rule out 16-byte copies,
                             // and a C pitch that rules out 8-byte stores
};

// A batch of row-major matrices [batch][rows][cols] at a pitch (>= cols) and a batch
// stride, starting `offset` floats into its buffer.
struct Matrix {
  int rows = 0, cols = 0, pitch = 0, offset = 0;
  int64_t batch_stride = 0;
  std::vector<float> data;
  float at(int z, int r, int c) const { return data[offset + z * batch_stride + r * pitch + c]; }
  ChunkGemmOperand operand() const { return {data.data() + offset, batch_stride, pitch}; }
};

Matrix make_matrix(int batch, int rows, int cols, bool odd, std::mt19937& rng, float scale) {
  Matrix x;
  x.rows = rows;
  x.cols = cols;
  x.pitch = cols + (odd ? 3 : 4);  // odd: 4-byte copies only
  x.offset = odd ? 1 : 4;          // odd: a pointer 4 bytes past 16-byte alignment
  x.batch_stride = int64_t{rows} * x.pitch + (odd ? 1 : 8);
  x.data.assign(x.offset + batch * x.batch_stride, NAN);  // gaps NaN: must not be read
  std::normal_distribution<float> normal;
  for (int z = 0; z < batch; ++z) {
    for (int r = 0; r < rows; ++r) {
      for (int c = 0; c < cols; ++c)
        x.data[x.offset + z * x.batch_stride + r * x.pitch + c] = scale * normal(rng);
    }
  }
  return x;
}

void PrintTo(const GemmCase& c, std::ostream* os) { *os << c.name; }

class ChunkGemmKernelEmulation : public ::testing::TestWithParam<GemmCase> {};

TEST_P(ChunkGemmKernelEmulation, MatchesAnFp64LoopWithinThe3xTf32Bound) {
  const GemmCase c = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(std::hash<std::string>()(c.name)));
  const int products = c.k1 > 0 ? 2 : 1;
  const int ks[2] = {c.k0, c.k1};
  Matrix a[2], b[2];
  for (int p = 0; p < products; ++p) {
    // op(A) is m x k, op(B) k x n; stored transposed where asked. Entries ~ N(0, 1/k) and
    // N(0, 1), so every product is O(1).
    const float a_scale = 1.0f / std::sqrt(static_cast<float>(ks[p]));
    a[p] = c.ta ? make_matrix(c.batch, ks[p], c.m, c.odd_pitches, rng, a_scale)
                : make_matrix(c.batch, c.m, ks[p], c.odd_pitches, rng, a_scale);
    b[p] = c.tb ? make_matrix(c.batch, c.n, ks[p], c.odd_pitches, rng, 1.0f)
                : make_matrix(c.batch, ks[p], c.n, c.odd_pitches, rng, 1.0f);
  }
  Matrix out = make_matrix(c.batch, c.m, c.n, false, rng, 1.0f);
  if (c.odd_pitches) {  // C pitch odd: the scalar stores; pointer 4 bytes past alignment
    out.pitch = c.n + 1;
    out.offset = 1;
    out.batch_stride = int64_t{c.m} * out.pitch;
    out.data.assign(out.offset + c.batch * out.batch_stride, 0.0f);
    std::normal_distribution<float> normal;
    for (float& e : out.data) e = normal(rng);
  }
  const Matrix c_in = out;
  if (c.beta == 0.0f) {  // beta = 0 must not read C: make any read show
    for (float& e : out.data) e = NAN;
  }

  ChunkGemmArgs args;
  args.batch = c.batch;
  args.m = c.m;
  args.n = c.n;
  args.transpose_a = c.ta;
  args.transpose_b = c.tb;
  args.products = products;
  for (int p = 0; p < products; ++p) args.product[p] = {a[p].operand(), b[p].operand(), ks[p]};
  args.alpha = c.alpha;
  args.beta = c.beta;
  args.c = out.data.data() + out.offset;
  args.c_stride_batch = out.batch_stride;
  args.c_stride_row = out.pitch;
  // Both paths, each from the same C (every call writes C, and beta != 0 reads it).
  const std::vector<float> c_before = out.data;
  g_mma_count = 0;
  g_wgmma_count = 0;
  run_emulated_gemm(args, /*wgmma=*/false);
  // Warp 0 owns 2 x 4 mma tiles (fewer where its columns pass N) and issues 3 mmas per
  // tile and k-step of every product, in every block.
  EXPECT_GT(g_mma_count, 0) << "the mma.sync path did not run";
  EXPECT_EQ(g_wgmma_count, 0);
  const std::vector<float> out_mma = out.data;
  out.data = c_before;
  g_mma_count = 0;
  run_emulated_gemm(args, /*wgmma=*/true);
  // Three per k-step of every 32-deep slab (short slabs padded), in every block.
  const int slabs = (c.k0 + kChunkGemmSlabK - 1) / kChunkGemmSlabK +
                    (c.k1 + kChunkGemmSlabK - 1) / kChunkGemmSlabK;
  EXPECT_EQ(g_wgmma_count, chunk_gemm_blocks(args) * slabs * 4 * 3);
  EXPECT_EQ(g_mma_count, 0) << "the wgmma path ran mma.sync";
  // The emulated wgmma and mma.sync do the same arithmetic (tests/ops/
  // emulated_wgmma_tf32.h), so the two paths agree bit for bit exactly when they feed the
  // same operands to the same accumulator chains: the wgmma path's layout, descriptors,
  // padding and epilogue against the mma.sync path's.
  for (size_t e = 0; e < out.data.size(); ++e) {
    ASSERT_TRUE(std::memcmp(&out.data[e], &out_mma[e], 4) == 0 ||
                (std::isnan(out.data[e]) && std::isnan(out_mma[e])))
        << "the paths differ at offset " << static_cast<int64_t>(e) - out.offset << ": wgmma "
        << out.data[e] << ", mma.sync " << out_mma[e];
  }

  double max_err = 0.0, max_ref = 0.0, worst_ratio = 0.0;
  const int k_total = c.k0 + c.k1;
  for (int z = 0; z < c.batch; ++z) {
    for (int i = 0; i < c.m; ++i) {
      for (int j = 0; j < c.n; ++j) {
        double sum = 0.0, abs_sum = 0.0;
        for (int p = 0; p < products; ++p) {
          for (int k = 0; k < ks[p]; ++k) {
            const double x = c.ta ? a[p].at(z, k, i) : a[p].at(z, i, k);
            const double y = c.tb ? b[p].at(z, j, k) : b[p].at(z, k, j);
            sum += x * y;
            abs_sum += std::fabs(x * y);
          }
        }
        const double c0 = c.beta != 0.0f ? double{c_in.at(z, i, j)} : 0.0;
        const double ref = c.alpha * sum + c.beta * c0;
        const float got = out.at(z, i, j);
        const double err = std::isnan(got) ? INFINITY : std::fabs(got - ref);
        // The 3xTF32 bound (Note [3xTF32 products] in kernels/common/mma_tf32.cuh), first order:
        // each product a b is off by the dropped a_small b_small and the roundings of the
        // small parts, <= 3 * 2^-22 |a b| (big and small keep 11 significant bits each,
        // rounded to nearest); each of the three accumulator chains rounds once per mma
        // (the emulated mma sums its 8 products exactly, the hardware's within 2^-23),
        // <= K/8 roundings of at most sum |a b|, plus the two final adds; then alpha (a
        // power of two here) and the beta fmaf, one rounding of the result. 2^-23 per
        // rounding (twice the round-to-nearest unit) leaves room for the hardware's
        // truncating accumulation. Plain TF32 (a missing small term) errs by ~2^-11 of
        // the terms, far outside.
        const double bound =
            std::fabs(c.alpha) *
                (3.0 * std::ldexp(1.0, -22) + (k_total / 8.0 + 2.0) * std::ldexp(1.0, -23)) *
                abs_sum +
            std::ldexp(1.0, -23) * std::fabs(ref) + 1e-30;
        max_err = std::max(max_err, err);
        max_ref = std::max(max_ref, std::fabs(ref));
        worst_ratio = std::max(worst_ratio, err / bound);
      }
    }
  }
  std::printf("%s: max |error| %.3g, relative to max |ref| %.3g, worst error / bound %.3f\n",
              c.name.c_str(), max_err, max_err / max_ref, worst_ratio);
  EXPECT_LE(worst_ratio, 1.0) << "an element outside the 3xTF32 bound (or a NaN: a slot read "
                                 "before it was written, or C read with beta = 0)";
  // The same as one number: FP32-level (~1e-6 of the largest result), where plain TF32
  // measures ~1e-3.
  EXPECT_LT(max_err / max_ref, 1e-5);
  // Columns past N and the gaps between rows and batches are never written.
  for (size_t e = 0; e < out.data.size(); ++e) {
    const int64_t rel = static_cast<int64_t>(e) - out.offset;
    const bool inside = rel >= 0 && rel % out.batch_stride < int64_t{c.m} * out.pitch &&
                        rel % out.batch_stride % out.pitch < c.n &&
                        rel / out.batch_stride < c.batch;
    if (!inside) {
      ASSERT_TRUE(std::memcmp(&out.data[e], &c_in.data[e], 4) == 0 ||
                  (std::isnan(out.data[e]) && c.beta == 0.0f))
          << "wrote outside C at offset " << rel;
    }
  }
}

std::vector<GemmCase> gemm_cases() {
  std::vector<GemmCase> cases;
  // The chunk state pass's products (ops/gdr_core/chunk_state_op.cc), C = 64 rows per chunk, two
  // chunks in the batch.
  for (const auto& [dk, dv] : {std::pair{64, 64}, std::pair{128, 128}, std::pair{256, 128}}) {
    const std::string s = "_dk" + std::to_string(dk) + "_dv" + std::to_string(dv);
    cases.push_back({"o_QdS_plus_PV" + s, 2, 64, dv, false, false, dk, 64});
    cases.push_back({"PT_dO" + s, 2, 64, dv, true, false, 64, 0});
    cases.push_back({"QdT_dO" + s, 2, dk, dv, true, false, 64, 0});
    cases.push_back({"dW_minus_dV_ST" + s, 2, 64, dk, false, true, dv, 0, -1.0f});
    cases.push_back({"dQd_dO_ST_and_dKend_V_GT" + s, 2, 64, dk, false, true, dv, 0});
    cases.push_back({"dP_dO_VT" + s, 2, 64, 64, false, true, dv, 0});
  }
  // The rest of the contract: beta, A^T B^T, N % 64 = 16 and 48, K % 32 = 8, 16 and 24
  // (partial slabs, also in the second product), pitches that rule out the wide copies.
  cases.push_back({"beta_TT_n80_k48", 3, 64, 80, true, true, 48, 0, 0.5f, -2.0f});
  cases.push_back({"two_products_n48_k40_k24", 2, 64, 48, false, false, 40, 24, 2.0f});
  cases.push_back({"TN_m128_n16_k8_odd", 2, 128, 16, true, false, 8, 0, 1.0f, 0.0f, true});
  cases.push_back({"NT_n112_k56_odd_beta", 1, 64, 112, false, true, 56, 0, -1.0f, 1.0f, true});
  cases.push_back({"NN_two_products_odd", 1, 64, 64, false, false, 16, 72, 1.0f, 0.0f, true});
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Products, ChunkGemmKernelEmulation, ::testing::ValuesIn(gemm_cases()),
                         [](const ::testing::TestParamInfo<GemmCase>& info) {
                           return info.param.name;
                         });

TEST(ChunkGemmContract, SupportedShapes) {
  ChunkGemmArgs args;
  args.batch = 4;
  args.m = 64;
  args.n = 48;
  args.product[0].k = 24;
  EXPECT_TRUE(chunk_gemm_supports(args));
  EXPECT_EQ(chunk_gemm_blocks(args), 4);
  args.m = 96;  // M not a multiple of 64
  EXPECT_FALSE(chunk_gemm_supports(args));
  args.m = 128;
  args.n = 40;  // N not a multiple of 16
  EXPECT_FALSE(chunk_gemm_supports(args));
  args.n = 144;
  EXPECT_EQ(chunk_gemm_blocks(args), 4 * 2 * 3);
  args.product[0].k = 12;  // K not a multiple of 8
  EXPECT_FALSE(chunk_gemm_supports(args));
  args.product[0].k = 64;
  args.products = 2;  // the second product's k is still 0
  EXPECT_FALSE(chunk_gemm_supports(args));
  args.product[1].k = 64;
  EXPECT_TRUE(chunk_gemm_supports(args));
  args.products = 3;
  EXPECT_FALSE(chunk_gemm_supports(args));
  args.products = 1;
  args.batch = int64_t{1} << 30;  // 2^30 * 2 * 3 blocks: over one 1-D grid
  EXPECT_FALSE(chunk_gemm_supports(args));
}

// ---------------------------------------------------------------------------
// The CUDA op's code with the emulated GEMM (and the emulated SIMT scan)

void run_emulated_scan(const ChunkStateScanArgs& args) {
  const int64_t blocks = args.batch_heads * (args.dv / kChunkStateTileDv);
  switch (args.dk) {
    case 64:
      test_support::run_grid(blocks, kChunkStateThreads, [&args](int64_t) {
        chunk_state_detail::chunk_state_scan_kernel<64>(args);
      });
      break;
    case 128:
      test_support::run_grid(blocks, kChunkStateThreads, [&args](int64_t) {
        chunk_state_detail::chunk_state_scan_kernel<128>(args);
      });
      break;
    default: FAIL() << "dk " << args.dk << " is not emulated here";
  }
}

double relative_error(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kDouble);
  return (x.to(at::kDouble) - r).abs().max().item<double>() /
         (r.abs().max().item<double>() + 1e-30);
}

// A SideStream (Note [State pass side stream] in ops/gdr_core/chunk_state_op.h) that acts like a
// stream that has not run yet: the GEMMs `work` launches are recorded and their outputs
// filled with NaN at run(), and computed only at join(). A backward that read dQd or dP
// before the join, or returned without one, would hand back NaN.
class DeferringSideStream final : public chunk_state_internal::SideStream {
 public:
  void fork() override { events += "fork "; }
  void run(const std::function<void()>& work) override {
    events += "run ";
    deferring = true;
    work();
    deferring = false;
  }
  void join() override {
    events += "join";
    for (const ChunkGemmArgs& args : deferred) run_emulated_gemm(args, /*wgmma=*/true);
    deferred.clear();
  }
  // Called by the test's GEMM launcher: true when the GEMM was deferred.
  bool defer(const ChunkGemmArgs& args) {
    if (!deferring) return false;
    for (int64_t z = 0; z < args.batch; ++z) {
      for (int r = 0; r < args.m; ++r) {
        for (int c = 0; c < args.n; ++c) {
          args.c[z * args.c_stride_batch + r * args.c_stride_row + c] =
              std::numeric_limits<float>::quiet_NaN();
        }
      }
    }
    deferred.push_back(args);
    return true;
  }
  std::string events;

 private:
  bool deferring = false;
  std::vector<ChunkGemmArgs> deferred;
};

TEST(ChunkStateScanImplementation, WithTheEmulatedGemmMatchesTheReferenceOpAndTheBmmPath) {
  const char* names[] = {"o",   "final_state", "states", "v_new",   "du",       "dw",
                         "dqd", "dp",          "dkend",  "dg_last", "d_initial"};
  struct OpCase {
    int64_t B, H, N, dk, dv;
  };
  for (const OpCase& c : {OpCase{1, 2, 2, 64, 48}, OpCase{2, 1, 1, 128, 16}}) {
    at::manual_seed(c.N + c.dk);
    const int64_t C = kChunkStateChunk;
    const auto f64 = at::TensorOptions().dtype(at::kDouble);
    const double row = 0.5 / std::sqrt(static_cast<double>(c.dk));
    const at::Tensor u = at::randn({c.B, c.H, c.N, C, c.dv}, f64);
    const at::Tensor w = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
    const at::Tensor qd = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
    const at::Tensor p = at::randn({c.B, c.H, c.N, C, C}, f64).tril() * 0.1;
    const at::Tensor kend = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
    const at::Tensor g_last = -3.0 * at::rand({c.B, c.H, c.N}, f64);
    const at::Tensor s0 = at::randn({c.B, c.H, c.dk, c.dv}, f64);
    const at::Tensor grad_s = at::randn({c.B, c.H, c.dk, c.dv}, f64);
    const at::Tensor grad_o = at::randn({c.B, c.H, c.N, C, c.dv}, f64);

    const auto ref_f = chunk_state_pass(u, w, qd, p, kend, g_last, s0);
    const std::vector<at::Tensor> ref = test_support::state_pass_outputs(
        ref_f, chunk_state_pass_backward(grad_o, grad_s, w, qd, p, kend, g_last, std::get<2>(ref_f),
                                         std::get<3>(ref_f)));

    auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
    const test_support::Fp32CoreLayouts x32 = test_support::fp32_core_layouts(u, w, grad_o);
    const chunk_state_internal::ScanLauncher scan = run_emulated_scan;
    int gemm_calls = 0, deferred_calls = 0;
    DeferringSideStream side;
    const chunk_state_internal::ChunkGemmLauncher gemm = [&](const ChunkGemmArgs& a) {
      ++gemm_calls;
      if (side.defer(a)) {
        ++deferred_calls;
      } else {
        run_emulated_gemm(a, /*wgmma=*/true);
      }
    };
    // [0]: at::bmm, [1]: the emulated GEMM, [2]: the emulated GEMM with dQd and dP through
    // the deferring side stream.
    std::vector<at::Tensor> got[3];
    const int64_t side_runs_before = chunk_state_internal::backward_side_stream_runs();
    for (const int arm : {0, 1, 2}) {
      const chunk_state_internal::ChunkGemmLauncher& launcher =
          arm > 0 ? gemm : chunk_state_internal::ChunkGemmLauncher();
      const auto got_f = chunk_state_internal::forward_via_scan(
          x32.u, x32.w, f32(qd), f32(p), f32(kend), f32(g_last), f32(s0), scan, launcher);
      got[arm] = test_support::state_pass_outputs(
          got_f,
          chunk_state_internal::backward_via_scan(
              x32.grad_o, f32(grad_s), x32.w, f32(qd), f32(p), f32(kend), f32(g_last),
              std::get<2>(got_f), std::get<3>(got_f), scan, launcher, arm == 2 ? &side : nullptr));
    }
    // One forward GEMM (O) and six backward ones (P^T dO, Qd^T dO, dW, dQd, dP, dKend) per
    // GEMM arm; dQd and dP of the third went through the side stream, forked once, run
    // once and joined once.
    EXPECT_EQ(gemm_calls, 14);
    EXPECT_EQ(deferred_calls, 2);
    EXPECT_EQ(side.events, "fork run join");
    EXPECT_EQ(chunk_state_internal::backward_side_stream_runs() - side_runs_before, 1);
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_TRUE(at::equal(got[2][i], got[1][i]))
          << names[i] << ": the side stream must not change the bits";
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      for (const bool use_gemm : {false, true}) {
        const at::Tensor& x = got[use_gemm][i];
        const at::Tensor& y = got[false][i];
        ASSERT_EQ(x.sizes(), ref[i].sizes()) << names[i];
        EXPECT_EQ(x.scalar_type(), at::kFloat) << names[i];
        EXPECT_EQ(x.strides(), y.strides()) << names[i] << ": the layout must not change";
        EXPECT_TRUE(x.is_contiguous()) << names[i];
        const double err = relative_error(x, ref[i]);
        std::printf("dk %lld dv %lld %s %s: %.2e vs FP64\n", static_cast<long long>(c.dk),
                    static_cast<long long>(c.dv), use_gemm ? "gemm" : "bmm ", names[i], err);
        // FP32-level against FP64, as the scan's own emulation test.
        EXPECT_LE(err, 1e-4) << (use_gemm ? "emulated GEMM " : "at::bmm ") << names[i];
      }
      EXPECT_LE(relative_error(got[true][i], got[false][i]), 1e-4) << names[i];
    }
  }
}

}  // namespace
}  // namespace gdr::kernels
