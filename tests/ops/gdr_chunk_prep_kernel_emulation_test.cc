// The chunk prep kernels run on the CPU: kernels/gdr_chunk_prep_kernel.cuh is compiled as
// host code with stand-ins for the CUDA built-ins (one std::thread per CUDA thread, a
// barrier for __syncthreads, a per-block buffer for the dynamic shared memory, one block
// at a time), driven by the CUDA op's own code (chunk_prep_internal::forward_via_kernel /
// backward_via_kernel), and checked against the CPU reference op in FP64: both head dims
// the kernels support, dv != dk, T not a multiple of 64 (a padded tail chunk), FP32 and
// BF16 inputs, absent upstream gradients, inputs read in place as strided views (q, k, v
// slices of one wider projection; g, beta transposed). This proves the kernels' indexing, barriers
// and shared-memory carve-up and the op's layouts on machines without a GPU; speed, streams and the
// real hardware are the GPU test's business.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/gdr_chunk_prep.h"
#include "ops/gdr_chunk_prep.h"

// Host stand-ins for the CUDA built-ins the kernel bodies use (and nothing else; see the
// NOTE in the .cuh).
struct EmulatedIndex {
  unsigned x = 0, y = 0, z = 0;
};
thread_local EmulatedIndex threadIdx, blockIdx;
pthread_barrier_t g_block_barrier;
void __syncthreads() { pthread_barrier_wait(&g_block_barrier); }
float __uint_as_float(unsigned bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
unsigned __float_as_uint(float f) {
  unsigned bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

#define __device__
#define __forceinline__ inline
#include "kernels/gdr_chunk_prep_kernel.cuh"
#undef __device__
#undef __forceinline__

namespace gdr::kernels {
namespace {

using chunk_prep_detail::Bf16;

// Every block of the grid in turn, each with kChunkPrepThreads host threads and a fresh
// shared-memory buffer filled with NaN (so a read of a slot nobody wrote shows).
template <typename Args, typename Body>
void run_grid(const Args& args, int64_t smem_floats, const Body& body) {
  const int64_t blocks = args.shape.batch * args.shape.heads * args.shape.chunks;
  std::vector<float> smem(smem_floats);
  // The bodies read some shared rows as 16-byte vectors (ld.shared.v4 on the GPU, whose
  // dynamic shared memory is at least 16-byte aligned); the host buffer must match.
  ASSERT_EQ(reinterpret_cast<uintptr_t>(smem.data()) % 16, 0u);
  pthread_barrier_init(&g_block_barrier, nullptr, kChunkPrepThreads);
  for (int64_t b = 0; b < blocks; ++b) {
    std::fill(smem.begin(), smem.end(), NAN);
    std::vector<std::thread> threads;
    for (int t = 0; t < kChunkPrepThreads; ++t) {
      threads.emplace_back([&, b, t] {
        blockIdx.x = static_cast<unsigned>(b);
        threadIdx.x = static_cast<unsigned>(t);
        body(args, smem.data());
      });
    }
    for (std::thread& thread : threads) thread.join();
  }
  pthread_barrier_destroy(&g_block_barrier);
}

void emulate_forward(const ChunkPrepForwardArgs& args) {
  const int64_t floats = chunk_prep_forward_smem_floats(args.shape.dk, args.shape.dv);
  if (args.shape.input == ChunkPrepInput::kBFloat16) {
    run_grid(args, floats, chunk_prep_detail::chunk_prep_forward_block<Bf16>);
  } else {
    run_grid(args, floats, chunk_prep_detail::chunk_prep_forward_block<float>);
  }
}

template <int DK>
void emulate_backward_dk(const ChunkPrepBackwardArgs& args) {
  const int64_t floats = chunk_prep_backward_smem_floats(args.shape.dk, args.shape.dv);
  if (args.shape.input == ChunkPrepInput::kBFloat16) {
    run_grid(args, floats, chunk_prep_detail::chunk_prep_backward_block<Bf16, DK>);
  } else {
    run_grid(args, floats, chunk_prep_detail::chunk_prep_backward_block<float, DK>);
  }
}

void emulate_backward(const ChunkPrepBackwardArgs& args) {
  ASSERT_TRUE(chunk_prep_supports(args.shape.dk, args.shape.dv));
  if (args.shape.dk == 64) return emulate_backward_dk<64>(args);
  emulate_backward_dk<128>(args);
}

struct Case {
  int64_t B, T, H, dk, dv;
  at::ScalarType dtype;
  bool all_grads;        // false: only dU, dP and dGlast given
  bool strided = false;  // q, k, v slices of one [B, T, H, 2 dk + dv + 8]; g, beta transposed
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" + std::to_string(c.H) +
         "_dk" + std::to_string(c.dk) + "_dv" + std::to_string(c.dv) + "_" +
         (c.dtype == at::kBFloat16 ? "bf16" : "fp32") + (c.all_grads ? "" : "_some_grads") +
         (c.strided ? "_strided" : "");
}

// max |x - ref| / max |ref|.
double relative_error(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kDouble);
  return (x.to(at::kDouble) - r).abs().max().item<double>() /
         (r.abs().max().item<double>() + 1e-30);
}

class ChunkPrepKernelEmulation : public ::testing::TestWithParam<Case> {};

TEST_P(ChunkPrepKernelEmulation, MatchesTheFp64ReferenceOpForwardAndBackward) {
  const Case c = GetParam();
  at::manual_seed(c.T + c.dk + c.dv);
  at::Tensor q = at::randn({c.B, c.T, c.H, c.dk}), k = at::randn({c.B, c.T, c.H, c.dk});
  q = (q / q.norm(2, -1, true)).to(c.dtype);
  k = (k / k.norm(2, -1, true)).to(c.dtype);
  at::Tensor v = at::randn({c.B, c.T, c.H, c.dv}).to(c.dtype);
  at::Tensor g = -2.0 * at::rand({c.B, c.T, c.H});
  at::Tensor beta = at::sigmoid(at::randn({c.B, c.T, c.H}));
  if (c.strided) {
    // The same values as views the kernels must read in place: one wider row per token
    // and head holding q | k | v | 8 unused, and g, beta stored [T, B, H].
    at::Tensor wide = at::full({c.B, c.T, c.H, 2 * c.dk + c.dv + 8}, NAN, q.options());
    wide.narrow(-1, 0, c.dk).copy_(q);
    wide.narrow(-1, c.dk, c.dk).copy_(k);
    wide.narrow(-1, 2 * c.dk, c.dv).copy_(v);
    q = wide.narrow(-1, 0, c.dk);
    k = wide.narrow(-1, c.dk, c.dk);
    v = wide.narrow(-1, 2 * c.dk, c.dv);
    g = g.transpose(0, 1).contiguous().transpose(0, 1);
    beta = beta.transpose(0, 1).contiguous().transpose(0, 1);
    ASSERT_FALSE(q.is_contiguous() || v.is_contiguous() || (c.B > 1 && g.is_contiguous()));
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  const int64_t C = kChunkPrepChunk;

  // The reference sees the same (rounded) input values, in FP64.
  auto f64 = [](const at::Tensor& t) { return t.to(at::kDouble); };
  const auto ref = chunk_prep(f64(q), f64(k), f64(v), f64(g), f64(beta), scale, C);
  const auto got =
      chunk_prep_internal::forward_via_kernel(q, k, v, g, beta, scale, C, emulate_forward);
  const std::vector<at::Tensor> ref_out = {std::get<0>(ref), std::get<1>(ref), std::get<2>(ref),
                                           std::get<3>(ref), std::get<4>(ref), std::get<5>(ref)};
  const std::vector<at::Tensor> got_out = {std::get<0>(got), std::get<1>(got), std::get<2>(got),
                                           std::get<3>(got), std::get<4>(got), std::get<5>(got)};
  const char* out_names[] = {"u", "w", "qd", "p", "kend", "g_last"};
  for (size_t i = 0; i < ref_out.size(); ++i) {
    ASSERT_EQ(got_out[i].sizes(), ref_out[i].sizes()) << out_names[i];
    EXPECT_EQ(got_out[i].scalar_type(), at::kFloat) << out_names[i];
    // FP32 sums of at most 128 terms and a 64-row substitution against FP64.
    EXPECT_LE(relative_error(got_out[i], ref_out[i]), 2e-5) << describe(c) << " " << out_names[i];
  }

  std::vector<std::optional<at::Tensor>> grads(6);
  for (size_t i = 0; i < 6; ++i) {
    if (c.all_grads || i == 0 || i == 3 || i == 5) grads[i] = at::randn(ref_out[i].sizes());
  }
  auto grad64 = [&](size_t i) -> std::optional<at::Tensor> {
    return grads[i] ? std::optional<at::Tensor>(f64(*grads[i])) : std::nullopt;
  };
  const auto ref_b =
      chunk_prep_backward(grad64(0), grad64(1), grad64(2), grad64(3), grad64(4), grad64(5), f64(q),
                          f64(k), f64(v), f64(g), f64(beta), ref_out[0], ref_out[1], scale, C);
  // The upstream dU with a transposed layout, as autograd may hand it over.
  std::optional<at::Tensor> du = grads[0];
  du = du->transpose(0, 1).contiguous().transpose(0, 1);
  const auto got_b = chunk_prep_internal::backward_via_kernel(
      du, grads[1], grads[2], grads[3], grads[4], grads[5], q, k, v, g, beta, got_out[0],
      got_out[1], scale, C, emulate_backward);
  const std::vector<at::Tensor> rb = {std::get<0>(ref_b), std::get<1>(ref_b), std::get<2>(ref_b),
                                      std::get<3>(ref_b), std::get<4>(ref_b)};
  const std::vector<at::Tensor> gb = {std::get<0>(got_b), std::get<1>(got_b), std::get<2>(got_b),
                                      std::get<3>(got_b), std::get<4>(got_b)};
  const char* grad_names[] = {"dq", "dk", "dv", "dg", "dbeta"};
  const at::ScalarType grad_types[] = {c.dtype, c.dtype, c.dtype, at::kFloat, at::kFloat};
  for (size_t i = 0; i < rb.size(); ++i) {
    ASSERT_EQ(gb[i].sizes(), rb[i].sizes()) << grad_names[i];
    EXPECT_EQ(gb[i].scalar_type(), grad_types[i]) << grad_names[i];
    // BF16 gradients of q, k, v are rounded to 8 bits of mantissa on the way out.
    const double tol = grad_types[i] == at::kBFloat16 ? 8e-3 : 5e-5;
    EXPECT_LE(relative_error(gb[i], rb[i]), tol) << describe(c) << " " << grad_names[i];
  }
  if (c.dtype == at::kBFloat16) {
    // The same values as FP32 inputs run the same FP32 arithmetic; the kernel's own BF16
    // rounding of dq, dk, dv must then be bit for bit ATen's cast of the FP32 result.
    auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
    const auto fp32_b = chunk_prep_internal::backward_via_kernel(
        du, grads[1], grads[2], grads[3], grads[4], grads[5], f32(q), f32(k), f32(v), g, beta,
        got_out[0], got_out[1], scale, C, emulate_backward);
    const at::Tensor f[] = {std::get<0>(fp32_b), std::get<1>(fp32_b), std::get<2>(fp32_b)};
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::equal(f[i].to(at::kBFloat16), gb[i])) << describe(c) << " " << grad_names[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, ChunkPrepKernelEmulation,
                         ::testing::Values(Case{1, 100, 2, 64, 32, at::kFloat, true},
                                           Case{2, 64, 1, 64, 128, at::kFloat, false},
                                           Case{1, 70, 1, 128, 64, at::kFloat, true},
                                           Case{1, 130, 1, 128, 128, at::kBFloat16, true},
                                           Case{1, 30, 2, 64, 48, at::kBFloat16, false},
                                           Case{2, 70, 2, 64, 32, at::kFloat, true, true},
                                           Case{2, 130, 1, 128, 64, at::kBFloat16, true, true},
                                           // The model's head dims at the GPU test's T tails;
                                           // dv = 208 (dk 128) and 272 (dk 64), the largest
                                           // supported, take a second column per thread in
                                           // the triangular solves (dv + dk > 256 threads).
                                           Case{1, 200, 1, 128, 128, at::kFloat, true},
                                           Case{1, 2085, 1, 128, 128, at::kFloat, true},
                                           Case{1, 64, 2, 128, 128, at::kBFloat16, true},
                                           Case{2, 200, 1, 128, 128, at::kFloat, true, true},
                                           Case{2, 130, 1, 128, 128, at::kBFloat16, false, true},
                                           Case{1, 130, 1, 128, 208, at::kFloat, true},
                                           Case{1, 70, 1, 64, 272, at::kBFloat16, true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return describe(info.param);
                         });

TEST(ChunkPrepKernelEmulation, UnsupportedShapesAreRefusedNamingThem) {
  const at::Tensor q = at::randn({1, 10, 1, 32}), v = at::randn({1, 10, 1, 64});
  const at::Tensor g = at::zeros({1, 10, 1});
  try {
    chunk_prep_internal::forward_via_kernel(q, q, v, g, g, 1.0, 64, emulate_forward);
    FAIL() << "dk = 32 must be refused";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "chunk_prep: the CUDA implementation expects dk in {64, 128} and dv a multiple of "
              "16 within the shared-memory limit (dv <= 208 at dk = 128) but got dk = 32, dv = 64");
  }
}

}  // namespace
}  // namespace gdr::kernels
