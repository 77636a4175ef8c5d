// The cross-entropy kernel bodies run on the CPU: kernels/cross_entropy/cross_entropy_kernel.cuh is
// compiled as host code with stand-ins for the CUDA built-ins (one std::thread per CUDA
// thread, a barrier for __syncthreads, a per-warp exchange slot and barrier for
// __shfl_xor_sync, one block at a time) and checked against a plain FP64 loop written
// from the formula (marked below): FP32 and BF16 logits, V = 1, 7, 1000 and 4099 (tails
// of the pack and of the block), contiguous rows (vectorised body where the pack divides
// the row stride) and strided rows (transposed batch / token dims of a wider buffer;
// vectorised loads with a scalar tail when the wider stride is a multiple of the pack),
// ignored rows, an out-of-range target (NaN, no read outside the row) and zero-filled
// gradient rows. The row logsumexp and the mean are also checked bit for bit against the
// documented reduction order (Note [Cross-entropy determinism]) replayed sequentially.
// Speed and the real hardware are the GPU test's business.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <math.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cross_entropy/cross_entropy.h"

// Host stand-ins for the CUDA built-ins the kernel bodies use (see the NOTE in the .cuh);
// exp2f, logf, fmaf, fmaxf, INFINITY and NAN come from <math.h>.
#include "tests/ops/emulated_cuda.h"

#define __device__
#define __forceinline__ inline
#include "kernels/cross_entropy/cross_entropy_kernel.cuh"
#undef __device__
#undef __forceinline__

#include "tests/ops/emulated_storage_element.h"

