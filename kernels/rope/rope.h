// Fused partial rotary position embedding (the gated attention's q and k), forward and
// backward, one pass each. Per row of head_dim elements (one token of one head), the first
// `rotary` dims rotate and the rest pass through:
//   out[i] = x[i] cos[t][i] + rh[i] sin[t][i]   (i < rotary; rh = [-x[h:2h], x[0:h]], h = rotary/2)
//   out[i] = x[i]                               (i >= rotary)
// Unfused, ATen runs ~9 kernels forward (narrows, a cast, a negation, two cats, two
// products, a sum, a cast back) and ~15 backward (zero-filled narrow backwards, adds,
// casts). Note [Rope rounding]: every product and the sum are FP32 operations rounded
// where the ATen ops round (no fused multiply-add across them), and the result is stored
// in x's dtype, so the values are the composite's; the backward's two terms per element,
// g cos and the rotated g sin, are the two non-zero addends autograd sums. cos and sin
// ([T, rotary], FP32) come from the caller (computed by the same ATen ops as the
// composite's).
//
// Plain C++ (no CUDA or torch headers). x: rows addressed as [B, H, T] with element strides
// (the model's transposed [B, T, H, hd] views need no copy), head dim contiguous; out / dx
// are written with the same strides as given in their own operand. Launchers run on the
// stream they are given and return a cudaError_t as int. Elementwise: deterministic.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

enum class RopeDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// A [B, H, T, head_dim] tensor with a contiguous head dim.
struct RopeOperand {
  void* data = nullptr;
  int64_t stride_b = 0, stride_h = 0, stride_t = 0;  // elements
};

struct RopeArgs {
  RopeDtype dtype = RopeDtype::kBFloat16;
  int64_t batch = 0, heads = 0, tokens = 0;
  int head_dim = 0;
  int rotary = 0;              // even, 2 <= rotary <= head_dim
  const float* cos = nullptr;  // [tokens, rotary] contiguous
  const float* sin = nullptr;  // [tokens, rotary] contiguous
  RopeOperand in;              // x (forward) or the output gradient (backward)
  RopeOperand out;             // y (forward) or dx (backward)
};

int launch_rope_forward(const RopeArgs& args, CUstream_st* stream);
int launch_rope_backward(const RopeArgs& args, CUstream_st* stream);

}  // namespace gdr::kernels
