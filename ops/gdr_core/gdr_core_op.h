// The gated delta rule (GDR) core of the Gated DeltaNet mixer (spec: shared design note
// qwen3_5.md, "The gated delta rule").
//
// Per (batch, head) the state S is [dk, dv]. Token t:
//   S = exp(g_t) * S;  u = beta_t * (v_t - S^T k_t);  S = S + k_t u^T;  o_t = S^T (scale * q_t)
//
// Contract shared by every entry point below:
//   q, k:          [B, T, Hk, dk]  FP32 / BF16 / FP16 / FP64, one dtype (any strides).
//   v:             [B, T, H, dv]   FP32 / BF16 / FP16 / FP64 (may differ from q's dtype);
//                                  H (= Hv) a multiple of Hk.
//   g (log decay): [B, T, H]       FP32 (or FP64), g <= 0 in practice.
//   beta:          [B, T, H]       FP32 (or FP64).
//   initial_state: [B, H, dk, dv]  any floating dtype; absent means zeros.
//   qk_norm:       GdrQkNorm::kNone (default) or kL2.
// Value head h reads key head h / (H / Hk) of q and k, the mapping of repeat_interleave
// (the caller never materialises repeated q / k; Hk = H is the plain case). With
// qk_norm = kL2 the core L2-normalises every row of q and k first, x * rsqrt(sum(x^2) +
// 1e-6) in the compute dtype (the model's q / k norm; HF's use_qk_l2norm_in_kernel), so
// callers hand over the raw conv outputs; with kNone q and k must already be normalised
// (or are whatever the caller wants). Either way the core then multiplies q by `scale`
// (the model passes dk^-1/2). The definition of both, in ATen, is chunk_prep_qk
// (ops/gdr_core/chunk_prep_op.h): the CPU, FP64 and composite paths run it, and the CUDA prep
// kernel reproduces it on load, reading the raw (e.g. BF16, strided) q / k in place, and
// returns dq / dk in q's dtype and shape (Note [Fused q/k L2 norm] in
// kernels/gdr_core/chunk_prep_kernel.cuh). Gradients flowing back to q / k are those of the
// raw inputs: through the norm and summed over the value heads of each key head.
//
// Returns (o, final_state): o is [B, T, H, dv] in v's dtype; final_state is [B, H, dk, dv]
// in the compute dtype when output_final_state is true, an undefined tensor otherwise.
// All math runs in FP32 (FP64 when any of q, k, v, g, beta is FP64, which the tests use
// for tight reference checks) whatever the input dtype, and only o is cast back.
//
// Gradients flow through libtorch autograd into q, k, v, g, beta and initial_state. Steps
// 1-6 of the chunked form are ATen ops, or on CUDA the chunk_prep op when the policy's
// gdr_core_prep says kernel. Step 7 (the inter-chunk state pass) is, on CUDA in FP32 with
// the default chunk when the policy's gdr_core_impl says kernel, the chunk_state_pass op
// (ops/gdr_core/chunk_state_op.h: one kernel walk each way, deterministic by construction);
// otherwise (CPU always, FP64, other chunk sizes, head dims the kernel does not support, or the
// policy saying composite) a loop of ATen ops over chunks. The CPU path is sequential and
// deterministic.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/policy/execution_policy.h"

namespace gdr {

// Chunk length of the chunked algorithm (C in the spec).
constexpr int64_t kGdrChunkSize = 64;

// What the core does to q and k before the gated delta rule (see the contract above).
enum class GdrQkNorm { kNone, kL2 };

// Which implementations run on CUDA is the execution policy's choice
// (ops/policy/execution_policy.h): gdr_core_impl picks step 7 (kKernel, the default: the
// chunk_state_pass op; kComposite: the per-chunk ATen loop, the CPU path) and
// gdr_core_prep steps 1-6 (kKernel, the default: the chunk_prep op, ops/gdr_core/chunk_prep_op.h,
// one kernel each way, FP32, C = 64, kernels::chunk_prep_supports(dk, dv); kAten: the ATen
// composition chunk_prep_composite below, which also serves the CPU, FP64, other chunk
// sizes and head dims the kernels do not support). Asking for a kernel on CUDA in a binary
// that does not link the CUDA implementations (//ops:cuda_ops) fails and says so.

// Which step 7 the most recent gated_delta_rule_chunked call in this process ran
// (kComposite on CPU, or where the kernel does not apply); for tests and benchmarks.
GdrCoreImpl gdr_core_last_step7();

// Tests only (off by default): on CPU, also run step 7 through the chunk_state_pass op
// (its CPU implementation, any dtype, shape and chunk size) when the policy says kernel,
// so the op's wiring into the core and its autograd can be checked against the composite
// in FP64 without a GPU. CPU numerics are unchanged while it is off.
void set_gdr_core_op_on_cpu_for_testing(bool enabled);

// Which steps 1-6 the most recent gated_delta_rule_chunked call in this process ran.
GdrCorePrep gdr_core_last_prep();

// Tests only (off by default): on CPU, also run steps 1-6 through the chunk_prep op (its
// CPU reference implementation) when the policy's gdr_core_prep says kernel. CPU numerics are
// unchanged while it is off.
void set_gdr_core_prep_op_on_cpu_for_testing(bool enabled);

// Steps 1-6 of the chunked form as ATen ops (differentiated by autograd), q and k first
// through chunk_prep_qk (the L2 norm when qk_norm says so, the head repeat): returns
// (U, W, Q_decayed, P, K_to_end, G_last) with the shapes and meaning of chunk_prep's
// outputs (ops/gdr_core/chunk_prep_op.h), in the compute dtype; U and W may be views.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_prep_composite(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, double scale, int64_t chunk_size,
                     GdrQkNorm qk_norm = GdrQkNorm::kNone);

