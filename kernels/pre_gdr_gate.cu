// CUDA kernels of the pre-GDR gate (forward, backward, ordered partial reduction).
//
// Why two reduction modes: the backward sums dg * g and da over every token of the batch
// into per-head A_log / dt_bias gradients. Atomics make that one cheap pass, but the
// order of the float additions then depends on block scheduling, so bits change from run
// to run. The ordered mode writes one FP32 partial row per token-program instead (every
// slot written exactly once: no atomics, no zero-fill) and a second kernel on the same
// stream sums the rows in an order fixed by the row count alone.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/pre_gdr_gate.h"
#include "kernels/pre_gdr_gate_math.h"

namespace gdr::kernels {
namespace {

__device__ __forceinline__ float load_as_float(const float* p) { return __ldg(p); }
__device__ __forceinline__ float load_as_float(const __half* p) { return __half2float(__ldg(p)); }
__device__ __forceinline__ float load_as_float(const __nv_bfloat16* p) {
  return __bfloat162float(__ldg(p));
}

__device__ __forceinline__ void store_from_float(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_from_float(__half* p, float v) { *p = __float2half_rn(v); }
__device__ __forceinline__ void store_from_float(__nv_bfloat16* p, float v) {
  *p = __float2bfloat16_rn(v);
}

// Token index -> element offset of a strided [dim0, dim1, heads] operand. Index is 32-bit
// when the whole problem fits, since 64-bit division costs several times more.
template <typename Index>
struct TokenDecoder {
  Index dim1;
  __device__ __forceinline__ void split(Index token, Index& i0, Index& i1) const {
    i0 = token / dim1;
    i1 = token - i0 * dim1;
  }
};

__device__ __forceinline__ int64_t strided_offset(const StridedOperand& op, int64_t i0,
                                                  int64_t i1, int64_t h) {
  return i0 * op.stride0 + i1 * op.stride1 + h * op.stride_h;
}

// ----------------------------------------------------------------------------
// CUDA kernels

constexpr int kForwardItemsPerThread = 4;
constexpr int kForwardThreads = 256;

template <typename In, typename Param, typename Index>
__global__ void __launch_bounds__(kForwardThreads)
    gate_forward_kernel(GateForwardArgs args, Index total, Index heads, TokenDecoder<Index> dec) {
  const In* a = static_cast<const In*>(args.a.data);
  const In* b = static_cast<const In*>(args.b.data);
  const Param* A_log = static_cast<const Param*>(args.A_log);
  const Param* dt_bias = static_cast<const Param*>(args.dt_bias);
  const Index base = static_cast<Index>(blockIdx.x) * (kForwardThreads * kForwardItemsPerThread) +
                     threadIdx.x;
#pragma unroll
  for (int item = 0; item < kForwardItemsPerThread; ++item) {
    const Index e = base + item * kForwardThreads;
    if (e >= total) return;
    const Index token = e / heads;
    const Index h = e - token * heads;
    Index i0, i1;
    dec.split(token, i0, i1);
    const float pre = load_as_float(a + strided_offset(args.a, i0, i1, h)) +
                      load_as_float(dt_bias + h);
    args.g[e] = -expf(load_as_float(A_log + h)) * gate_softplus(pre);
    args.beta[e] = gate_sigmoid(load_as_float(b + strided_offset(args.b, i0, i1, h)));
  }
}

// One program = block_t tokens x block_h heads. Thread (row, lane) owns head
// blockIdx.y * block_h + lane and walks tokens row, row + rows, ... of the tile, keeping
// its two per-head sums in registers; the rows are then combined in shared memory in row
// order (a fixed order, so the in-block sum is reproducible in both modes).
template <typename In, typename Param, typename Index, bool kOrdered>
__global__ void gate_backward_kernel(GateBackwardArgs args, Index tokens, Index heads,
                                     TokenDecoder<Index> dec, int block_t, int block_h,
                                     float* out) {
  extern __shared__ float row_sums[];  // [2][rows][block_h]
  const In* a = static_cast<const In*>(args.a.data);
  const In* b = static_cast<const In*>(args.b.data);
  const float* grad_g = static_cast<const float*>(args.grad_g.data);
  const float* grad_beta = static_cast<const float*>(args.grad_beta.data);
  In* da = static_cast<In*>(args.da);
  In* db = static_cast<In*>(args.db);

  const int rows = blockDim.x / block_h;
  const int lane = threadIdx.x % block_h;
  const int row = threadIdx.x / block_h;
  const Index h = static_cast<Index>(blockIdx.y) * block_h + lane;
  const Index t_begin = static_cast<Index>(blockIdx.x) * block_t;
  const Index t_end = min(t_begin + static_cast<Index>(block_t), tokens);

  float sum_A_log = 0.0f;
  float sum_dt_bias = 0.0f;
  if (h < heads) {
    const float neg_exp_A = -expf(load_as_float(static_cast<const Param*>(args.A_log) + h));
    const float dt = load_as_float(static_cast<const Param*>(args.dt_bias) + h);
#pragma unroll 4
    for (Index t = t_begin + row; t < t_end; t += rows) {
      Index i0, i1;
      dec.split(t, i0, i1);
      const float pre = load_as_float(a + strided_offset(args.a, i0, i1, h)) + dt;
      const float dg = load_as_float(grad_g + strided_offset(args.grad_g, i0, i1, h));
      const float dbeta = load_as_float(grad_beta + strided_offset(args.grad_beta, i0, i1, h));
      const float beta = gate_sigmoid(load_as_float(b + strided_offset(args.b, i0, i1, h)));
      const float g = neg_exp_A * gate_softplus(pre);
      const float da_value = dg * (neg_exp_A * gate_softplus_grad(pre));
      const Index e = t * heads + h;
      store_from_float(da + e, da_value);
      store_from_float(db + e, dbeta * beta * (1.0f - beta));
      sum_A_log += dg * g;
      sum_dt_bias += da_value;
    }
  }
  row_sums[row * block_h + lane] = sum_A_log;
  row_sums[(rows + row) * block_h + lane] = sum_dt_bias;
  __syncthreads();
  if (row != 0 || h >= heads) return;
  float total_A_log = 0.0f;
  float total_dt_bias = 0.0f;
  for (int r = 0; r < rows; ++r) {
    total_A_log += row_sums[r * block_h + lane];
    total_dt_bias += row_sums[(rows + r) * block_h + lane];
  }
  if constexpr (kOrdered) {
    float* partial_row = out + static_cast<int64_t>(blockIdx.x) * 2 * heads;
    partial_row[h] = total_A_log;
    partial_row[heads + h] = total_dt_bias;
  } else {
    atomicAdd(out + h, total_A_log);
    atomicAdd(out + heads + h, total_dt_bias);
  }
}

// Ordered pass: block (kReduceSlotsPerBlock lanes x kReduceRows rows). Lane = one of the
// 2 * heads output slots (coalesced across a warp); row r sums partial rows r, r + R,
// r + 2R, ... sequentially; then row 0 adds the R row sums in row order. The order
// depends on programs_t only, never on scheduling.
template <typename Param>
__global__ void __launch_bounds__(kReduceSlotsPerBlock* kReduceRows)
    gate_reduce_partials_kernel(const float* partials, int64_t programs_t, int64_t heads,
                                Param* dA_log, Param* ddt_bias) {
  __shared__ float sums[kReduceRows][kReduceSlotsPerBlock];
  const int lane = threadIdx.x % kReduceSlotsPerBlock;
  const int row = threadIdx.x / kReduceSlotsPerBlock;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kReduceSlotsPerBlock + lane;
  const int64_t slots = 2 * heads;
  float acc = 0.0f;
  if (slot < slots) {
#pragma unroll 8
    for (int64_t p = row; p < programs_t; p += kReduceRows) acc += __ldg(partials + p * slots + slot);
  }
  sums[row][lane] = acc;
  __syncthreads();
  if (row != 0 || slot >= slots) return;
  float total = 0.0f;
  for (int r = 0; r < kReduceRows; ++r) total += sums[r][lane];
  if (slot < heads) {
    store_from_float(dA_log + slot, total);
  } else {
    store_from_float(ddt_bias + (slot - heads), total);
  }
}

// ----------------------------------------------------------------------------
// kernel launchers

template <typename Fn>
void dispatch_kind(ScalarKind kind, Fn&& fn) {
  switch (kind) {
    case ScalarKind::kFloat32: fn(float{}); break;
    case ScalarKind::kFloat16: fn(__half{}); break;
    case ScalarKind::kBFloat16: fn(__nv_bfloat16{}); break;
  }
}

bool fits_int32(const GateShape& shape) {
  return shape.tokens() * shape.heads < (int64_t{1} << 31) - (int64_t{1} << 20);
}

}  // namespace

int launch_pre_gdr_gate_forward(const GateForwardArgs& args, CUstream_st* stream) {
  const int64_t total = args.shape.tokens() * args.shape.heads;
  if (total == 0) return cudaSuccess;
  const int64_t per_block = kForwardThreads * kForwardItemsPerThread;
  const dim3 grid(static_cast<unsigned>((total + per_block - 1) / per_block));
  dispatch_kind(args.input_kind, [&](auto in_tag) {
    dispatch_kind(args.param_kind, [&](auto param_tag) {
      using In = decltype(in_tag);
      using Param = decltype(param_tag);
      if (fits_int32(args.shape)) {
        gate_forward_kernel<In, Param, int32_t><<<grid, kForwardThreads, 0, stream>>>(
            args, static_cast<int32_t>(total), static_cast<int32_t>(args.shape.heads),
            TokenDecoder<int32_t>{static_cast<int32_t>(args.shape.dim1)});
      } else {
        gate_forward_kernel<In, Param, int64_t><<<grid, kForwardThreads, 0, stream>>>(
            args, total, args.shape.heads, TokenDecoder<int64_t>{args.shape.dim1});
      }
    });
  });
  return cudaGetLastError();
}

int launch_pre_gdr_gate_backward(const GateBackwardArgs& args, const GateTile& tile,
                                 GateReduction reduction, float* out, CUstream_st* stream) {
  if (args.shape.tokens() == 0 || args.shape.heads == 0) return cudaSuccess;
  const GateBackwardLaunch launch = derive_gate_backward_launch(tile, args.shape);
  const dim3 grid(static_cast<unsigned>(launch.programs_t), static_cast<unsigned>(launch.programs_h));
  const size_t shared = static_cast<size_t>(launch.shared_bytes);
  dispatch_kind(args.input_kind, [&](auto in_tag) {
    dispatch_kind(args.param_kind, [&](auto param_tag) {
      using In = decltype(in_tag);
      using Param = decltype(param_tag);
      auto go = [&](auto index_tag, auto ordered_tag) {
        using Index = decltype(index_tag);
        constexpr bool kOrdered = decltype(ordered_tag)::value;
        gate_backward_kernel<In, Param, Index, kOrdered><<<grid, tile.threads, shared, stream>>>(
            args, static_cast<Index>(args.shape.tokens()), static_cast<Index>(args.shape.heads),
            TokenDecoder<Index>{static_cast<Index>(args.shape.dim1)}, tile.block_t, tile.block_h,
            out);
      };
      const bool ordered = reduction == GateReduction::kOrdered;
      if (fits_int32(args.shape)) {
        ordered ? go(int32_t{}, std::true_type{}) : go(int32_t{}, std::false_type{});
      } else {
        ordered ? go(int64_t{}, std::true_type{}) : go(int64_t{}, std::false_type{});
      }
    });
  });
  return cudaGetLastError();
}

int launch_pre_gdr_gate_reduce_partials(const float* partials, int64_t programs_t,
                                        int64_t heads, ScalarKind param_kind, void* dA_log,
                                        void* ddt_bias, CUstream_st* stream) {
  if (heads == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((2 * heads + kReduceSlotsPerBlock - 1) / kReduceSlotsPerBlock));
  dispatch_kind(param_kind, [&](auto param_tag) {
    using Param = decltype(param_tag);
    gate_reduce_partials_kernel<Param><<<grid, kReduceSlotsPerBlock * kReduceRows, 0, stream>>>(
        partials, programs_t, heads, static_cast<Param*>(dA_log), static_cast<Param*>(ddt_bias));
  });
  return cudaGetLastError();
}

}  // namespace gdr::kernels
