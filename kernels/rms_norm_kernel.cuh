// The RMSNorm kernel bodies (device code only; contract and launch rules in
// kernels/rms_norm.h). Included by kernels/rms_norm.cu, which wraps them in __global__
// kernels, and by the CPU test //tests/ops:rms_norm_kernel_emulation_test, which supplies
// host stand-ins for the CUDA built-ins (__device__, __forceinline__, threadIdx, blockIdx,
// blockDim, __syncthreads, __shfl_xor_sync, rsqrtf, expf) and runs this very code with one
// host thread per CUDA thread, so indexing, barriers and the reduction order are checked
// on machines without a GPU. Storage conversions come from
// kernels/storage_element.cuh (a host includer specialises StorageElement for its 16-bit types).
// NOTE: keep this file free of other includes (beyond the headers it names) and of CUDA APIs beyond
// those listed: the emulation test defines exactly those.
//
// Note [RMSNorm determinism] (see also kernels/rms_norm.h)
// A row is owned by one warp: its sum of squares (forward) and its sum of dn * n
// (backward) are per-lane FP32 sums in column order followed by an xor butterfly, which
// gives every lane the same bits (a + b == b + a). dx and dz are per-element functions
// of those. The weight gradient sums over every row: each warp adds its rows' terms into
// its own shared-memory row of column sums (each column owned by one lane, rows in
// order), the block adds its warps' rows in warp order and writes one partial row per
// program (every slot written once: no zero-fill, no atomics), and reduce_partials sums
// the partial rows in program-index order. The grid comes from
// derive_rms_norm_backward_launch(rows, cols) alone, so the summation order is fixed by
// the shape: the same inputs give the same bits on every run, stream and load.
#pragma once

#include "kernels/rms_norm.h"
#include "kernels/storage_element.cuh"

namespace gdr::kernels::rms_norm_detail {

// Element offset of row `row` of `op` (row dims decoded last-fastest). Once per row per
// operand, so the integer divisions do not matter next to a row's cols elements.
__device__ __forceinline__ int64_t row_offset(const RmsNormShape& shape, const RowOperand& op,
                                              int64_t row) {
  int64_t offset = 0;
  for (int k = shape.row_dims - 1; k > 0; --k) {
    const int64_t size = shape.row_sizes[k];
    offset += (row % size) * op.row_strides[k];
    row /= size;
  }
  return offset + row * op.row_strides[0];
}

// Every lane ends with the same bits (Note [RMSNorm determinism]).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) v += __shfl_xor_sync(0xffffffffu, v, mask);
  return v;
}

// silu(z) = z / (1 + exp(-z)) and its derivative sig * (1 + z * (1 - sig)), the formulas
// of ATen's silu / silu_backward, so the fused op tracks the composite closely.
__device__ __forceinline__ void silu_and_grad(float z, float& silu, float& grad) {
  const float denom = 1.0f + expf(-z);
  const float sig = 1.0f / denom;
  silu = z / denom;
  grad = sig * (1.0f + z * (1.0f - sig));
}

// The weight-gradient accumulator of a warp is stored pack-major: column c lives at
// (c % VEC) * (cols / VEC) + c / VEC, so for a fixed k the 32 lanes touch 32 consecutive
// words (no bank conflicts). cols % VEC == 0 whenever VEC > 1 (the launcher's rule).
template <int VEC>
__device__ __forceinline__ int64_t acc_index(int64_t c, int64_t cols) {
  return (c % VEC) * (cols / VEC) + c / VEC;
}

// ----------------------------------------------------------------------------
// CUDA kernel bodies

// Forward: one row per warp, kRmsNormForwardWarps rows per block. Two passes over the
// row (sum of squares, then the output); the second reads the row again, from L1/L2.
template <typename T, typename TW, int VEC, bool kGated>
__device__ __forceinline__ void forward_row(const RmsNormForwardArgs& a) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRmsNormForwardWarps +
                      static_cast<int64_t>(threadIdx.x / 32);
  if (row >= a.shape.rows) return;  // whole warps leave together; no block barrier follows
  const int64_t cols = a.shape.cols;
  const T* x = static_cast<const T*>(a.x.data) + row_offset(a.shape, a.x, row);
  const T* z = kGated ? static_cast<const T*>(a.z.data) + row_offset(a.shape, a.z, row) : nullptr;
  const TW* w = static_cast<const TW*>(a.weight);
  T* y = static_cast<T*>(a.y) + row * cols;

  float sumsq = 0.0f;
  for (int64_t c = lane * VEC; c < cols; c += 32 * VEC) {
    float xv[VEC];
    load_floats<T, VEC>(x + c, xv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) sumsq += xv[k] * xv[k];
  }
  const float rstd = rsqrtf(warp_sum(sumsq) * (1.0f / static_cast<float>(cols)) + a.eps);
  if (lane == 0 && a.rstd != nullptr) a.rstd[row] = rstd;

  for (int64_t c = lane * VEC; c < cols; c += 32 * VEC) {
    float xv[VEC], zv[VEC], out[VEC];
    load_floats<T, VEC>(x + c, xv);
    if constexpr (kGated) load_floats<T, VEC>(z + c, zv);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const float n = xv[k] * rstd;
      const float wv = StorageElement<TW>::to_float(w[c + k]);
      if constexpr (kGated) {
        float silu, silu_grad;
        silu_and_grad(zv[k], silu, silu_grad);
        out[k] = n * wv * silu;  // (normed * w) * silu(z), the composite's order
      } else {
        out[k] = n * (wv + 1.0f);
      }
    }
    store_floats<T, VEC>(y + c, out);
  }
}

