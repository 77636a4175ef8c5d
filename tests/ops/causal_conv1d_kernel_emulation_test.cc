// The causal conv1d + SiLU kernel bodies run on the CPU:
// kernels/causal_conv1d/causal_conv1d_kernel.cuh is compiled as host code with stand-ins for the
// CUDA built-ins (one std::thread per CUDA thread, a barrier for __syncthreads, one block at a
// time) and checked against a plain loop written from the spec in
// kernels/causal_conv1d/causal_conv1d.h: y and dx bit for bit (the loop sums the taps in the
// documented order and rounds where the spec rounds) in FP32, BF16 and FP16, K = 2, 3, 4, sequence
// tails, T < K and tiles shorter than K - 1 tokens, several programs and channel blocks, strided
// inputs, the vectorised and the scalar channel paths (which must give the same bits). The weight
// gradient's partial rows and the ordered second pass are checked bit for bit against a replay of
// the documented summation order (Note [Causal conv determinism]), and against an FP64 sum within
// FP32 accumulation error. Speed and the real hardware are the GPU test's business.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <math.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>
#include <vector>

#include "kernels/causal_conv1d/causal_conv1d.h"

// Host stand-ins for the CUDA built-ins the kernel bodies use (see the NOTE in the .cuh).
#include "tests/ops/emulated_cuda.h"

#define __device__
#define __forceinline__ inline
#include "kernels/causal_conv1d/causal_conv1d_kernel.cuh"
#undef __device__
#undef __forceinline__

#include "tests/ops/emulated_storage_element.h"

namespace gdr::kernels {

namespace {

using causal_conv_detail::combine_floats;

// Runs `body` over a grid_x x grid_y grid of blocks of threads_x x threads_y host threads,
// one block at a time.
template <typename Body>
void run_grid(int64_t grid_x, int64_t grid_y, int threads_x, int threads_y, const Body& body) {
  const int threads = threads_x * threads_y;
  pthread_barrier_init(&g_block_barrier, nullptr, threads);
  for (int64_t by = 0; by < grid_y; ++by) {
    for (int64_t bx = 0; bx < grid_x; ++bx) {
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&body, bx, by, t, threads_x] {
          blockIdx.x = static_cast<unsigned>(bx);
          blockIdx.y = static_cast<unsigned>(by);
          threadIdx.x = static_cast<unsigned>(t % threads_x);
          threadIdx.y = static_cast<unsigned>(t / threads_x);
          body();
        });
      }
      for (std::thread& thread : pool) thread.join();
    }
  }
  pthread_barrier_destroy(&g_block_barrier);
}

struct Case {
  at::ScalarType dtype;
  int64_t B, T, C;
  int K;
  bool strided;
  int64_t tile_tokens;  // backward tile; 0: the launch rule's
};

std::string name_of(const Case& c) {
  return std::string(c10::toString(c.dtype)) + "_B" + std::to_string(c.B) + "_T" +
         std::to_string(c.T) + "_C" + std::to_string(c.C) + "_K" + std::to_string(c.K) +
         (c.strided ? "_strided" : "") +
         (c.tile_tokens ? "_tile" + std::to_string(c.tile_tokens) : "");
}

// [B, T, C] with unit channel stride: contiguous, or the batch-transposed view of a wider
// [T, B, C + 8] buffer narrowed to C (token stride B * (C + 8), batch stride C + 8).
at::Tensor make_operand(const Case& c, double scale) {
  if (!c.strided) return (at::randn({c.B, c.T, c.C}) * scale).to(c.dtype);
  const at::Tensor wide = (at::randn({c.T, c.B, c.C + 8}) * scale).to(c.dtype);
  return wide.transpose(0, 1).narrow(2, 0, c.C);
}

TokenOperand operand_of(const at::Tensor& t) {
  TokenOperand op;
  op.data = t.data_ptr();
  op.batch_stride = t.stride(0);
  op.token_stride = t.stride(1);
  return op;
}

std::vector<float> floats_of(const at::Tensor& t) {
  const at::Tensor f = t.to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + f.numel());
}

// The storage rounding of the spec's round(): FP32 -> dtype -> FP32.
float round_to_dtype(float v, at::ScalarType dtype) {
  if (dtype == at::kBFloat16) return static_cast<float>(c10::BFloat16(v));
  if (dtype == at::kHalf) return static_cast<float>(c10::Half(v));
  return v;
}

