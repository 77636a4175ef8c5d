// Per-element math of the pre-GDR gate kernels (device code, no torch): the softplus and
// sigmoid in select form, the backward of one element, and the backward of four adjacent
// heads with the fast paths of the correctly rounded reciprocal and division taken
// together (Note [Gate backward fast paths]). Shared by kernels/pre_gdr_gate/pre_gdr_gate.cu and
// the exhaustive check in kernels/pre_gdr_gate/pre_gdr_gate_element_check.cu, which proves the two
// backward forms give the same bits for every input.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/pre_gdr_gate/pre_gdr_gate_math.h"

namespace gdr::kernels {

// softplus with the threshold as a select rather than a branch around log1pf: the same
// calls in the same order (so the same bits as gate_softplus), without the per-element
// branch bookkeeping. log1pf(expf(pre)) above the threshold is computed and discarded.
__device__ __forceinline__ float gate_softplus_select(float pre) {
  const float sp = log1pf(expf(pre));
  return pre > kSoftplusThreshold ? pre : sp;
}

// gate_softplus_and_grad in the same select form: the same calls (one expf, log1pf, and
// z / (z + 1)) and so the same bits below the threshold, pre and 1 above it.
__device__ __forceinline__ void gate_softplus_and_grad_select(float pre, float& softplus,
                                                              float& grad) {
  const float z = expf(pre);
  const float sp = log1pf(z);
  const float gr = z / (z + 1.0f);
  const bool above = pre > kSoftplusThreshold;
  softplus = above ? pre : sp;
  grad = above ? 1.0f : gr;
}

// The per-element backward: da, db and the two per-head terms, added to the sums. The
// reference form: every other form must give its bits.
__device__ __forceinline__ void gate_backward_element(float a, float b, float dg, float dbeta,
                                                      float neg_exp_A, float dt, float& da,
                                                      float& db, float& sum_A_log,
                                                      float& sum_dt_bias) {
  float softplus, softplus_grad;
  gate_softplus_and_grad_select(a + dt, softplus, softplus_grad);
  const float g = neg_exp_A * softplus;
  const float da_value = dg * (neg_exp_A * softplus_grad);
  const float beta = gate_sigmoid(b);
  da = da_value;
  db = dbeta * beta * (1.0f - beta);
  sum_A_log += dg * g;
  sum_dt_bias += da_value;
}

// Note [Gate backward fast paths]: the BF16 backward is bound by instruction issue, not by
// memory (profiled: docs/benchmarks.md, Pre-GDR gate), and per element it computes a
// correctly rounded reciprocal (the sigmoid of b) and a correctly rounded division
// (z / (z + 1), softplus' derivative). nvcc expands each into a short fast path (an
// approximate reciprocal and two or four FMAs) guarded by a range test, with a branch to a
// slow path around it: the test, the branch and the convergence-barrier bookkeeping cost
// about as much as the fast path itself, per element. gate_backward_elements4 computes the
// fast paths of four elements, tests all their ranges at once, and only if one fails
// recomputes all four with the IEEE operations. Within the tested ranges the fast paths
// give the IEEE bits:
// - reciprocal: the same instructions nvcc emits for __frcp_rn on sm_90 (MUFU.RCP, one
//   Newton step as FFMA, negation, FFMA), under the same test it emits (biased exponent
//   in [1, 252]);
// - division: the FMA sequence nvcc emits for a correctly rounded x / d (reciprocal, one
//   Newton step, quotient, remainder, corrected quotient), under a stricter test than
//   its FCHK: x = 0 or x in [2^-60, 2^60], with d = x + 1, so no operand, remainder or
//   quotient is subnormal or near overflow.
// kernels/pre_gdr_gate/pre_gdr_gate_element_check.cu checks this by exhaustion on the GPU (every
// float input of each fast path, and of the whole four-element form against
// gate_backward_element): //tests/ops:pre_gdr_gate_element_gpu_test.
__device__ __forceinline__ bool reciprocal_fast_path_exact(float x) {
  // (biased exponent + 3) mod 256 >= 4, i.e. the biased exponent is in [1, 252].
  return ((__float_as_uint(x) + 0x01800000u) & 0x7f800000u) > 0x01ffffffu;
}

// MUFU.RCP: the approximate reciprocal both fast paths start from.
__device__ __forceinline__ float approximate_reciprocal(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ float reciprocal_fast_path(float x) {
  const float r = approximate_reciprocal(x);
  const float error = fmaf(x, r, -1.0f);
  return fmaf(r, -error, r);
}

__device__ __forceinline__ bool quotient_over_successor_fast_path_exact(float x) {
  return x == 0.0f || (x >= 0x1p-60f && x <= 0x1p60f);
}

// x / d, for d = x + 1 (the caller's), within quotient_over_successor_fast_path_exact.
__device__ __forceinline__ float division_fast_path(float x, float d) {
  float r = approximate_reciprocal(d);
  r = fmaf(r, fmaf(-d, r, 1.0f), r);
  const float q = fmaf(x, r, 0.0f);
  const float remainder = fmaf(-d, q, x);
  return fmaf(r, remainder, q);
}

// Four elements (adjacent heads of one token) of gate_backward_element, bit for bit.
__device__ __forceinline__ void gate_backward_elements4(
    const float (&a)[4], const float (&b)[4], const float (&dg)[4], const float (&dbeta)[4],
    const float (&neg_exp_A)[4], const float (&dt)[4], float (&da)[4], float (&db)[4],
    float (&sum_A_log)[4], float (&sum_dt_bias)[4]) {
  float pre[4], z[4], softplus_raw[4], grad_raw[4], sigmoid_denominator[4], beta[4];
  bool fast = true;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    pre[j] = a[j] + dt[j];
    z[j] = expf(pre[j]);
    softplus_raw[j] = log1pf(z[j]);
    // Above the threshold the quotient is discarded, so its range does not matter.
    fast &= quotient_over_successor_fast_path_exact(z[j]) || pre[j] > kSoftplusThreshold;
    grad_raw[j] = division_fast_path(z[j], z[j] + 1.0f);
    sigmoid_denominator[j] = 1.0f + expf(-b[j]);
    fast &= reciprocal_fast_path_exact(sigmoid_denominator[j]);
    beta[j] = reciprocal_fast_path(sigmoid_denominator[j]);
  }
  if (!fast) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      grad_raw[j] = z[j] / (z[j] + 1.0f);
      beta[j] = gate_reciprocal(sigmoid_denominator[j]);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const bool above = pre[j] > kSoftplusThreshold;
    const float softplus = above ? pre[j] : softplus_raw[j];
    const float softplus_grad = above ? 1.0f : grad_raw[j];
    const float g = neg_exp_A[j] * softplus;
    const float da_value = dg[j] * (neg_exp_A[j] * softplus_grad);
    da[j] = da_value;
    db[j] = dbeta[j] * beta[j] * (1.0f - beta[j]);
    sum_A_log[j] += dg[j] * g;
    sum_dt_bias[j] += da_value;
  }
}

}  // namespace gdr::kernels
