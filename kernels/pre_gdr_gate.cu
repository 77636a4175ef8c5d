// CUDA kernels of the pre-GDR gate (forward, backward, ordered partial reduction): the
// __global__ wrappers around the bodies in kernels/pre_gdr_gate_kernel.cuh and their
// launchers.
//
// Why two reduction modes: the backward sums dg * g and da over every token of the batch
// into per-head A_log / dt_bias gradients. Atomics make that one cheap pass, but the
// order of the float additions then depends on block scheduling, so bits change from run
// to run. The ordered mode writes one FP32 partial row per token-program instead (every
// slot written exactly once: no atomics, no zero-fill) and a second kernel on the same
// stream sums the rows in an order fixed by the row count alone. Inside a program both
// modes sum in the same fixed order (Note [Gate head vectors]); only the emission differs,
// and the atomics of the default mode are here, in gate_backward_kernel, not in the .cuh.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kernels/pre_gdr_gate.h"

namespace gdr::kernels {

// The primitives kernels/pre_gdr_gate_kernel.cuh expects (see its NOTE).
__device__ __forceinline__ float gate_fast_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ unsigned gate_pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
__device__ __forceinline__ unsigned gate_pack_half2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}
__device__ __forceinline__ float gate_half_to_float(unsigned bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
}

}  // namespace gdr::kernels

#include "kernels/pre_gdr_gate_kernel.cuh"