// Independent check written from the spec (kernels/causal_conv1d/causal_conv1d.h), not the kernel's
// code: plain loops over (b, t, c), taps in j order with the first product then fmaf,
// rounding where the spec rounds. dw in FP64 in (b, t) order, with the sum of |terms|.
struct Reference {
  std::vector<float> y, dpre, dx;
  std::vector<double> dw, dw_abs;
};

Reference spec_loop(const std::vector<float>& x, const std::vector<float>& dy,
                    const std::vector<float>& w, const Case& c) {
  const int64_t B = c.B, T = c.T, C = c.C;
  const int K = c.K;
  auto X = [&](int64_t b, int64_t s, int64_t ch) { return s < 0 ? 0.0f : x[(b * T + s) * C + ch]; };
  Reference r;
  r.y.resize(B * T * C);
  r.dpre.resize(B * T * C);
  r.dx.resize(B * T * C);
  r.dw.assign(C * K, 0.0);
  r.dw_abs.assign(C * K, 0.0);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t ch = 0; ch < C; ++ch) {
        float acc = w[ch * K] * X(b, t - K + 1, ch);
        for (int j = 1; j < K; ++j) acc = fmaf(w[ch * K + j], X(b, t + j - K + 1, ch), acc);
        const float pre = round_to_dtype(acc, c.dtype);
        const int64_t e = (b * T + t) * C + ch;
        r.y[e] = round_to_dtype(pre / (1.0f + expf(-pre)), c.dtype);
        const float sig = 1.0f / (1.0f + expf(-pre));
        r.dpre[e] = round_to_dtype(dy[e] * sig * (1.0f + pre * (1.0f - sig)), c.dtype);
      }
    }
  }
  auto DPRE = [&](int64_t b, int64_t s, int64_t ch) {
    return s >= T ? 0.0f : r.dpre[(b * T + s) * C + ch];
  };
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t ch = 0; ch < C; ++ch) {
        float acc = w[ch * K] * DPRE(b, t + K - 1, ch);
        for (int j = 1; j < K; ++j) acc = fmaf(w[ch * K + j], DPRE(b, t + K - 1 - j, ch), acc);
        r.dx[(b * T + t) * C + ch] = round_to_dtype(acc, c.dtype);
        for (int j = 0; j < K; ++j) {
          const double term =
              static_cast<double>(DPRE(b, t, ch)) * static_cast<double>(X(b, t + j - K + 1, ch));
          r.dw[ch * K + j] += term;
          r.dw_abs[ch * K + j] += std::fabs(term);
        }
      }
    }
  }
  return r;
}

struct KernelOutputs {
  at::Tensor y, dx, partials, dw;
};