// The one entry point models call: gated_delta_rule_chunked, whose steps run as CUDA
// kernels on CUDA where the execution policy says so and as ATen ops elsewhere.
std::tuple<at::Tensor, at::Tensor> gated_delta_rule(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale,
    const std::optional<at::Tensor>& initial_state = std::nullopt, bool output_final_state = false,
    GdrQkNorm qk_norm = GdrQkNorm::kNone);

// Packed variable-length sequences (as FLA's cu_seqlens): q, k, v, g, beta hold N
// documents back to back along T (B must be 1); document i is tokens
// cu_seqlens[i] .. cu_seqlens[i+1]-1 and starts from initial_state[i] (zeros when absent),
// so no state crosses a document boundary (the L2 norm of qk_norm is per token, so it
// does not either). cu_seqlens: N + 1 non-decreasing offsets from
// 0 to T (empty documents allowed). initial_state: [N, H, dk, dv]. Returns o [1, T, H, dv]
// and, with output_final_state, [N, H, dk, dv] (an empty document's final state is its
// initial state). Each document runs through gated_delta_rule on its slice, so outputs and
// gradients equal separate calls bit for bit (Note [Packed documents] in
// ops/packed/packed_documents.h); one launch sequence per document (a single varlen kernel
// launch is future work).
std::tuple<at::Tensor, at::Tensor> gated_delta_rule_varlen(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale, const std::vector<int64_t>& cu_seqlens,
    const std::optional<at::Tensor>& initial_state = std::nullopt, bool output_final_state = false,
    GdrQkNorm qk_norm = GdrQkNorm::kNone);

// The chunked (WY / UT-transform) algorithm of the spec, the training path. T is padded to
// a multiple of chunk_size internally; `chunk_size` other than kGdrChunkSize is only for
// tests that want several chunks from tiny shapes.
std::tuple<at::Tensor, at::Tensor> gated_delta_rule_chunked(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale,
    const std::optional<at::Tensor>& initial_state = std::nullopt, bool output_final_state = false,
    int64_t chunk_size = kGdrChunkSize, GdrQkNorm qk_norm = GdrQkNorm::kNone);

// Token-by-token recurrence, the simple reference the chunked form is tested against.
// O(T) sequential steps: slow, for tests and debugging.
std::tuple<at::Tensor, at::Tensor> gated_delta_rule_recurrent(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, double scale,
    const std::optional<at::Tensor>& initial_state = std::nullopt, bool output_final_state = false,
    GdrQkNorm qk_norm = GdrQkNorm::kNone);

// Note [Chunk output layout] (ops/gdr_core/gdr_core_op.cc): the core's output between the state
// pass's chunk layout and the model's token layout, as dispatcher ops (CPU: ATen copies;
// CUDA, ops/gdr_core/gdr_core_op_cuda.cc: kernels/gdr_core/chunk_layout.h where it applies, else
// the same ATen copies). Exact copies (16-bit outputs rounded to nearest even as copy_ rounds), so
// every implementation gives the same bits.
// o_chunks [B, H, N, C, dv] (N * C >= tokens) -> o [B, tokens, H, dv] in `dtype`,
// contiguous.
at::Tensor chunks_to_tokens(const at::Tensor& o_chunks, int64_t tokens, at::ScalarType dtype);
// grad_o [B, T, H, dv] (any strides and floating dtype) -> [B, H, chunks, chunk, dv] in
// `dtype`, contiguous, the padding rows T .. chunks * chunk - 1 exactly zero.
at::Tensor tokens_to_chunks(const at::Tensor& grad_o, int64_t chunks, int64_t chunk,
                            at::ScalarType dtype);

namespace chunk_layout_internal {
// Argument checks of the two ops (shapes; messages name the argument).
void check_chunks_to_tokens(const at::Tensor& o_chunks, int64_t tokens);
void check_tokens_to_chunks(const at::Tensor& grad_o, int64_t chunks, int64_t chunk);
// The ATen implementations (CPU, and CUDA where the kernels do not apply).
at::Tensor chunks_to_tokens_aten(const at::Tensor& o_chunks, int64_t tokens, at::ScalarType dtype);
at::Tensor tokens_to_chunks_aten(const at::Tensor& grad_o, int64_t chunks, int64_t chunk,
                                 at::ScalarType dtype);
}  // namespace chunk_layout_internal

}  // namespace gdr