namespace gdr::kernels {

namespace {

using cross_entropy_detail::combine;
using cross_entropy_detail::fold_pack;
using cross_entropy_detail::OnlineLse;

constexpr int64_t kIgnore = -100;

using test_support::run_grid;

struct Case {
  bool bf16;
  int64_t B, T, V;
  bool strided;     // logits a transposed view of a [T, B, V + pad] buffer
  bool vectorised;  // run the 16-byte body (rows must be aligned: the launcher's rule)
};

std::string name_of(const Case& c) {
  return std::string(c.bf16 ? "bf16_" : "fp32_") + std::to_string(c.B) + "x" + std::to_string(c.T) +
         "x" + std::to_string(c.V) + (c.strided ? "_strided" : "") +
         (c.vectorised ? "_vec" : "_scalar");
}

// The documented order of one row, replayed sequentially from the kernel's own helpers:
// thread i folds packs i, i + threads, ... then its tail elements; lanes combine by the
// xor butterfly (masks 16, 8, 4, 2, 1); thread 0 folds the warps in order.
template <typename T, int VEC>
float documented_lse(const T* x, int64_t vocab, int threads) {
  const int64_t packs = vocab / VEC;
  std::vector<OnlineLse> acc(threads, OnlineLse{-INFINITY, 0.0f});
  for (int i = 0; i < threads; ++i) {
    for (int64_t q = i; q < packs; q += threads) {
      float v[VEC];
      for (int k = 0; k < VEC; ++k) {
        v[k] = StorageElement<T>::to_float(x[q * VEC + k]);
      }
      fold_pack<VEC>(v, acc[i]);
    }
    for (int64_t c = packs * VEC + i; c < vocab; c += threads) {
      const float v[1] = {StorageElement<T>::to_float(x[c])};
      fold_pack<1>(v, acc[i]);
    }
  }
  for (int w = 0; w < threads / 32; ++w) {
    for (int mask = 16; mask > 0; mask >>= 1) {
      std::vector<OnlineLse> next(32);
      for (int l = 0; l < 32; ++l) next[l] = combine(acc[w * 32 + l], acc[w * 32 + (l ^ mask)]);
      for (int l = 0; l < 32; ++l) acc[w * 32 + l] = next[l];
    }
  }
  OnlineLse total = acc[0];
  for (int w = 1; w < threads / 32; ++w) total = combine(total, acc[w * 32]);
  return total.m + logf(total.s);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

template <typename T, int VEC>
void run_case(const Case& c) {
  const at::ScalarType dt = c.bf16 ? at::kBFloat16 : at::kFloat;
  at::manual_seed(c.V * 31 + c.T);
  at::Tensor logits;
  if (c.strided) {
    // Row stride V + pad elements; pad makes it a multiple of 8 (BF16 pack) when the
    // vectorised body runs, so the rows stay 16-byte aligned with a scalar tail.
    const int64_t wide = c.vectorised ? (c.V + 8) / 8 * 8 + 8 : c.V + 3;
    logits = (at::randn({c.T, c.B, wide}) * 4).to(dt).transpose(0, 1).narrow(2, 0, c.V);
  } else {
    logits = (at::randn({c.B, c.T, c.V}) * 4).to(dt);
  }
  at::Tensor labels = at::randint(0, c.V, {c.B, c.T}, at::kLong);
  const int64_t rows = c.B * (c.T - 1);
  for (int64_t n = 1; n < rows; n += 3) labels[n / (c.T - 1)][n % (c.T - 1) + 1] = kIgnore;
  const int threads = cross_entropy_block_threads(c.V);

  CrossEntropyProblem p;
  p.batch = c.B;
  p.tokens = c.T;
  p.vocab = c.V;
  p.logits = logits.data_ptr();
  p.logits_batch_stride = logits.stride(0);
  p.logits_token_stride = logits.stride(1);
  p.labels = labels.data_ptr<int64_t>();
  p.labels_batch_stride = labels.stride(0);
  p.labels_token_stride = labels.stride(1);
  p.ignore_index = kIgnore;
  if (VEC > 1) {
    ASSERT_EQ(reinterpret_cast<uintptr_t>(p.logits) % 16, 0u);
    ASSERT_EQ(p.logits_batch_stride * logits.element_size() % 16, 0);
    ASSERT_EQ(p.logits_token_stride * logits.element_size() % 16, 0);
  }

  // Forward rows, then the mean.
  at::Tensor row_loss = at::full({rows}, NAN), row_lse = at::full({rows}, NAN);
  CrossEntropyForwardArgs fa;
  fa.problem = p;
  fa.row_loss = row_loss.data_ptr<float>();
  fa.row_lse = row_lse.data_ptr<float>();
  std::vector<float> pairs(2 * kCrossEntropyMaxThreads / 32);
  run_grid(rows, threads,
           [&](int64_t) { cross_entropy_detail::forward_row<T, VEC>(fa, pairs.data()); });
  at::Tensor loss = at::full({1}, NAN), count = at::full({1}, NAN);
  std::vector<float> sums(kCrossEntropyReduceThreads);
  std::vector<int64_t> counts(kCrossEntropyReduceThreads);
  run_grid(1, kCrossEntropyReduceThreads, [&](int64_t) {
    cross_entropy_detail::reduce_rows(p, fa.row_loss, loss.data_ptr<float>(),
                                      count.data_ptr<float>(), sums.data(), counts.data());
  });

  // Backward into a NaN-filled buffer (every element must be written).
  const float g = 0.625f;
  at::Tensor grad = at::full({c.B, c.T, c.V}, NAN, at::TensorOptions().dtype(dt));
  CrossEntropyBackwardArgs ba;
  ba.problem = p;
  ba.row_lse = fa.row_lse;
  ba.grad_loss = &g;
  ba.count = count.data_ptr<float>();
  ba.grad_logits = grad.data_ptr();
  // The launcher vectorises the backward only when the output rows are aligned too.
  run_grid(c.B * c.T, threads, [&](int64_t) {
    if (c.V % VEC == 0) {
      cross_entropy_detail::backward_row<T, VEC>(ba);
    } else {
      cross_entropy_detail::backward_row<T, 1>(ba);
    }
  });

  // Independent FP64 loop written from the formula (not the kernel's code).
  const at::Tensor xd = logits.to(at::kDouble).contiguous();
  const auto X = xd.accessor<double, 3>();
  const auto Y = labels.accessor<int64_t, 2>();
  const at::Tensor gd = grad.to(at::kDouble);
  const auto G = gd.accessor<double, 3>();
  const auto RL = row_loss.accessor<float, 1>(), RS = row_lse.accessor<float, 1>();
  double sum = 0.0;
  int64_t counted = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t t = 0; t + 1 < c.T; ++t) {
      const int64_t n = b * (c.T - 1) + t, y = Y[b][t + 1];
      if (y == kIgnore) {
        EXPECT_EQ(RL[n], 0.0f) << "ignored row " << n;
        continue;
      }
      double m = X[b][t][0];
      for (int64_t v = 1; v < c.V; ++v) m = std::max(m, X[b][t][v]);
      double s = 0.0;
      for (int64_t v = 0; v < c.V; ++v) s += std::exp(X[b][t][v] - m);
      const double lse = m + std::log(s);
      EXPECT_NEAR(RS[n], lse, 2e-6 * (1.0 + std::fabs(lse))) << "row " << n;
      EXPECT_NEAR(RL[n], lse - X[b][t][y], 4e-6 * (1.0 + std::fabs(lse))) << "row " << n;
      sum += lse - X[b][t][y];
      ++counted;
    }
  }
  EXPECT_EQ(count[0].item<float>(), static_cast<float>(counted));
  EXPECT_NEAR(loss[0].item<float>(), sum / counted, 4e-6 * (1.0 + std::fabs(sum / counted)));

