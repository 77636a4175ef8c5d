// The RMSNorm kernel bodies (device code only; contract and launch rules in
// kernels/rms_norm/rms_norm.h). Included by kernels/rms_norm/rms_norm.cu, which wraps them in
// __global__ kernels, and by the CPU test //tests/ops:rms_norm_kernel_emulation_test, which
// supplies host stand-ins for the CUDA built-ins (__device__, __forceinline__, threadIdx, blockIdx,
// blockDim, __syncthreads, __shfl_xor_sync, rsqrtf, expf) and runs this very code with one
// host thread per CUDA thread, so indexing, barriers and the reduction order are checked
// on machines without a GPU. Storage conversions come from
// kernels/common/storage_element.cuh (a host includer specialises StorageElement for its 16-bit
// types). NOTE: keep this file free of other includes (beyond the headers it names) and of CUDA
// APIs beyond those listed: the emulation test defines exactly those.
//
// Note [RMSNorm determinism] (see also kernels/rms_norm/rms_norm.h)
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

#include "kernels/common/storage_element.cuh"
#include "kernels/rms_norm/rms_norm.h"

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

// The same offsets as row_offset for several operands of one row, with the divisions by
// the row sizes done once per row rather than once per operand, in 32 bits when the
// values allow (a 64-bit division is a long subroutine, not free next to the few elements
// a lane has at cols = 128; the model's norms pass 2-3 row dims), and no dynamically
// indexed arrays (those would live in local memory).
struct RowIndex {
  int64_t idx[kRmsNormMaxRowDims];
};

__device__ __forceinline__ RowIndex row_index(const RmsNormShape& shape, int64_t row) {
  RowIndex r;
#pragma unroll
  for (int k = kRmsNormMaxRowDims - 1; k > 0; --k) {
    r.idx[k] = 0;
    if (k < shape.row_dims) {
      const int64_t size = shape.row_sizes[k];
      if (((row | size) >> 32) == 0) {
        const uint32_t row32 = static_cast<uint32_t>(row), size32 = static_cast<uint32_t>(size);
        r.idx[k] = row32 % size32;
        row = row32 / size32;
      } else {
        r.idx[k] = row % size;
        row /= size;
      }
    }
  }
  r.idx[0] = row;
  return r;
}

__device__ __forceinline__ int64_t operand_offset(const RowIndex& r, const RowOperand& op,
                                                  int row_dims) {
  int64_t offset = 0;
#pragma unroll
  for (int k = kRmsNormMaxRowDims - 1; k > 0; --k) {
    if (k < row_dims) offset += r.idx[k] * op.row_strides[k];
  }
  return offset + r.idx[0] * op.row_strides[0];
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

// Note [RMSNorm with the residual add]
// The model's pre-norm residual stream is h = x + r followed by norm(h), and in the
// backward autograd adds the norm's dx to the stream's own gradient: two extra elementwise
// passes (and kernel launches) per norm. With a residual operand the zero-centred kernels
// do both in the norm's pass, with the composite's bits: the sum is one FP32 add of the
// widened operands rounded to the storage type (ATen's add of two tensors of that type,
// alpha = 1), and it is that rounded sum which is normalised and written out; the
// backward rounds its dx to the storage type first, then adds the widened stream gradient
// and rounds again (autograd's add of two gradients of that type).
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> add_packs(const Pack<T, VEC>& a, const Pack<T, VEC>& b) {
  Pack<T, VEC> sum;
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    sum.v[k] = StorageElement<T>::from_float(StorageElement<T>::to_float(a.v[k]) +
                                             StorageElement<T>::to_float(b.v[k]));
  }
  return sum;
}

