// Note [Chunk output layout] on the GPU: gdr::chunks_to_tokens / gdr::tokens_to_chunks
// (kernels/gdr_core/chunk_layout.h where they apply) give the bits of the ATen copies they replace
// (chunk_layout_internal::*_aten, run on the same CUDA tensors): every output dtype, a
// token count that is not a multiple of the chunk (padding rows exactly +0.0 in the
// backward even where the fresh buffer held NaNs), batch and heads > 1, the 0.8B layer
// shape, NaN / inf / subnormal values, and the fallbacks (strided gradient, FP64).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <string>

#include "ops/gdr_core/gdr_core_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/error_of.h"

namespace gdr {
namespace {

using test_support::bitwise_equal;
using test_support::error_of;

struct LayoutCase {
  int64_t batch, heads, chunks, chunk, tokens, dv;
};

const LayoutCase kCases[] = {
    {2, 3, 3, 64, 130, 16},      // tail of 2 rows in the last chunk
    {1, 16, 32, 64, 2048, 128},  // the 0.8B layer shape
    {3, 2, 2, 64, 65, 24},       // dv a multiple of 8 but not of 16
    {1, 1, 1, 64, 64, 8},
};

// Values that show a wrong rounding or a lost sign: random normals at several scales plus
// NaN, +-inf, -0.0 and subnormals.
at::Tensor spiky(at::IntArrayRef sizes, at::ScalarType dtype, int64_t seed) {
  at::manual_seed(seed);
  at::Tensor x = at::randn(sizes, at::TensorOptions().device(at::kCUDA)) *
                 at::exp(at::randn(sizes, at::TensorOptions().device(at::kCUDA)) * 4);
  at::Tensor flat = x.view({-1});
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            -0.0f,
                            1e-40f,
                            -3e-39f,
                            65520.0f,
                            3.3895314e38f};
  for (int i = 0; i < 8 && i < flat.numel(); ++i) flat[i * 7 % flat.numel()].fill_(specials[i]);
  return x.to(dtype);
}

TEST(ChunkLayoutGpu, ChunksToTokensGivesTheAtenBits) {
  for (const LayoutCase& c : kCases) {
    const at::Tensor chunks =
        spiky({c.batch, c.heads, c.chunks, c.chunk, c.dv}, at::kFloat, c.tokens);
    for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
      const at::Tensor got = chunks_to_tokens(chunks, c.tokens, dtype);
      const at::Tensor want = chunk_layout_internal::chunks_to_tokens_aten(chunks, c.tokens, dtype);
      EXPECT_TRUE(got.is_contiguous());
      EXPECT_TRUE(bitwise_equal(got, want)) << "B=" << c.batch << " H=" << c.heads
                                            << " T=" << c.tokens << " dv=" << c.dv << " " << dtype;
    }
  }
}

TEST(ChunkLayoutGpu, TokensToChunksGivesTheAtenBitsAndZeroPadding) {
  for (const LayoutCase& c : kCases) {
    for (at::ScalarType dtype : {at::kBFloat16, at::kHalf, at::kFloat}) {
      const at::Tensor grad = spiky({c.batch, c.tokens, c.heads, c.dv}, dtype, 7 * c.tokens);
      // Leave NaNs in the caching allocator's next block of this size, so padding rows
      // that were not written would show.
      {
        at::Tensor poison = at::full({c.batch, c.heads, c.chunks, c.chunk, c.dv},
                                     std::numeric_limits<float>::quiet_NaN(),
                                     at::TensorOptions().device(at::kCUDA));
      }
      const at::Tensor got = tokens_to_chunks(grad, c.chunks, c.chunk, at::kFloat);
      const at::Tensor want =
          chunk_layout_internal::tokens_to_chunks_aten(grad, c.chunks, c.chunk, at::kFloat);
      EXPECT_TRUE(bitwise_equal(got, want)) << "B=" << c.batch << " H=" << c.heads
                                            << " T=" << c.tokens << " dv=" << c.dv << " " << dtype;
      const int64_t rows = c.chunks * c.chunk;
      if (rows > c.tokens) {
        const at::Tensor padding =
            got.view({c.batch, c.heads, rows, c.dv}).narrow(2, c.tokens, rows - c.tokens);
        EXPECT_TRUE(bitwise_equal(padding, at::zeros_like(padding)))
            << "padding rows, T=" << c.tokens;
      }
    }
  }
}

// Strided gradients (a transposed view) and FP64 take the ATen copies: same values.
TEST(ChunkLayoutGpu, LayoutsTheKernelsDoNotTakeStillGiveTheAtenBits) {
  const LayoutCase c{2, 3, 3, 64, 130, 16};
  const at::Tensor strided =
      spiky({c.batch, c.heads, c.tokens, c.dv}, at::kBFloat16, 5).transpose(1, 2);
  ASSERT_FALSE(strided.is_contiguous());
  EXPECT_TRUE(bitwise_equal(
      tokens_to_chunks(strided, c.chunks, c.chunk, at::kFloat),
      chunk_layout_internal::tokens_to_chunks_aten(strided, c.chunks, c.chunk, at::kFloat)));
  const at::Tensor chunks64 = spiky({c.batch, c.heads, c.chunks, c.chunk, c.dv}, at::kDouble, 6);
  EXPECT_TRUE(
      bitwise_equal(chunks_to_tokens(chunks64, c.tokens, at::kFloat),
                    chunk_layout_internal::chunks_to_tokens_aten(chunks64, c.tokens, at::kFloat)));
}

TEST(ChunkLayoutGpu, BadShapesAreRefusedWithTheArgumentNamed) {
  const at::Tensor chunks = at::zeros({1, 2, 2, 64, 16}, at::TensorOptions().device(at::kCUDA));
  const std::string too_many = error_of([&] { chunks_to_tokens(chunks, 129, at::kBFloat16); });
  EXPECT_NE(
      too_many.find("chunks_to_tokens: expected 0 < tokens <= N * C = 128 but got tokens = 129"),
      std::string::npos)
      << too_many;
  const at::Tensor grad = at::zeros({1, 130, 2, 16}, at::TensorOptions().device(at::kCUDA));
  const std::string short_chunks = error_of([&] { tokens_to_chunks(grad, 2, 64, at::kFloat); });
  EXPECT_NE(short_chunks.find("tokens_to_chunks: expected chunks * chunk >= T = 130 but got "
                              "chunks = 2, chunk = 64"),
            std::string::npos)
      << short_chunks;
}

}  // namespace
}  // namespace gdr