  const double scale = static_cast<double>(g) / counted;
  const double rel = c.bf16 ? 4e-3 : 1e-5;  // BF16: one rounding of the output (2^-9)
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t t = 0; t < c.T; ++t) {
      const bool scored = t + 1 < c.T && Y[b][t + 1] != kIgnore;
      const double lse = scored ? RS[b * (c.T - 1) + t] : 0.0;
      for (int64_t v = 0; v < c.V; ++v) {
        if (!scored) {
          ASSERT_EQ(G[b][t][v], 0.0) << "b " << b << " t " << t << " v " << v;
          continue;
        }
        const double ref = scale * (std::exp(X[b][t][v] - lse) - (v == Y[b][t + 1] ? 1.0 : 0.0));
        ASSERT_NEAR(G[b][t][v], ref, rel * std::fabs(ref) + 1e-6 * scale)
            << "b " << b << " t " << t << " v " << v;
      }
    }
  }

  // The documented order, bit for bit: each row's logsumexp, then the mean (thread i sums
  // rows i, i + 512, ... in order; a halving tree over thread slots).
  for (int64_t n = 0; n < rows; ++n) {
    const int64_t b = n / (c.T - 1), t = n % (c.T - 1);
    if (Y[b][t + 1] == kIgnore) continue;
    const T* x =
        static_cast<const T*>(p.logits) + b * p.logits_batch_stride + t * p.logits_token_stride;
    ASSERT_TRUE(same_bits(RS[n], documented_lse<T, VEC>(x, c.V, threads))) << "row " << n;
  }
  std::vector<float> slot(kCrossEntropyReduceThreads, 0.0f);
  for (int i = 0; i < kCrossEntropyReduceThreads; ++i) {
    for (int64_t n = i; n < rows; n += kCrossEntropyReduceThreads) slot[i] += RL[n];
  }
  for (int stride = kCrossEntropyReduceThreads / 2; stride > 0; stride >>= 1) {
    for (int i = 0; i < stride; ++i) slot[i] += slot[i + stride];
  }
  EXPECT_TRUE(same_bits(loss[0].item<float>(), slot[0] / static_cast<float>(counted)));
}

class CrossEntropyKernelEmulation : public ::testing::TestWithParam<Case> {};

TEST_P(CrossEntropyKernelEmulation, MatchesTheFormulaAndTheDocumentedOrder) {
  const Case c = GetParam();
  if (c.bf16) {
    c.vectorised ? run_case<c10::BFloat16, 8>(c) : run_case<c10::BFloat16, 1>(c);
  } else {
    c.vectorised ? run_case<float, 4>(c) : run_case<float, 1>(c);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CrossEntropyKernelEmulation,
    ::testing::Values(Case{false, 2, 3, 1, false, false}, Case{true, 1, 4, 7, false, false},
                      Case{false, 2, 3, 7, true, false}, Case{true, 2, 3, 1000, false, true},
                      Case{false, 1, 4, 1000, false, true}, Case{true, 1, 3, 4099, false, false},
                      Case{true, 2, 3, 4099, true, true}, Case{false, 2, 2, 4099, true, true},
                      Case{true, 3, 2, 1000, true, false}),
    [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

// A target outside [0, V) never reads outside the row: the row loss and its gradient row
// are NaN (the op's host check normally stops such labels before the launch).
TEST(CrossEntropyKernelEmulationEdges, OutOfRangeTargetGivesNanWithoutReadingOutsideTheRow) {
  const int64_t V = 40;
  // The row sits in the middle of a buffer whose neighbours are NaN: any read outside
  // the row would make the logsumexp NaN too.
  at::Tensor wide = at::full({1, 2, 3 * V}, NAN);
  wide.narrow(2, V, V).copy_(at::randn({1, 2, V}));
  const at::Tensor view = wide.narrow(2, V, V);
  at::Tensor labels = at::tensor({int64_t{0}, int64_t{V + 7}}, at::kLong).view({1, 2});
  CrossEntropyProblem p;
  p.batch = 1;
  p.tokens = 2;
  p.vocab = V;
  p.logits = view.data_ptr();
  p.logits_batch_stride = view.stride(0);
  p.logits_token_stride = view.stride(1);
  p.labels = labels.data_ptr<int64_t>();
  p.labels_batch_stride = 2;
  p.labels_token_stride = 1;
  float row_loss = 0, row_lse = 0;
  CrossEntropyForwardArgs fa;
  fa.problem = p;
  fa.row_loss = &row_loss;
  fa.row_lse = &row_lse;
  std::vector<float> pairs(2 * kCrossEntropyMaxThreads / 32);
  const int threads = cross_entropy_block_threads(V);
  run_grid(1, threads,
           [&](int64_t) { cross_entropy_detail::forward_row<float, 1>(fa, pairs.data()); });
  EXPECT_TRUE(std::isnan(row_loss));
  EXPECT_TRUE(std::isfinite(row_lse));
  const float g = 1.0f, count = 1.0f;
  at::Tensor grad = at::zeros({1, 2, V});
  CrossEntropyBackwardArgs ba;
  ba.problem = p;
  ba.row_lse = &row_lse;
  ba.grad_loss = &g;
  ba.count = &count;
  ba.grad_logits = grad.data_ptr();
  run_grid(2, threads, [&](int64_t) { cross_entropy_detail::backward_row<float, 1>(ba); });
  EXPECT_TRUE(at::isnan(grad[0][0]).all().item<bool>());
  EXPECT_TRUE(at::equal(grad[0][1], at::zeros({V})));  // the last position: zeros
}

}  // namespace
}  // namespace gdr::kernels