// Runs the three kernel bodies as the launchers would (grid from the launch rules).
template <typename T, int FV, int BV, int K>
KernelOutputs run_kernels(const Case& c, const at::Tensor& x, const at::Tensor& dy,
                          const at::Tensor& w, const CausalConvBackwardLaunch& launch) {
  CausalConvShape shape;
  shape.batch = c.B;
  shape.seq = c.T;
  shape.channels = c.C;
  shape.taps = K;
  KernelOutputs out;
  const auto opts = at::TensorOptions().dtype(c.dtype);
  out.y = at::full({c.B, c.T, c.C}, NAN, opts);
  out.dx = at::full({c.B, c.T, c.C}, NAN, opts);
  out.partials = at::full({std::max<int64_t>(launch.scratch_floats, 1)}, NAN);
  out.dw = at::full({c.C, 1, K}, NAN, opts);

  CausalConvForwardArgs fa;
  fa.shape = shape;
  fa.x = operand_of(x);
  fa.weight = w.data_ptr();
  fa.y = out.y.data_ptr();
  const int64_t fwd_tiles =
      c.B * ((c.T + kCausalConvForwardTileTokens - 1) / kCausalConvForwardTileTokens);
  auto blocks = [](int64_t n, int64_t per) { return (n + per - 1) / per; };
  run_grid(blocks(fwd_tiles, kCausalConvTileRows),
           blocks(blocks(c.C, FV), kCausalConvChannelThreads), kCausalConvChannelThreads,
           kCausalConvTileRows, [&] { causal_conv_detail::forward_tile<T, FV, K>(fa); });

  CausalConvBackwardArgs ba;
  ba.shape = shape;
  ba.grad_y = operand_of(dy);
  ba.x = operand_of(x);
  ba.weight = w.data_ptr();
  ba.dx = out.dx.data_ptr();
  ba.partials = out.partials.data_ptr<float>();
  std::vector<float> combine(combine_floats<BV, K>());
  const int64_t channel_blocks = blocks(blocks(c.C, BV), kCausalConvChannelThreads);
  run_grid(launch.programs, channel_blocks, kCausalConvChannelThreads, kCausalConvTileRows, [&] {
    causal_conv_detail::backward_tile<T, BV, K>(ba, launch.tile_tokens, launch.tiles_per_seq,
                                                combine.data());
  });
  std::vector<float> slice_sums(kCausalConvReduceSlices * kCausalConvReduceCols);
  run_grid(blocks(c.C * K, kCausalConvReduceCols), 1,
           kCausalConvReduceCols * kCausalConvReduceSlices, 1, [&] {
             causal_conv_detail::reduce_partials_block<T>(ba.partials, launch.programs, c.C * K,
                                                          static_cast<T*>(out.dw.data_ptr()),
                                                          slice_sums.data());
           });
  return out;
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && a.scalar_type() == b.scalar_type() &&
         at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

template <typename T, int FV, int BV, int K>
void run_case(const Case& c) {
  at::manual_seed(c.B * 1000 + c.T * 10 + c.C + K);
  const at::Tensor x = make_operand(c, 1.5);
  const at::Tensor dy = make_operand(c, 1.0);
  const at::Tensor w = (at::randn({c.C, 1, K}) * 0.5).to(c.dtype);
  CausalConvShape shape{c.B, c.T, c.C, K};
  CausalConvBackwardLaunch launch = derive_causal_conv_backward_launch(shape);
  if (c.tile_tokens > 0) {
    launch.tile_tokens = c.tile_tokens;
    launch.tiles_per_seq = (c.T + c.tile_tokens - 1) / c.tile_tokens;
    launch.programs = (c.B * launch.tiles_per_seq + kCausalConvTileRows - 1) / kCausalConvTileRows;
    launch.scratch_floats = launch.programs * c.C * K;
  }
  const KernelOutputs out = run_kernels<T, FV, BV, K>(c, x, dy, w, launch);

  // y and dx: bit for bit the spec loop.
  const Reference ref = spec_loop(floats_of(x), floats_of(dy), floats_of(w), c);
  const std::vector<float> y = floats_of(out.y), dx = floats_of(out.dx);
  for (size_t e = 0; e < ref.y.size(); ++e) {
    ASSERT_EQ(y[e], ref.y[e]) << "y element " << e;
    ASSERT_EQ(dx[e], ref.dx[e]) << "dx element " << e;
  }

  // The documented order, replayed from the spec loop's dpre (same bits as the kernel's, as
  // y and dx prove): per tile the tokens in order, the program's tile rows in order, then
  // the second pass's slices.
  const std::vector<float> xf = floats_of(x);
  auto X = [&](int64_t b, int64_t s, int64_t ch) {
    return s < 0 ? 0.0f : xf[(b * c.T + s) * c.C + ch];
  };
  const std::vector<float> partials = floats_of(out.partials);
  const int64_t tiles = c.B * launch.tiles_per_seq;
  const int64_t row = c.C * K;
  std::vector<float> expected(launch.programs * row);
  for (int64_t p = 0; p < launch.programs; ++p) {
    for (int64_t ch = 0; ch < c.C; ++ch) {
      for (int j = 0; j < K; ++j) {
        float total = 0.0f;
        for (int r = 0; r < kCausalConvTileRows; ++r) {
          const int64_t g = p * kCausalConvTileRows + r;
          float sum = 0.0f;
          if (g < tiles) {
            const int64_t b = g / launch.tiles_per_seq;
            const int64_t begin = (g % launch.tiles_per_seq) * launch.tile_tokens;
            const int64_t end = std::min(begin + launch.tile_tokens, c.T);
            for (int64_t t = begin; t < end; ++t) {
              sum = fmaf(ref.dpre[(b * c.T + t) * c.C + ch], X(b, t + j - K + 1, ch), sum);
            }
          }
          total = r == 0 ? sum : total + sum;
        }
        expected[p * row + ch * K + j] = total;
        ASSERT_EQ(partials[p * row + ch * K + j], total)
            << "partial row " << p << " channel " << ch << " tap " << j;
      }
    }
  }
  const std::vector<float> dw = floats_of(out.dw);
  for (int64_t q = 0; q < row; ++q) {
    float total = 0.0f;
    for (int s = 0; s < kCausalConvReduceSlices; ++s) {
      float slice = 0.0f;
      for (int64_t p = s; p < launch.programs; p += kCausalConvReduceSlices) {
        slice += expected[p * row + q];
      }
      total = s == 0 ? slice : total + slice;
    }
    ASSERT_EQ(dw[q], round_to_dtype(total, c.dtype)) << "dw slot " << q;
    // And the FP64 sum: FP32 accumulation error, plus one rounding to a 16-bit dtype.
    const double rounding =
        c.dtype == at::kFloat ? 0.0 : std::ldexp(1.0, -8) * std::fabs(ref.dw[q]);
    EXPECT_LE(std::fabs(dw[q] - ref.dw[q]), rounding + 1e-5 * ref.dw_abs[q] + 1e-30)
        << "dw slot " << q << " vs FP64";
  }

  // The scalar channel path gives the same bits as the vectorised one.
  if (FV > 1 || BV > 1) {
    const KernelOutputs scalar = run_kernels<T, 1, 1, K>(c, x, dy, w, launch);
    EXPECT_TRUE(same_bits(scalar.y, out.y)) << "y, scalar path";
    EXPECT_TRUE(same_bits(scalar.dx, out.dx)) << "dx, scalar path";
    EXPECT_TRUE(same_bits(scalar.partials, out.partials)) << "partials, scalar path";
    EXPECT_TRUE(same_bits(scalar.dw, out.dw)) << "dw, scalar path";
  }
}

// The channels per thread the launchers pick when the layout allows
// (kernels/causal_conv1d/causal_conv1d.cu: 16-byte forward loads, 2 channels in the backward),
// else 1.
template <typename T, int K>
void run_with_k(const Case& c) {
  constexpr int kForwardVec = static_cast<int>(16 / sizeof(T));
  const bool forward_vec = c.C % kForwardVec == 0;
  const bool backward_vec = c.C % 2 == 0;
  if (forward_vec && backward_vec) {
    run_case<T, kForwardVec, 2, K>(c);
  } else if (backward_vec) {
    run_case<T, 1, 2, K>(c);
  } else {
    run_case<T, 1, 1, K>(c);
  }
}

template <typename T>
void run_typed(const Case& c) {
  switch (c.K) {
    case 2: return run_with_k<T, 2>(c);
    case 3: return run_with_k<T, 3>(c);
    case 4: return run_with_k<T, 4>(c);
    default: FAIL() << "unsupported K " << c.K;
  }
}

class CausalConvKernelEmulation : public ::testing::TestWithParam<Case> {};

TEST_P(CausalConvKernelEmulation, MatchesTheSpecBitForBitAndTheDocumentedSummationOrder) {
  const Case c = GetParam();
  switch (c.dtype) {
    case at::kFloat: return run_typed<float>(c);
    case at::kBFloat16: return run_typed<c10::BFloat16>(c);
    case at::kHalf: return run_typed<c10::Half>(c);
    default: FAIL() << "unsupported dtype";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CausalConvKernelEmulation,
    ::testing::Values(
        // The launch rule's tiles (32 backward tokens, 16 forward); tails of both.
        Case{at::kFloat, 2, 37, 24, 4, false, 0}, Case{at::kBFloat16, 2, 64, 64, 4, false, 0},
        Case{at::kFloat, 2, 300, 8, 4, false, 0},
        // Several programs (short tiles), several channel blocks, K = 2 and 3.
        Case{at::kFloat, 3, 100, 40, 3, false, 8}, Case{at::kFloat, 2, 45, 100, 4, false, 4},
        Case{at::kHalf, 2, 50, 24, 2, true, 0}, Case{at::kBFloat16, 2, 77, 48, 4, true, 16},
        Case{at::kBFloat16, 1, 40, 136, 3, false, 5},
        // T < K, and tiles shorter than K - 1 tokens (the guarded walk).
        Case{at::kBFloat16, 1, 3, 16, 4, false, 0}, Case{at::kBFloat16, 2, 2, 16, 4, false, 0},
        Case{at::kFloat, 1, 1, 5, 3, false, 0}, Case{at::kFloat, 3, 11, 6, 4, true, 2},
        Case{at::kHalf, 2, 9, 7, 4, false, 1}),
    [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

TEST(CausalConvKernelEmulationReduce, NoProgramsGiveZeros) {
  std::vector<float> slice_sums(kCausalConvReduceSlices * kCausalConvReduceCols);
  std::vector<float> dw(40, NAN);
  run_grid(2, 1, kCausalConvReduceCols * kCausalConvReduceSlices, 1, [&] {
    causal_conv_detail::reduce_partials_block<float>(nullptr, 0, 40, dw.data(), slice_sums.data());
  });
  for (float v : dw) EXPECT_EQ(v, 0.0f);
}

}  // namespace
}  // namespace gdr::kernels
