// Full pre-GDR fusion: everything between the Gated DeltaNet's qkv projection and the GDR
// core in one pass over the projection output (spec: shared design note pre_gdr_gate.md,
// "What full pre-GDR fusion covers"; the unfused composition is
// models/qwen/layers.cc GatedDeltaNetImpl::forward). The gate (g, beta) is not here: the op
// runs the existing gate kernels (kernels/pre_gdr_gate/pre_gdr_gate.h) next to these. Plain C++ (no
// CUDA or torch headers) so the layout rules and the host reference build anywhere.
//
// Forward, per token (b, t) and channel c of qkv [B, T, C], C = 2*Hk*dk + Hv*dv:
//   y  = round(sum_j w[c, j] * qkv[b, t + j - 3, c])    causal depthwise conv, FP32 accumulate
//   s  = round(silu(y))                                  round() = to the activation dtype,
//                                                        as the unfused path stores them
//   q/k heads (channels [0, 2*Hk*dk)): s * rsqrt(sum_head(s^2) + 1e-6) in FP32, written to
//       the Hv/Hk consecutive value heads of their key head (repeat_interleave)
//   v heads: float(s)
// Outputs q, k: [B, T, Hv, dk], v: [B, T, Hv, dv], FP32, contiguous.
//
// Backward recomputes y, s and the norms from qkv (no saved intermediates) and mirrors the
// unfused autograd graph's roundings: the gradient reaching s is rounded to the activation
// dtype (the .to(float) of the unfused path), so is the SiLU input gradient dy, and
// grad_qkv[t] = round(sum_j w[j] * dy[t + 3 - j]). The conv-weight gradient
// sum_{b,t} dy[t] * qkv[t + j - 3] is accumulated in FP32 with atomicAdd into a zeroed
// [C, 4] buffer: its bits can vary run to run, so the op refuses deterministic mode.
//
// Layout contract: qkv has unit channel stride and any (non-negative) batch / token
// strides; conv_weight is [C, 1, 4] contiguous in the activation dtype; grad_q/k/v are
// contiguous FP32; grad_qkv is written contiguous [B, T, C]. Head dims dk and dv must be
// powers of two in [4, 256] (full_fusion_head_layout). Every launcher runs on the stream
// it is given and returns 0 (cudaSuccess) or the CUDA error of the launch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/pre_gdr_gate/pre_gdr_gate.h"  // ScalarKind

struct CUstream_st;

namespace gdr::kernels {

struct FullFusionShape {
  int64_t batch = 0;
  int64_t seq = 0;
  int64_t num_k_heads = 0;  // Hk
  int64_t num_v_heads = 0;  // Hv, a multiple of Hk
  int64_t head_k_dim = 0;   // dk
  int64_t head_v_dim = 0;   // dv
  constexpr int64_t key_dim() const { return num_k_heads * head_k_dim; }
  constexpr int64_t value_dim() const { return num_v_heads * head_v_dim; }
  constexpr int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  constexpr int64_t tokens() const { return batch * seq; }
  // Head groups of the conv channels: Hk q heads, Hk k heads, Hv v heads. (constexpr:
  // callable from device code under --expt-relaxed-constexpr.)
  constexpr int64_t groups() const { return 2 * num_k_heads + num_v_heads; }
};

// How one warp covers one head (W = dk or dv channels) at one token: `lanes` lanes of
// `per_lane` contiguous channels each (a vector load); lanes >= `lanes` idle.
struct HeadLayout {
  int lanes = 0;
  int per_lane = 0;
};

// per_lane 4 for W <= 128 (lanes = W / 4), 8 for W = 256 (32 lanes). W must be a power
// of two in [4, 256]; otherwise {0, 0}.
HeadLayout full_fusion_head_layout(int64_t head_dim);

// Empty when the shape can be launched, otherwise a sentence saying what is wrong.
std::string validate_full_fusion_shape(const FullFusionShape& shape);

// Tokens per program along the sequence: 8 warps x kFullFusion{Forward,Backward}Strip.
constexpr int kFullFusionWarps = 8;
constexpr int kFullFusionForwardStrip = 8;
constexpr int kFullFusionBackwardStrip = 16;

struct FullFusionForwardArgs {
  FullFusionShape shape;
  ScalarKind kind = ScalarKind::kBFloat16;  // qkv and conv_weight
  const void* qkv = nullptr;
  int64_t qkv_stride_b = 0;  // elements
  int64_t qkv_stride_t = 0;
  const void* conv_weight = nullptr;  // [C, 4]
  float* q = nullptr;                 // [B, T, Hv, dk]
  float* k = nullptr;
  float* v = nullptr;  // [B, T, Hv, dv]
};

struct FullFusionBackwardArgs {
  FullFusionShape shape;
  ScalarKind kind = ScalarKind::kBFloat16;
  const void* qkv = nullptr;
  int64_t qkv_stride_b = 0;
  int64_t qkv_stride_t = 0;
  const void* conv_weight = nullptr;
  const float* grad_q = nullptr;  // [B, T, Hv, dk] contiguous
  const float* grad_k = nullptr;
  const float* grad_v = nullptr;      // [B, T, Hv, dv] contiguous
  void* grad_qkv = nullptr;           // [B, T, C] contiguous, `kind`
  float* grad_conv_weight = nullptr;  // [C, 4] FP32, zeroed before the launch (atomicAdd)
};

int launch_pre_gdr_full_fusion_forward(const FullFusionForwardArgs& args, CUstream_st* stream);
int launch_pre_gdr_full_fusion_backward(const FullFusionBackwardArgs& args, CUstream_st* stream);

// ---------------------------------------------------------------------------
// Host reference (plain C++, sequential, FP32 math with FP64 conv-weight sums), the same
// formulas (kernels/pre_gdr_gate/pre_gdr_full_fusion_math.h) and rounding points as the kernels.
// Activations are passed as floats holding values of `kind`; roundings go to `kind`.
// qkv: [B, T, C] contiguous; conv_weight: [C, 4]; grads and outputs contiguous FP32.

// Round-to-nearest-even of x to the precision and range of `kind` (identity for FP32).
float round_to_kind(float x, ScalarKind kind);

void pre_gdr_full_fusion_forward_reference(const FullFusionShape& shape, ScalarKind kind,
                                           const float* qkv, const float* conv_weight, float* q,
                                           float* k, float* v);

// grad_qkv [B, T, C] comes back rounded to `kind`; grad_conv_weight [C, 4] is the
// unrounded FP32 sum.
void pre_gdr_full_fusion_backward_reference(const FullFusionShape& shape, ScalarKind kind,
                                            const float* qkv, const float* conv_weight,
                                            const float* grad_q, const float* grad_k,
                                            const float* grad_v, float* grad_qkv,
                                            float* grad_conv_weight);

}  // namespace gdr::kernels
