// Fused gated activations of the Qwen3.5 model, forward and backward, one pass each:
//   silu:    y = silu(gate) * x     (the MLP: silu(gate_proj(h)) * up_proj(h))
//   sigmoid: y = x * sigmoid(gate)  (gated attention: attn * sigmoid(gate))
// Unfused, ATen runs the activation, the product and, in the backward, two products and
// the activation's backward as separate elementwise kernels: 5 tensor passes forward and
// 9 backward where these kernels make 3 and 5 (docs/benchmarks.md: the MLP's share of a
// 0.8B step).
//
// Note [Gated activation rounding]: the kernels round where the unfused ATen ops round,
// with ATen's formulas in FP32 (kernels/gated_activation_math.h), so the outputs and
// gradients are the composite's bits: the activation a = act(gate) is stored in the input
// dtype before the product, as ATen's silu / sigmoid output is; the backward recomputes
// that stored a, forms dx = dy * a and da = dy * x, rounds da to the input dtype (ATen's
// mul output) and applies the activation's backward to it (silu_backward(da, gate),
// sigmoid_backward(da, a)). tests/ops:gated_activation_gpu_test checks the bits against
// the ATen composite on CUDA.
//
// Plain C++ (no CUDA or torch headers). Every operand holds `numel` elements of one
// storage dtype in element order, read as segments (GatedOperand): element e sits at
// data + (e / segment) * pitch + e % segment, so a split-off piece of a wider projection
// (the attention gate: [B, T, H, head_dim] inside [B, T, H, 2 head_dim]) is read in place;
// a contiguous operand is one segment. Outputs are written contiguous. Launchers run on the
// stream they are given and return a cudaError_t as int. Elementwise: deterministic by
// construction, no reductions.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

enum class GatedActivation : int { kSilu = 0, kSigmoid = 1 };

enum class GatedDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Elements in segments of `segment` contiguous elements, `pitch` elements apart.
struct GatedOperand {
  const void* data = nullptr;
  int64_t segment = 0;  // >= 1; numel for a contiguous operand
  int64_t pitch = 0;    // >= segment
};

struct GatedForwardArgs {
  GatedActivation activation = GatedActivation::kSilu;
  GatedDtype dtype = GatedDtype::kBFloat16;
  int64_t numel = 0;
  GatedOperand gate;
  GatedOperand x;
  void* y = nullptr;  // contiguous
};

struct GatedBackwardArgs {
  GatedActivation activation = GatedActivation::kSilu;
  GatedDtype dtype = GatedDtype::kBFloat16;
  int64_t numel = 0;
  const void* grad_y = nullptr;  // contiguous
  GatedOperand gate;
  GatedOperand x;
  void* grad_gate = nullptr;  // contiguous
  void* grad_x = nullptr;     // contiguous
};

int launch_gated_activation_forward(const GatedForwardArgs& args, CUstream_st* stream);
int launch_gated_activation_backward(const GatedBackwardArgs& args, CUstream_st* stream);

}  // namespace gdr::kernels