// dx rounded to the storage type, plus the stream gradient (the store rounds the total).
// __fadd_rn: for FP32 storage the rounding is the identity, and nvcc would otherwise
// contract rstd * (...) + ds into one FMA, which rounds once where autograd's separate add
// rounds twice.
template <typename T, int VEC>
__device__ __forceinline__ void add_stream_gradient(float (&dx)[VEC], const float (&ds)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const float rounded = round_to<T>(dx[k]);
#if defined(__CUDA_ARCH__)
    dx[k] = __fadd_rn(rounded, ds[k]);
#else
    dx[k] = rounded + ds[k];
#endif
  }
}

// Makes the compiler forget what a pack holds, so that the backward's second pass unpacks
// the row again instead of keeping the first pass's unpacked floats live (twice the
// registers of the packs): with the residual add's third operand those floats made the
// 16-bit 2- and 4-chunk rows spill (ptxas). An empty asm, no instruction.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> opaque_pack(const Pack<T, VEC>& pack) {
#if defined(__CUDA_ARCH__)
  static_assert(sizeof(Pack<T, VEC>) % 4 == 0, "packs are whole 32-bit words");
  Pack<T, VEC> out = pack;
  uint32_t* words = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(Pack<T, VEC>) / 4); ++i) {
    asm volatile("" : "+r"(words[i]));
  }
  return out;
#else
  return pack;
#endif
}

// ----------------------------------------------------------------------------
// CUDA kernel bodies

