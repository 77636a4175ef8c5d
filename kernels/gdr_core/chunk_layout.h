// The layout change between the GDR core's chunk layout and the model's token layout
// (ops/gdr_core/gdr_core_op.cc, Note [Chunk output layout]): the state pass leaves O as FP32
// [B, H, N * C, dv] (row n * C + i of head h is token n * C + i; rows >= T are padding),
// the model wants o [B, T, H, dv] in v's dtype, and the backward turns the gradient back.
// Plain C++ (no CUDA or torch headers); the launchers run on the stream they are given,
// allocate nothing (capturable) and return a cudaError_t as int.
//
// Why a kernel: ATen's strided copy with the cast runs these well below the HBM
// bandwidth, and the 0.8B training step makes many such calls (measured:
// docs/benchmarks.md, Other kernels in the 0.8B step). Each thread here moves 8
// consecutive dv elements with 16/32-byte loads and stores. Values are copied or rounded to nearest
// even exactly as ATen's copy_ rounds, so the bits are the same.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

enum class LayoutDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct ChunkLayoutShape {
  int64_t batch = 0;       // B
  int64_t heads = 0;       // H
  int64_t tokens = 0;      // T
  int64_t chunk_rows = 0;  // N * C >= T
  int64_t dv = 0;
};

// The kernels' preconditions (anything else stays on ATen's copy): dv a multiple of 8,
// tokens <= chunk_rows, every extent positive, both buffers 16-byte aligned.
bool chunk_layout_supports(const ChunkLayoutShape& shape, const void* chunks, const void* tokens);

// tokens[b, t, h, :] = round(chunks[b, h, t, :]) for t < T; chunks FP32, contiguous
// [B, H, N * C, dv]; tokens contiguous [B, T, H, dv] of `dtype`.
int launch_chunks_to_tokens(const ChunkLayoutShape& shape, const float* chunks, void* tokens,
                            LayoutDtype dtype, CUstream_st* stream);

// chunks[b, h, r, :] = tokens[b, r, h, :] widened for r < T, and +0.0 for the padding rows
// T <= r < N * C (the state pass backward multiplies them by zeros; 0 * garbage could be
// NaN). tokens contiguous [B, T, H, dv] of `dtype`; chunks FP32 contiguous.
int launch_tokens_to_chunks(const ChunkLayoutShape& shape, const void* tokens, LayoutDtype dtype,
                            float* chunks, CUstream_st* stream);

}  // namespace gdr::kernels