namespace gdr::kernels {
namespace {

using gate_detail::Bf16;
using gate_detail::Half;

// ----------------------------------------------------------------------------
// CUDA kernels

// No min-blocks hint: capping registers for full occupancy made the previous forward 35%
// slower on the H200; with 16-byte loads a quarter of the threads keep enough bytes in
// flight.
template <typename In, int V, bool kSplit>
__global__ void __launch_bounds__(kForwardThreads) gate_forward_kernel(GateForwardPlan plan) {
  __shared__ float table[2 * kForwardTableHeads];
  gate_detail::gate_forward_block<In, V, kSplit>(plan, table);
}

// Note [Single-pass ordered reduction]: in kOrderedSinglePass mode every program writes
// its partial row, then takes a ticket from an unsigned counter; the program that draws
// the last ticket sums all partial rows itself (slot lanes of 32 x blockDim.x / 32 rows,
// each row sequential over programs row, row + R, ...; rows then added in order) and
// resets the counter to 0 for the next launch on its stream. The integer ticket only
// elects who sums; it carries no data, so the float sums have one fixed order (a pure
// function of programs_t and the tile) whatever the scheduling. It saves the second
// launch of the two-pass variant.
constexpr int kSinglePassMaxGroups = 4;  // 2 * heads <= 32 * 4 slots
static_assert(kSinglePassMaxGroups * 32 == 2 * kSinglePassMaxHeads, "keep in sync");

template <typename In, int V, bool kSplit, GateReduction kMode>
__global__ void gate_backward_kernel(GateBackwardPlan plan, float* out, unsigned int* ticket,
                                     void* dA_log, void* ddt_bias) {
  extern __shared__ float smem[];
  __shared__ bool is_last_program;
  float total_A_log[V], total_dt_bias[V];
  int h0 = 0;
  const int64_t heads = plan.heads;
  if (gate_detail::gate_backward_program<In, V, kSplit>(plan, smem, total_A_log, total_dt_bias,
                                                        h0)) {
    if constexpr (kMode == GateReduction::kAtomic) {
#pragma unroll
      for (int j = 0; j < V; ++j) {
        atomicAdd(out + h0 + j, total_A_log[j]);
        atomicAdd(out + heads + h0 + j, total_dt_bias[j]);
      }
    } else {
      gate_detail::gate_write_partial_row<V>(out, plan, h0, total_A_log, total_dt_bias);
    }
  }
  if constexpr (kMode == GateReduction::kOrderedSinglePass) {
    // See Note [Single-pass ordered reduction]. blockDim.x is a multiple of 32.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
      const unsigned int programs = gridDim.x;
      is_last_program = atomicAdd(ticket, 1u) == programs - 1;
    }
    __syncthreads();
    if (!is_last_program) return;
    __threadfence();
    float* row_sums = smem;
    const int slot_lane = threadIdx.x % 32;
    const int slot_row = threadIdx.x / 32;
    const int slot_rows = blockDim.x / 32;
    const int64_t slots = 2 * heads;
    const int64_t programs_t = plan.launch.programs_t;
    float acc[kSinglePassMaxGroups];
#pragma unroll
    for (int group = 0; group < kSinglePassMaxGroups; ++group) acc[group] = 0.0f;
    for (int64_t p = slot_row; p < programs_t; p += slot_rows) {
#pragma unroll
      for (int group = 0; group < kSinglePassMaxGroups; ++group) {
        const int64_t slot = group * 32 + slot_lane;
        if (slot < slots) acc[group] += __ldcg(out + p * slots + slot);
      }
    }
#pragma unroll
    for (int group = 0; group < kSinglePassMaxGroups; ++group) {
      row_sums[slot_row * 32 + slot_lane] = acc[group];
      __syncthreads();
      const int64_t slot = group * 32 + slot_lane;
      if (slot_row == 0 && slot < slots) {
        float total = 0.0f;
        for (int r = 0; r < slot_rows; ++r) total += row_sums[r * 32 + slot_lane];
        if (slot < heads) {
          gate_detail::store_param(dA_log, plan.param_kind, slot, total);
        } else {
          gate_detail::store_param(ddt_bias, plan.param_kind, slot - heads, total);
        }
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) *ticket = 0u;
  }
}

__global__ void __launch_bounds__(kReduceSlotsPerBlock* kReduceRows)
    gate_reduce_partials_kernel(const float* partials, int64_t programs_t, int64_t heads,
                                ScalarKind param_kind, void* dA_log, void* ddt_bias) {
  __shared__ float sums[kReduceRows * kReduceSlotsPerBlock];
  gate_detail::gate_reduce_partials_block(partials, programs_t, heads, param_kind, dA_log, ddt_bias,
                                          sums);
}

// ----------------------------------------------------------------------------
// kernel launchers

template <typename Fn>
void dispatch_input(ScalarKind kind, Fn&& fn) {
  switch (kind) {
    case ScalarKind::kFloat32: fn(float{}); break;
    case ScalarKind::kFloat16: fn(Half{}); break;
    case ScalarKind::kBFloat16: fn(Bf16{}); break;
  }
}

template <typename Fn>
void dispatch_vec(int vec, Fn&& fn) {
  switch (vec) {
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    default: fn(std::integral_constant<int, 1>{}); break;
  }
}

}  // namespace

int launch_pre_gdr_gate_forward(const GateForwardArgs& args, CUstream_st* stream) {
  if (args.shape.tokens() == 0 || args.shape.heads == 0) return cudaSuccess;
  const GateForwardPlan plan = plan_gate_forward(args);
  const dim3 grid(static_cast<unsigned>(plan.grid));
  const unsigned threads = static_cast<unsigned>(plan.block_x * plan.block_y);
  dispatch_input(plan.input_kind, [&](auto in_tag) {
    dispatch_vec(plan.vec, [&](auto vec_tag) {
      using In = decltype(in_tag);
      constexpr int V = decltype(vec_tag)::value;
      auto kernel =
          plan.split ? gate_forward_kernel<In, V, true> : gate_forward_kernel<In, V, false>;
      kernel<<<grid, threads, 0, stream>>>(plan);
    });
  });
  return cudaGetLastError();
}

int launch_pre_gdr_gate_backward(const GateBackwardArgs& args, const GateTile& tile,
                                 GateReduction reduction, float* out, CUstream_st* stream) {
  if (args.shape.tokens() == 0 || args.shape.heads == 0) return cudaSuccess;
  const GateBackwardPlan plan = plan_gate_backward(args, tile);
  const GateBackwardLaunch& launch = plan.launch;
  const dim3 grid(static_cast<unsigned>(launch.num_programs()));
  const size_t shared = static_cast<size_t>(launch.shared_bytes);
  dispatch_input(plan.input_kind, [&](auto in_tag) {
    dispatch_vec(launch.vec, [&](auto vec_tag) {
      using In = decltype(in_tag);
      constexpr int V = decltype(vec_tag)::value;
      auto go = [&](auto mode_tag) {
        constexpr GateReduction kMode = decltype(mode_tag)::value;
        auto kernel = plan.split ? gate_backward_kernel<In, V, true, kMode>
                                 : gate_backward_kernel<In, V, false, kMode>;
        kernel<<<grid, launch.threads, shared, stream>>>(plan, out, args.ticket, args.dA_log,
                                                         args.ddt_bias);
      };
      switch (reduction) {
        case GateReduction::kAtomic:
          go(std::integral_constant<GateReduction, GateReduction::kAtomic>{});
          break;
        case GateReduction::kOrdered:
          go(std::integral_constant<GateReduction, GateReduction::kOrdered>{});
          break;
        case GateReduction::kOrderedSinglePass:
          go(std::integral_constant<GateReduction, GateReduction::kOrderedSinglePass>{});
          break;
      }
    });
  });
  return cudaGetLastError();
}

int launch_pre_gdr_gate_reduce_partials(const float* partials, int64_t programs_t, int64_t heads,
                                        ScalarKind param_kind, void* dA_log, void* ddt_bias,
                                        CUstream_st* stream) {
  if (heads == 0) return cudaSuccess;
  const dim3 grid(
      static_cast<unsigned>((2 * heads + kReduceSlotsPerBlock - 1) / kReduceSlotsPerBlock));
  gate_reduce_partials_kernel<<<grid, kReduceSlotsPerBlock * kReduceRows, 0, stream>>>(
      partials, programs_t, heads, param_kind, dA_log, ddt_bias);
  return cudaGetLastError();
}

}  // namespace gdr::kernels