// Forward: one row per warp, kRmsNormForwardWarps rows per block. Two passes over the
// row (sum of squares, then the output); the second reads the row again, from L1/L2.
template <typename T, typename TW, int VEC, bool kGated, bool kResidual = false>
__device__ __forceinline__ void forward_row(const RmsNormForwardArgs& a) {
  static_assert(!(kGated && kResidual), "the residual add is for the zero-centred norm");
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRmsNormForwardWarps +
                      static_cast<int64_t>(threadIdx.x / 32);
  if (row >= a.shape.rows) return;  // whole warps leave together; no block barrier follows
  const int64_t cols = a.shape.cols;
  const T* x = static_cast<const T*>(a.x.data) + row_offset(a.shape, a.x, row);
  const T* z = kGated ? static_cast<const T*>(a.z.data) + row_offset(a.shape, a.z, row) : nullptr;
  const TW* w = static_cast<const TW*>(a.weight);
  T* y = static_cast<T*>(a.y) + row * cols;
  // With the residual add, pass 1 writes the rounded sum and pass 2 reads it back (each
  // lane its own columns, so its own writes).
  T* sum = kResidual ? static_cast<T*>(a.sum) + row * cols : nullptr;
  const T* r = kResidual
                   ? static_cast<const T*>(a.residual.data) + row_offset(a.shape, a.residual, row)
                   : nullptr;

  float sumsq = 0.0f;
  for (int64_t c = lane * VEC; c < cols; c += 32 * VEC) {
    float xv[VEC];
    if constexpr (kResidual) {
      const Pack<T, VEC> sp = add_packs<T, VEC>(load_pack<T, VEC>(x + c), load_pack<T, VEC>(r + c));
      store_pack<T, VEC>(sum + c, sp);
      unpack<T, VEC>(sp, xv);
    } else {
      load_floats<T, VEC>(x + c, xv);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) sumsq += xv[k] * xv[k];
  }
  const float rstd = rsqrtf(warp_sum(sumsq) * (1.0f / static_cast<float>(cols)) + a.eps);
  if (lane == 0 && a.rstd != nullptr) a.rstd[row] = rstd;

  const T* normalised = kResidual ? sum : x;
  for (int64_t c = lane * VEC; c < cols; c += 32 * VEC) {
    float xv[VEC], zv[VEC], out[VEC];
    load_floats<T, VEC>(normalised + c, xv);
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
template <typename T, typename TW, int VEC, bool kGated, bool kResidual = false>
__device__ __forceinline__ void backward_program(const RmsNormBackwardArgs& a,
                                                 int64_t rows_per_program, float* shared) {
  static_assert(!(kGated && kResidual), "the residual add is for the zero-centred norm");
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
    const T* ds =
        kResidual ? static_cast<const T*>(a.grad_sum.data) + row_offset(a.shape, a.grad_sum, row)
                  : nullptr;
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
      if constexpr (kResidual) {
        float dsv[VEC];
        load_floats<T, VEC>(ds + c, dsv);
        add_stream_gradient<T, VEC>(dxv, dsv);
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

// ----------------------------------------------------------------------------
// Register-resident variants. Note [RMSNorm register-resident rows]
// The kernels above are latency-bound at the model's shapes (cols = 128 or 1024): a warp
// has one row's packs in flight at a time, re-reads the row (L1) for the second pass,
// only starts loading z after the forward's reduction, and round-trips shared memory per
// element for the weight gradient; with the backward's fixed grid (about 16 warps per SM)
// that leaves HBM mostly idle. The variants below hold a lane's share of a row in
// registers (CHUNKS packs per operand, issued together before any use), prefetch the
// rows of the next STAGES - 1 iterations while the current row is reduced and written,
// keep the hoisted weights and the warp's column sums in registers, and write the column
// sums to shared memory once at the end. They must give the same bits as the streaming
// bodies above (the emulation test checks it bit for bit): every lane owns the same
// columns (pack j covers columns lane * VEC + j * 32 * VEC + [0, VEC)), every per-element
// FP32 expression is written as above (same operand grouping, so nvcc's FMA contraction
// sees the same expression trees), per-lane sums run over the same columns in the same
// order, the warp sums use warp_sum, and each warp adds its rows into its column sums in
// the same row order (warps added in warp order, the grid unchanged).

template <typename T, int VEC, int CHUNKS>
__device__ __forceinline__ void load_row_packs(const T* row, int64_t cols, int lane,
                                               Pack<T, VEC> (&packs)[CHUNKS]) {
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
    if (c < cols) packs[j] = load_pack<T, VEC>(row + c);
  }
}

// The lane's weights w[c, c + VEC) of every chunk, kept in storage form (half the
// registers of floats for 16-bit weights): one vector load per chunk when the weight
// pointer allows it (not part of the launcher's alignment rule, which picks VEC for the
// activations alone).
template <typename TW, int VEC, int CHUNKS>
__device__ __forceinline__ void load_weight_packs(const void* weight, int64_t cols, int lane,
                                                  Pack<TW, VEC> (&packs)[CHUNKS]) {
  const TW* w = static_cast<const TW*>(weight);
  if (VEC > 1 && reinterpret_cast<uintptr_t>(weight) % sizeof(Pack<TW, VEC>) == 0) {
    load_row_packs<TW, VEC, CHUNKS>(w, cols, lane, packs);
    return;
  }
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
    if (c < cols) {
#pragma unroll
      for (int k = 0; k < VEC; ++k) packs[j].v[k] = w[c + k];
    }
  }
}

// The lane's weights of chunk j, loaded where they are used instead of held for the whole
// program: the residual-add backward variants hold one more operand per row (the stream
// gradient) and would spill with the weights in registers too (ptxas, 16-bit rows of 2 and
// 4 chunks); the reloads hit L1, as every warp reads the same weight row.
template <typename TW, int VEC>
__device__ __forceinline__ Pack<TW, VEC> load_weight_pack(const void* weight, int64_t c) {
  const TW* w = static_cast<const TW*>(weight);
  if (VEC > 1 && reinterpret_cast<uintptr_t>(weight) % sizeof(Pack<TW, VEC>) == 0) {
    return load_pack<TW, VEC>(w + c);
  }
  Pack<TW, VEC> pack;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack.v[k] = w[c + k];
  return pack;
}

// Forward of one row per warp with the row (x and z) loaded in one go: needs
// cols <= CHUNKS * 32 * VEC. Same bits as forward_row.
template <typename T, typename TW, int VEC, bool kGated, int CHUNKS, bool kResidual = false>
__device__ __forceinline__ void forward_row_resident(const RmsNormForwardArgs& a) {
  static_assert(!(kGated && kResidual), "the residual add is for the zero-centred norm");
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRmsNormForwardWarps +
                      static_cast<int64_t>(threadIdx.x / 32);
  if (row >= a.shape.rows) return;  // whole warps leave together; no block barrier follows
  const int64_t cols = a.shape.cols;
  const RowIndex index = row_index(a.shape, row);
  const T* x = static_cast<const T*>(a.x.data) + operand_offset(index, a.x, a.shape.row_dims);
  T* y = static_cast<T*>(a.y) + row * cols;

  Pack<T, VEC> xp[CHUNKS], zp[kGated ? CHUNKS : 1];
  load_row_packs<T, VEC, CHUNKS>(x, cols, lane, xp);
  if constexpr (kGated) {
    const T* z = static_cast<const T*>(a.z.data) + operand_offset(index, a.z, a.shape.row_dims);
    load_row_packs<T, VEC, CHUNKS>(z, cols, lane, zp);
  }
  if constexpr (kResidual) {  // from here on xp holds the rounded sum
    Pack<T, VEC> rp[CHUNKS];
    load_row_packs<T, VEC, CHUNKS>(static_cast<const T*>(a.residual.data) +
                                       operand_offset(index, a.residual, a.shape.row_dims),
                                   cols, lane, rp);
    T* sum = static_cast<T*>(a.sum) + row * cols;
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
      if (c < cols) {
        xp[j] = add_packs<T, VEC>(xp[j], rp[j]);
        store_pack<T, VEC>(sum + c, xp[j]);
      }
    }
  }
  Pack<TW, VEC> wp[CHUNKS];
  load_weight_packs<TW, VEC, CHUNKS>(a.weight, cols, lane, wp);

  float sumsq = 0.0f;
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
    if (c < cols) {
      float xv[VEC];
      unpack<T, VEC>(xp[j], xv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) sumsq += xv[k] * xv[k];
    }
  }
  const float rstd = rsqrtf(warp_sum(sumsq) * (1.0f / static_cast<float>(cols)) + a.eps);
  if (lane == 0 && a.rstd != nullptr) a.rstd[row] = rstd;

#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
    if (c < cols) {
      float xv[VEC], zv[VEC], wv[VEC], out[VEC];
      unpack<T, VEC>(xp[j], xv);
      if constexpr (kGated) unpack<T, VEC>(zp[j], zv);
      unpack<TW, VEC>(wp[j], wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float n = xv[k] * rstd;
        if constexpr (kGated) {
          float silu, silu_grad;
          silu_and_grad(zv[k], silu, silu_grad);
          out[k] = n * wv[k] * silu;  // (normed * w) * silu(z), the composite's order
        } else {
          out[k] = n * (wv[k] + 1.0f);
        }
      }
      store_floats<T, VEC>(y + c, out);
    }
  }
}

