// Scalar formulas of full pre-GDR fusion (conv1d + SiLU + L2 norm, forward and backward),
// shared by the CUDA kernels and the host reference so both compute the same thing in the
// same order. Each mirrors the ATen op the unfused path (models/qwen/layers.cc) runs, so
// the fused and unfused results differ only by FP32 summation order.
#pragma once

#include <cmath>

#include "kernels/pre_gdr_gate/pre_gdr_gate_math.h"  // GDR_HOST_DEVICE

namespace gdr::kernels {

// The causal conv's taps (linear_conv_kernel_dim); the kernels unroll over it.
constexpr int kFullFusionConvTaps = 4;

// q and k are unit vectors before the core: x * rsqrt(sum(x^2) + eps), eps 1e-6.
constexpr float kFullFusionL2Eps = 1e-6f;

// y[t] = sum_j w[j] * x[t + j - 3] (at::conv1d after a left pad of 3): taps in index order,
// window[0] = x[t - 3] ... window[3] = x[t].
GDR_HOST_DEVICE float full_fusion_conv(const float (&w)[kFullFusionConvTaps],
                                       const float (&window)[kFullFusionConvTaps]) {
  float acc = w[0] * window[0];
  for (int j = 1; j < kFullFusionConvTaps; ++j) acc = fmaf(w[j], window[j], acc);
  return acc;
}

// Backward of the conv for one input token s: sum_j w[j] * dy[s + 3 - j], with
// dy_window[i] = dy[s + i] (zero past the end of the sequence).
GDR_HOST_DEVICE float full_fusion_conv_backward(const float (&w)[kFullFusionConvTaps],
                                                const float (&dy_window)[kFullFusionConvTaps]) {
  float acc = w[0] * dy_window[kFullFusionConvTaps - 1];
  for (int j = 1; j < kFullFusionConvTaps; ++j)
    acc = fmaf(w[j], dy_window[kFullFusionConvTaps - 1 - j], acc);
  return acc;
}

// at::silu's opmath formula: x / (1 + exp(-x)).
GDR_HOST_DEVICE float full_fusion_silu(float x) { return x / (1.0f + expf(-x)); }

// at::silu_backward's formula: dy * sigmoid(x) * (1 + x * (1 - sigmoid(x))).
GDR_HOST_DEVICE float full_fusion_silu_backward(float grad, float x) {
  const float sigmoid = 1.0f / (1.0f + expf(-x));
  return grad * sigmoid * (1.0f + x * (1.0f - sigmoid));
}

GDR_HOST_DEVICE float full_fusion_rsqrt(float x) {
#if defined(__CUDA_ARCH__)
  return rsqrtf(x);  // what at::rsqrt runs on CUDA
#else
  return 1.0f / std::sqrt(x);
#endif
}

// Backward of q = x * r, r = rsqrt(sum(x^2) + eps), per element given r and
// dot = sum(grad * x) over the head: grad * r - x * (dot * r^3), the terms autograd
// produces for the mul, rsqrt, sum and pow of l2_normalize.
GDR_HOST_DEVICE float full_fusion_l2_backward(float grad, float x, float r, float dot) {
  return grad * r - x * (dot * (r * r * r));
}

}  // namespace gdr::kernels