// Backward of one program (see RmsNormBackwardLaunch): per row, pass 1 forms
// mean(dn * n) with n = x * rstd and dn = dy * (1 + w) (zero-centred) or dy * w * silu(z)
// (gated); pass 2 writes dx = rstd * (dn - n * mean(dn * n)), dz = dy * n * w * silu'(z),
// and adds dy * n [* silu(z)] into the warp's column sums. `shared` holds
// warps * cols floats.
template <typename T, typename TW, int VEC, bool kGated>
__device__ __forceinline__ void backward_program(const RmsNormBackwardArgs& a,
                                                 int64_t rows_per_program, float* shared) {
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t rows = a.shape.rows;
  const int64_t cols = a.shape.cols;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  const TW* w = static_cast<const TW*>(a.weight);
  float* acc = shared + warp * cols;
  for (int64_t c = lane * VEC; c < cols; c += 32 * VEC) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) acc[acc_index<VEC>(c + k, cols)] = 0.0f;
  }

  const int64_t begin = static_cast<int64_t>(blockIdx.x) * rows_per_program;
  const int64_t end = begin + rows_per_program < rows ? begin + rows_per_program : rows;
  for (int64_t row = begin + warp; row < end; row += warps) {
    const T* x = static_cast<const T*>(a.x.data) + row_offset(a.shape, a.x, row);
    const T* dy = static_cast<const T*>(a.grad_y.data) + row_offset(a.shape, a.grad_y, row);
    const T* z = kGated ? static_cast<const T*>(a.z.data) + row_offset(a.shape, a.z, row) : nullptr;
    T* dx = static_cast<T*>(a.dx) + row * cols;
    T* dz = kGated ? static_cast<T*>(a.dz) + row * cols : nullptr;
    const float rstd = a.rstd[row];

    float dot = 0.0f;
    for (int64_t c = lane * VEC; c < cols; c += 32 * VEC) {
      float xv[VEC], gv[VEC], zv[VEC];
      load_floats<T, VEC>(x + c, xv);
      load_floats<T, VEC>(dy + c, gv);
      if constexpr (kGated) load_floats<T, VEC>(z + c, zv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float n = xv[k] * rstd;
        const float wv = StorageElement<TW>::to_float(w[c + k]);
        float dn;
        if constexpr (kGated) {
          float silu, silu_grad;
          silu_and_grad(zv[k], silu, silu_grad);
          dn = gv[k] * wv * silu;
        } else {
          dn = gv[k] * (wv + 1.0f);
        }
        dot += dn * n;
      }
    }
    const float mean_dot = warp_sum(dot) * inv_cols;

    for (int64_t c = lane * VEC; c < cols; c += 32 * VEC) {
      float xv[VEC], gv[VEC], zv[VEC], dxv[VEC], dzv[VEC];
      load_floats<T, VEC>(x + c, xv);
      load_floats<T, VEC>(dy + c, gv);
      if constexpr (kGated) load_floats<T, VEC>(z + c, zv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float n = xv[k] * rstd;
        const float wv = StorageElement<TW>::to_float(w[c + k]);
        float dn, dw_term;
        if constexpr (kGated) {
          float silu, silu_grad;
          silu_and_grad(zv[k], silu, silu_grad);
          dn = gv[k] * wv * silu;
          dzv[k] = gv[k] * n * wv * silu_grad;
          dw_term = gv[k] * n * silu;
        } else {
          dn = gv[k] * (wv + 1.0f);
          dw_term = gv[k] * n;
        }
        dxv[k] = rstd * (dn - n * mean_dot);
        acc[acc_index<VEC>(c + k, cols)] += dw_term;
      }
      store_floats<T, VEC>(dx + c, dxv);
      if constexpr (kGated) store_floats<T, VEC>(dz + c, dzv);
    }
  }

  __syncthreads();
  float* partial = a.partials + static_cast<int64_t>(blockIdx.x) * cols;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const int64_t i = acc_index<VEC>(c, cols);
    float sum = shared[i];
    for (int v = 1; v < warps; ++v) sum += shared[v * cols + i];
    partial[c] = sum;
  }
}

// The ordered second pass over kRmsNormReduceCols columns of the partial rows; `shared`
// holds kRmsNormReduceSlices * kRmsNormReduceCols floats.
template <typename TW>
__device__ __forceinline__ void reduce_partials_block(const float* partials, int64_t programs,
                                                      int64_t cols, TW* dw, float* shared) {
  const int lane = static_cast<int>(threadIdx.x % kRmsNormReduceCols);
  const int slice = static_cast<int>(threadIdx.x / kRmsNormReduceCols);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kRmsNormReduceCols + lane;
  float sum = 0.0f;
  if (c < cols) {
    for (int64_t p = slice; p < programs; p += kRmsNormReduceSlices) sum += partials[p * cols + c];
  }
  shared[slice * kRmsNormReduceCols + lane] = sum;
  __syncthreads();
  if (slice == 0 && c < cols) {
    float total = shared[lane];
    for (int s = 1; s < kRmsNormReduceSlices; ++s) total += shared[s * kRmsNormReduceCols + lane];
    dw[c] = StorageElement<TW>::from_float(total);
  }
}

}  // namespace gdr::kernels::rms_norm_detail