// One row of the backward in flight: the lane's packs of x, grad_y (and z) and the row's
// rstd, loaded by load_backward_row long before process_backward_row uses them.
template <typename T, int VEC, int CHUNKS, bool kGated, bool kResidual = false>
struct BackwardRow {
  Pack<T, VEC> x[CHUNKS], dy[CHUNKS], z[kGated ? CHUNKS : 1], ds[kResidual ? CHUNKS : 1];
  float rstd;
};

template <typename T, int VEC, int CHUNKS, bool kGated, bool kResidual = false>
__device__ __forceinline__ void load_backward_row(
    const RmsNormBackwardArgs& a, int64_t row, int lane,
    BackwardRow<T, VEC, CHUNKS, kGated, kResidual>& r) {
  const int64_t cols = a.shape.cols;
  const int dims = a.shape.row_dims;
  const RowIndex index = row_index(a.shape, row);
  load_row_packs<T, VEC, CHUNKS>(static_cast<const T*>(a.x.data) + operand_offset(index, a.x, dims),
                                 cols, lane, r.x);
  load_row_packs<T, VEC, CHUNKS>(
      static_cast<const T*>(a.grad_y.data) + operand_offset(index, a.grad_y, dims), cols, lane,
      r.dy);
  if constexpr (kGated) {
    load_row_packs<T, VEC, CHUNKS>(
        static_cast<const T*>(a.z.data) + operand_offset(index, a.z, dims), cols, lane, r.z);
  }
  if constexpr (kResidual) {
    load_row_packs<T, VEC, CHUNKS>(
        static_cast<const T*>(a.grad_sum.data) + operand_offset(index, a.grad_sum, dims), cols,
        lane, r.ds);
  }
  r.rstd = a.rstd[row];
}

