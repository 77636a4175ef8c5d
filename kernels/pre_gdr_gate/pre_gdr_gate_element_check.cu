// Exhaustive check of See Note [Gate backward fast paths]: a grid-stride pass over every 32-bit
// pattern, each thread counting its checks and mismatches; per-warp totals are written
// once each (no atomics) and summed on the host.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "kernels/pre_gdr_gate/pre_gdr_gate_element.cuh"
#include "kernels/pre_gdr_gate/pre_gdr_gate_element_check.h"

namespace gdr::kernels {
namespace {

constexpr int kCounters = 6;
constexpr int kThreads = 256;
constexpr int kBlocks = 132 * 16;

__device__ __forceinline__ bool same_bits(float x, float y) {
  return __float_as_uint(x) == __float_as_uint(y);
}

// Bijections of the 32-bit patterns, so every lane sees every float once.
__device__ __forceinline__ float remix(uint32_t u, int lane) {
  const uint32_t mixed = lane == 0 ? u : (u ^ (0x9e3779b9u * static_cast<uint32_t>(lane)));
  return __uint_as_float(__funnelshift_l(mixed, mixed, 7 * lane));
}

__global__ void __launch_bounds__(kThreads) element_check_kernel(unsigned long long* per_warp) {
  uint32_t counts[kCounters] = {0, 0, 0, 0, 0, 0};
  const uint64_t stride = uint64_t{kBlocks} * kThreads;
  for (uint64_t i = uint64_t{blockIdx.x} * kThreads + threadIdx.x; i < (uint64_t{1} << 32);
       i += stride) {
    const uint32_t u = static_cast<uint32_t>(i);
    const float x = __uint_as_float(u);
    if (reciprocal_fast_path_exact(x)) {
      ++counts[0];
      counts[1] += same_bits(reciprocal_fast_path(x), __frcp_rn(x)) ? 0 : 1;
    }
    if (!(x > kSoftplusThreshold)) {
      const float z = expf(x);
      if (quotient_over_successor_fast_path_exact(z)) {
        ++counts[2];
        counts[3] += same_bits(division_fast_path(z, z + 1.0f), z / (z + 1.0f)) ? 0 : 1;
      }
    }
    float a[4], b[4], dg[4], dbeta[4], neg_exp_A[4], dt[4];
    float da[4], db[4], sum_A_log[4], sum_dt_bias[4];
    for (int j = 0; j < 4; ++j) {
      a[j] = remix(u, j);
      b[j] = remix(~u, j);
      dg[j] = 0.75f - 0.5f * j;
      dbeta[j] = -1.25f + 0.5f * j;
      neg_exp_A[j] = -0.375f * (j + 1);
      dt[j] = 0.125f * j;
      sum_A_log[j] = 0.5f;
      sum_dt_bias[j] = -0.5f;
    }
    gate_backward_elements4(a, b, dg, dbeta, neg_exp_A, dt, da, db, sum_A_log, sum_dt_bias);
    bool all_same = true;
    for (int j = 0; j < 4; ++j) {
      float ref_da, ref_db, ref_sum_A_log = 0.5f, ref_sum_dt_bias = -0.5f;
      gate_backward_element(a[j], b[j], dg[j], dbeta[j], neg_exp_A[j], dt[j], ref_da, ref_db,
                            ref_sum_A_log, ref_sum_dt_bias);
      all_same &= same_bits(da[j], ref_da) && same_bits(db[j], ref_db) &&
                  same_bits(sum_A_log[j], ref_sum_A_log) &&
                  same_bits(sum_dt_bias[j], ref_sum_dt_bias);
    }
    ++counts[4];
    counts[5] += all_same ? 0 : 1;
  }
  const int warp = (blockIdx.x * kThreads + threadIdx.x) / 32;
  for (int c = 0; c < kCounters; ++c) {
    const unsigned warp_total = __reduce_add_sync(0xffffffffu, counts[c]);
    if (threadIdx.x % 32 == 0) per_warp[warp * kCounters + c] = warp_total;
  }
}

}  // namespace

int check_pre_gdr_gate_element_fast_paths(GateElementCheckCounts* counts) {
  constexpr int kWarps = kBlocks * kThreads / 32;
  unsigned long long* per_warp = nullptr;
  cudaError_t error = cudaMalloc(&per_warp, sizeof(unsigned long long) * kWarps * kCounters);
  if (error != cudaSuccess) return error;
  element_check_kernel<<<kBlocks, kThreads>>>(per_warp);
  error = cudaGetLastError();
  std::vector<unsigned long long> host(static_cast<size_t>(kWarps) * kCounters);
  if (error == cudaSuccess) {
    error = cudaMemcpy(host.data(), per_warp, host.size() * sizeof(unsigned long long),
                       cudaMemcpyDeviceToHost);
  }
  cudaFree(per_warp);
  if (error != cudaSuccess) return error;
  uint64_t totals[kCounters] = {0, 0, 0, 0, 0, 0};
  for (int w = 0; w < kWarps; ++w) {
    for (int c = 0; c < kCounters; ++c) totals[c] += host[static_cast<size_t>(w) * kCounters + c];
  }
  counts->reciprocal_checked = totals[0];
  counts->reciprocal_mismatches = totals[1];
  counts->division_checked = totals[2];
  counts->division_mismatches = totals[3];
  counts->element_checked = totals[4];
  counts->element_mismatches = totals[5];
  return cudaSuccess;
}

}  // namespace gdr::kernels
