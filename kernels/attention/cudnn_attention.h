// Causal scaled-dot-product attention (forward and backward) through cuDNN's fused flash
// attention graphs, built with cuDNN's C++ frontend and cached per problem.
//
// Why cuDNN and not ATen's SDPA: with deterministic algorithms on, ATen refuses its cuDNN
// backend and runs FlashAttention 2 with split dQ accumulators (zero fill + convert), 2.4x
// the time of cuDNN's SM90 kernels for the 0.8B model's attention. cuDNN has a bitwise
// deterministic backward of its own (`set_deterministic_algorithm`: on Hopper the dP
// workspace variant, whose dQ is a GEMM over a materialised dP instead of atomics), which
// ATen does not ask for. This file asks for it when `deterministic` is set.
//
// No torch here: pointers, strides and a stream. The libtorch op
// (ops/attention/attention_op_cuda.cc) allocates outputs and the workspace from the caching
// allocator and turns errors into TORCH_CHECKs. Errors are thrown as std::runtime_error with the
// reason cuDNN gave.
#pragma once

#include <cuda_runtime_api.h>

#include <array>
#include <cstdint>
#include <string>

namespace gdr::kernels {

enum class AttentionDtype { kBFloat16, kHalf };

// Element strides of a [batch, heads, seq, head_dim] view; head_dim's stride must be 1.
using AttentionStrides = std::array<int64_t, 4>;

// One attention problem. q, o, grad_o, grad_q: [batch, q_heads, seq_len, head_dim];
// k, v, grad_k, grad_v: [batch, kv_heads, seq_len, head_dim] (q_heads a multiple of
// kv_heads: grouped-query attention without materialising the repeat). The softmax
// statistics (log-sum-exp per row, FP32) are [batch, q_heads, seq_len] contiguous.
// Causal with the diagonal at the top left (query i sees keys 0..i).
struct AttentionProblem {
  AttentionDtype dtype = AttentionDtype::kBFloat16;
  int64_t batch = 0, q_heads = 0, kv_heads = 0, seq_len = 0, head_dim = 0;
  float scale = 1.0f;
  AttentionStrides q{}, k{}, v{}, o{};
  // Backward only.
  AttentionStrides grad_o{}, grad_q{}, grad_k{}, grad_v{};
  bool deterministic = false;  // backward: cuDNN's bitwise-deterministic algorithm
  int device = 0;
};

// Empty when cuDNN (the one this process loaded) can run the forward and the backward of
// `problem`; otherwise why not, in one line (cuDNN's own message where it gave one). The
// answer builds and caches both graphs, so it costs a few hundred ms per new problem and
// nothing after.
std::string cudnn_attention_unsupported_reason(const AttentionProblem& problem);

// Workspace bytes for the forward / backward of `problem` (builds and caches the graph).
int64_t cudnn_attention_forward_workspace_bytes(const AttentionProblem& problem);
int64_t cudnn_attention_backward_workspace_bytes(const AttentionProblem& problem);

// o = softmax(scale * q k^T + causal mask) v and stats = the rows' log-sum-exp.
void cudnn_attention_forward(const AttentionProblem& problem, const void* q, const void* k,
                             const void* v, void* o, float* stats, void* workspace,
                             cudaStream_t stream);

// grad_q, grad_k, grad_v of the forward above, from its o and stats.
void cudnn_attention_backward(const AttentionProblem& problem, const void* q, const void* k,
                              const void* v, const void* o, const void* grad_o, const float* stats,
                              void* grad_q, void* grad_k, void* grad_v, void* workspace,
                              cudaStream_t stream);

// The version of the cuDNN library in use (e.g. 91900), loading it if needed.
int64_t cudnn_attention_backend_version();

}  // namespace gdr::kernels