// backward_program's per-row work on a loaded row; `wp` holds the weights of the lane's
// columns. The warp's column sums of those columns live in `acc` or, with kSharedAcc, in
// the warp's shared-memory row `warp_acc` as in backward_program (fewer registers: the
// wide 16-bit rows need them for the row itself).
template <typename T, typename TW, int VEC, int CHUNKS, bool kGated, bool kSharedAcc,
          bool kResidual = false>
__device__ __forceinline__ void process_backward_row(
    const RmsNormBackwardArgs& a, int64_t row, int lane,
    const BackwardRow<T, VEC, CHUNKS, kGated, kResidual>& r, const Pack<TW, VEC> (&wp)[CHUNKS],
    float (&acc)[kSharedAcc ? 1 : CHUNKS][VEC], float* warp_acc) {
  const int64_t cols = a.shape.cols;
  const float rstd = r.rstd;
  // silu(z) and silu'(z) of pass 1, reused by pass 2 (an exp and two divisions each).
  float silu[kGated ? CHUNKS : 1][VEC], silu_grad[kGated ? CHUNKS : 1][VEC];

  float dot = 0.0f;
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
    if (c < cols) {
      float xv[VEC], gv[VEC], zv[VEC], wv[VEC];
      unpack<T, VEC>(r.x[j], xv);
      unpack<T, VEC>(r.dy[j], gv);
      if constexpr (kGated) unpack<T, VEC>(r.z[j], zv);
      unpack<TW, VEC>(kResidual ? load_weight_pack<TW, VEC>(a.weight, c) : wp[j], wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float n = xv[k] * rstd;
        float dn;
        if constexpr (kGated) {
          silu_and_grad(zv[k], silu[j][k], silu_grad[j][k]);
          dn = gv[k] * wv[k] * silu[j][k];
        } else {
          dn = gv[k] * (wv[k] + 1.0f);
        }
        dot += dn * n;
      }
    }
  }
  const float mean_dot = warp_sum(dot) * (1.0f / static_cast<float>(cols));
  Pack<T, VEC> x2[kResidual ? CHUNKS : 1], dy2[kResidual ? CHUNKS : 1];
  if constexpr (kResidual) {
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      x2[j] = opaque_pack<T, VEC>(r.x[j]);
      dy2[j] = opaque_pack<T, VEC>(r.dy[j]);
    }
  }

  T* dx = static_cast<T*>(a.dx) + row * cols;
  T* dz = kGated ? static_cast<T*>(a.dz) + row * cols : nullptr;
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
    if (c < cols) {
      float xv[VEC], gv[VEC], wv[VEC], dxv[VEC], dzv[VEC];
      unpack<T, VEC>(kResidual ? x2[j] : r.x[j], xv);
      unpack<T, VEC>(kResidual ? dy2[j] : r.dy[j], gv);
      unpack<TW, VEC>(kResidual ? load_weight_pack<TW, VEC>(a.weight, c) : wp[j], wv);
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        const float n = xv[k] * rstd;
        float dn, dw_term;
        if constexpr (kGated) {
          dn = gv[k] * wv[k] * silu[j][k];
          dzv[k] = gv[k] * n * wv[k] * silu_grad[j][k];
          dw_term = gv[k] * n * silu[j][k];
        } else {
          dn = gv[k] * (wv[k] + 1.0f);
          dw_term = gv[k] * n;
        }
        dxv[k] = rstd * (dn - n * mean_dot);
        if constexpr (kSharedAcc) {
          warp_acc[acc_index<VEC>(c + k, cols)] += dw_term;
        } else {
          acc[j][k] += dw_term;
        }
      }
      if constexpr (kResidual) {
        float dsv[VEC];
        unpack<T, VEC>(r.ds[j], dsv);
        add_stream_gradient<T, VEC>(dxv, dsv);
      }
      store_floats<T, VEC>(dx + c, dxv);
      if constexpr (kGated) store_floats<T, VEC>(dz + c, dzv);
    }
  }
}

