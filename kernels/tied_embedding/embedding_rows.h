// The tied embedding's weight-gradient rows (ops/tied_embedding/tied_embedding_op.h, Note [Tied
// embedding gradient]): adds to dW[V, H] the d_hidden rows of each token id, in place.
//
// Contract: ids [N] int64; rows [N, H] and dw [V, H] contiguous, one dtype (FP32, FP16,
// BF16). For every distinct id in [0, V) the rows of its tokens are summed in FP32 in
// token order, starting from the first token's row (no added zero), and the sum is added
// to dW[id] with ONE rounding: dW[id] = round(float(dW[id]) + sum). Ids outside [0, V)
// are skipped (the forward's index_select already refused them). Plain C++ (no CUDA or
// torch headers); the launcher runs on the stream it is given, allocates nothing (so it
// can be captured into a CUDA graph) and returns a cudaError_t as int.
//
// Deterministic by construction, no atomics and no sort: one block per (token, column
// tile); a block whose token has an earlier token with the same id exits, the first
// occurrence's block walks the later tokens with that id in token order and is the only
// writer of its row (Note [Embedding rows without atomics] in
// kernels/tied_embedding/embedding_rows.cu).
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

enum class EmbeddingRowsDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

struct EmbeddingRowsArgs {
  EmbeddingRowsDtype dtype = EmbeddingRowsDtype::kBFloat16;
  const int64_t* ids = nullptr;  // [tokens]
  const void* rows = nullptr;    // [tokens, hidden]
  void* dw = nullptr;            // [vocab, hidden]
  int64_t tokens = 0;
  int64_t hidden = 0;
  int64_t vocab = 0;
};

int launch_add_token_rows(const EmbeddingRowsArgs& args, CUstream_st* stream);

}  // namespace gdr::kernels
