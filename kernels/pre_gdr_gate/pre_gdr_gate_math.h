// Scalar formulas of the pre-GDR gate, shared by the CUDA kernels and the CPU op so both
// compute the same thing. See Note [Softplus threshold].
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define GDR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define GDR_HOST_DEVICE inline
#endif

namespace gdr::kernels {

// Note [Softplus threshold]: PyTorch's softplus (beta = 1, threshold = 20) returns its
// input above 20 and log1p(exp(x)) otherwise; its derivative is then 1 above 20 and
// sigmoid(x) otherwise. The gate follows it exactly so that the fused op, the CPU op and
// the unfused libtorch composition agree in every regime.
constexpr float kSoftplusThreshold = 20.0f;

GDR_HOST_DEVICE float gate_softplus(float pre) {
  return pre > kSoftplusThreshold ? pre : log1pf(expf(pre));
}

// softplus'(pre) written as PyTorch's softplus_backward writes it, z / (z + 1) with
// z = exp(pre), so one exp serves both the value and the derivative.
GDR_HOST_DEVICE void gate_softplus_and_grad(float pre, float& softplus, float& grad) {
  if (pre > kSoftplusThreshold) {
    softplus = pre;
    grad = 1.0f;
    return;
  }
  const float z = expf(pre);
  softplus = log1pf(z);
  grad = z / (z + 1.0f);
}

GDR_HOST_DEVICE float gate_reciprocal(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);  // correctly rounded: the same bits as 1.0f / x, without a divide
#else
  return 1.0f / x;
#endif
}

GDR_HOST_DEVICE float gate_sigmoid(float x) { return gate_reciprocal(1.0f + expf(-x)); }

// The same formulas in FP64, for the CPU op's Double inputs (Note [Gate FP64 on the CPU] in
// ops/pre_gdr_gate/pre_gdr_gate_op.cc); PyTorch's double softplus has the same threshold.
GDR_HOST_DEVICE double gate_softplus(double pre) {
  return pre > static_cast<double>(kSoftplusThreshold) ? pre : log1p(exp(pre));
}

GDR_HOST_DEVICE void gate_softplus_and_grad(double pre, double& softplus, double& grad) {
  if (pre > static_cast<double>(kSoftplusThreshold)) {
    softplus = pre;
    grad = 1.0;
    return;
  }
  const double z = exp(pre);
  softplus = log1p(z);
  grad = z / (z + 1.0);
}

GDR_HOST_DEVICE double gate_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

}  // namespace gdr::kernels