// backward_program with the rows in registers: needs cols <= CHUNKS * 32 * VEC. A warp
// walks its rows (begin + warp, + warps, ...) in order with STAGES rows in flight: the
// loads of row i + STAGES - 1 are issued before row i's reduction, math and stores. Same
// bits as backward_program (Note [RMSNorm register-resident rows]).
template <typename T, typename TW, int VEC, bool kGated, int CHUNKS, int STAGES, bool kSharedAcc,
          bool kResidual = false>
__device__ __forceinline__ void backward_program_resident(const RmsNormBackwardArgs& a,
                                                          int64_t rows_per_program, float* shared) {
  static_assert(!(kGated && kResidual), "the residual add is for the zero-centred norm");
  const int warps = static_cast<int>(blockDim.x / 32);
  const int warp = static_cast<int>(threadIdx.x / 32);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t rows = a.shape.rows;
  const int64_t cols = a.shape.cols;

  Pack<TW, VEC> wp[CHUNKS];
  if constexpr (!kResidual) load_weight_packs<TW, VEC, CHUNKS>(a.weight, cols, lane, wp);
  float acc[kSharedAcc ? 1 : CHUNKS][VEC];
  float* warp_acc = shared + warp * cols;
#pragma unroll
  for (int j = 0; j < CHUNKS; ++j) {
    const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if constexpr (kSharedAcc) {
        if (c < cols) warp_acc[acc_index<VEC>(c + k, cols)] = 0.0f;
      } else {
        acc[j][k] = 0.0f;
      }
    }
  }

  const int64_t begin = static_cast<int64_t>(blockIdx.x) * rows_per_program;
  const int64_t end = begin + rows_per_program < rows ? begin + rows_per_program : rows;
  const int64_t first = begin + warp;
  BackwardRow<T, VEC, CHUNKS, kGated, kResidual> stage[STAGES];
#pragma unroll
  for (int s = 0; s + 1 < STAGES; ++s) {
    const int64_t row = first + static_cast<int64_t>(s) * warps;
    if (row < end) load_backward_row<T, VEC, CHUNKS, kGated, kResidual>(a, row, lane, stage[s]);
  }
  // Unrolled by STAGES so that every stage index is a compile-time constant (registers,
  // not local memory). Row checks are warp-uniform.
  for (int64_t base = first; base < end; base += static_cast<int64_t>(STAGES) * warps) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int64_t ahead = base + static_cast<int64_t>(s + STAGES - 1) * warps;
      if (ahead < end) {
        load_backward_row<T, VEC, CHUNKS, kGated, kResidual>(a, ahead, lane,
                                                             stage[(s + STAGES - 1) % STAGES]);
      }
      const int64_t row = base + static_cast<int64_t>(s) * warps;
      if (row < end)
        process_backward_row<T, TW, VEC, CHUNKS, kGated, kSharedAcc, kResidual>(
            a, row, lane, stage[s], wp, acc, warp_acc);
    }
  }

  if constexpr (!kSharedAcc) {
#pragma unroll
    for (int j = 0; j < CHUNKS; ++j) {
      const int64_t c = static_cast<int64_t>(lane) * VEC + static_cast<int64_t>(j) * 32 * VEC;
      if (c < cols) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) warp_acc[acc_index<VEC>(c + k, cols)] = acc[j][k];
      }
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
