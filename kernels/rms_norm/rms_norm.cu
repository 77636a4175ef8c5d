// CUDA kernels of the fused RMSNorm (forward, backward, ordered weight-gradient
// reduction): thin __global__ wrappers around the bodies in kernels/rms_norm/rms_norm_kernel.cuh,
// then the launchers. Contract in kernels/rms_norm/rms_norm.h.
//
// Why a second kernel for the weight gradient: dw sums over every token. Atomics would
// make that one pass, but the order of the float additions would then follow block
// scheduling and the bits would change from run to run. Instead every program writes one
// FP32 partial row and a second kernel on the same stream sums the rows in program-index
// order (Note [RMSNorm determinism] in the .cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/rms_norm/rms_norm.h"

#include "kernels/rms_norm/rms_norm_kernel.cuh"

namespace gdr::kernels {
namespace {

using rms_norm_detail::backward_program;
using rms_norm_detail::backward_program_resident;
using rms_norm_detail::forward_row;
using rms_norm_detail::forward_row_resident;
using rms_norm_detail::reduce_partials_block;

// ----------------------------------------------------------------------------
// CUDA kernels

// CHUNKS == 0: the streaming bodies (any cols); else the register-resident ones for
// cols <= CHUNKS * 32 * VEC (Note [RMSNorm register-resident rows]).
template <typename T, typename TW, int VEC, bool kGated, int CHUNKS, bool kResidual>
__global__ void __launch_bounds__(kRmsNormForwardWarps * 32)
    rms_norm_forward_kernel(const RmsNormForwardArgs args) {
  if constexpr (CHUNKS == 0) {
    forward_row<T, TW, VEC, kGated, kResidual>(args);
  } else {
    forward_row_resident<T, TW, VEC, kGated, CHUNKS, kResidual>(args);
  }
}

// The backward's fixed grid gives about 4 programs per SM: the minimum of 4 blocks per SM
// caps registers at 128 so that they are all resident at once.
template <typename T, typename TW, int VEC, bool kGated, int CHUNKS, int STAGES, bool kSharedAcc,
          bool kResidual>
__global__ void __launch_bounds__(kRmsNormBackwardMaxWarps * 32, 4)
    rms_norm_backward_kernel(const RmsNormBackwardArgs args, int64_t rows_per_program) {
  extern __shared__ float column_sums[];  // [warps][cols]
  if constexpr (CHUNKS == 0) {
    backward_program<T, TW, VEC, kGated, kResidual>(args, rows_per_program, column_sums);
  } else {
    backward_program_resident<T, TW, VEC, kGated, CHUNKS, STAGES, kSharedAcc, kResidual>(
        args, rows_per_program, column_sums);
  }
}

// dx (contiguous rows) += the stream gradient's rows, rounded as autograd's add rounds.
// Flat over the VEC-element packs, kAddItems per thread with every load issued before the
// math. kContiguous: the stream gradient is contiguous [rows, cols] too and the packs fit
// 32-bit indices, so a pack's offset is its index (a per-pack row decoding with 64-bit
// divisions made this kernel instruction-bound, slower than ATen's add; measured:
// docs/benchmarks_log.md).
constexpr int kAddThreads = 256;
constexpr int kAddItems = 4;

template <typename T, int VEC, bool kContiguous>
__global__ void __launch_bounds__(kAddThreads)
    add_stream_gradient_kernel(const RmsNormShape shape, const RowOperand grad_sum, void* dx_data) {
  using Index = std::conditional_t<kContiguous, int32_t, int64_t>;
  const Index packs_per_row = static_cast<Index>(shape.cols / VEC);
  const Index packs = static_cast<Index>(shape.rows) * packs_per_row;
  const Index first =
      static_cast<Index>(blockIdx.x) * (kAddThreads * kAddItems) + static_cast<Index>(threadIdx.x);
  T* dx = static_cast<T*>(dx_data);
  const T* ds = static_cast<const T*>(grad_sum.data);
  auto ds_offset = [&](Index p) -> int64_t {
    if constexpr (kContiguous) {
      return static_cast<int64_t>(p) * VEC;
    } else {
      const Index row = p / packs_per_row;
      return rms_norm_detail::row_offset(shape, grad_sum, row) + (p - row * packs_per_row) * VEC;
    }
  };
  float dxv[kAddItems][VEC], dsv[kAddItems][VEC];
#pragma unroll
  for (int u = 0; u < kAddItems; ++u) {
    const Index p = first + static_cast<Index>(u) * kAddThreads;
    if (p < packs) {
      load_floats<T, VEC>(dx + static_cast<int64_t>(p) * VEC, dxv[u]);
      load_floats<T, VEC>(ds + ds_offset(p), dsv[u]);
    }
  }
#pragma unroll
  for (int u = 0; u < kAddItems; ++u) {
    const Index p = first + static_cast<Index>(u) * kAddThreads;
    if (p < packs) {
      rms_norm_detail::add_stream_gradient<T, VEC>(dxv[u], dsv[u]);
      store_floats<T, VEC>(dx + static_cast<int64_t>(p) * VEC, dxv[u]);
    }
  }
}

// True when op's rows are those of a contiguous [rows, cols] tensor (size-1 dims aside).
bool contiguous_rows(const RmsNormShape& shape, const RowOperand& op) {
  int64_t expected = shape.cols;
  for (int k = shape.row_dims - 1; k >= 0; --k) {
    if (shape.row_sizes[k] > 1 && op.row_strides[k] != expected) return false;
    expected *= shape.row_sizes[k];
  }
  return true;
}

template <typename TW>
__global__ void __launch_bounds__(kRmsNormReduceCols* kRmsNormReduceSlices)
    rms_norm_reduce_partials_kernel(const float* partials, int64_t programs, int64_t cols, TW* dw) {
  __shared__ float slice_sums[kRmsNormReduceSlices * kRmsNormReduceCols];
  reduce_partials_block<TW>(partials, programs, cols, dw, slice_sums);
}

// ----------------------------------------------------------------------------
// kernel launcher

// 16-byte loads and stores need every row start 16-byte aligned and whole packs per row.
// Strides of size-1 row dims are never used, so they do not count.
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

bool rows_aligned(const RmsNormShape& shape, const RowOperand& op, int64_t element_bytes) {
  if (!aligned16(op.data)) return false;
  for (int k = 0; k < shape.row_dims; ++k) {
    if (shape.row_sizes[k] > 1 && (op.row_strides[k] * element_bytes) % 16 != 0) return false;
  }
  return true;
}

template <typename T>
bool can_vectorize(const RmsNormShape& shape, std::initializer_list<const RowOperand*> inputs,
                   std::initializer_list<const void*> outputs) {
  constexpr int kVec = 16 / sizeof(T);
  if (shape.cols % kVec != 0) return false;
  for (const RowOperand* op : inputs) {
    if (!rows_aligned(shape, *op, sizeof(T))) return false;
  }
  for (const void* p : outputs) {
    if (!aligned16(p)) return false;
  }
  return true;
}

// Packs per lane a row of `cols` needs: 0 (the streaming kernels) beyond `max_chunks`.
// Only the 16-byte path gets register-resident variants; the scalar one is the fallback
// for unaligned views and odd rows.
int resident_chunks(int64_t cols, int vec, int max_chunks) {
  if (vec == 1) return 0;
  const int64_t needed = (cols + 32 * vec - 1) / (32 * vec);
  for (int chunks = 1; chunks <= max_chunks; chunks *= 2) {
    if (needed <= chunks) return chunks;
  }
  return 0;
}

template <typename T, typename TW, int VEC, bool kGated, bool kResidual>
void forward_flavoured(const RmsNormForwardArgs& args, dim3 grid, cudaStream_t stream) {
  constexpr int kThreads = kRmsNormForwardWarps * 32;
  if constexpr (VEC == 1) {
    rms_norm_forward_kernel<T, TW, 1, kGated, 0, kResidual><<<grid, kThreads, 0, stream>>>(args);
  } else {
    switch (args.streaming_only ? 0 : resident_chunks(args.shape.cols, VEC, 4)) {
      case 1:
        rms_norm_forward_kernel<T, TW, VEC, kGated, 1, kResidual>
            <<<grid, kThreads, 0, stream>>>(args);
        break;
      case 2:
        rms_norm_forward_kernel<T, TW, VEC, kGated, 2, kResidual>
            <<<grid, kThreads, 0, stream>>>(args);
        break;
      case 4:
        rms_norm_forward_kernel<T, TW, VEC, kGated, 4, kResidual>
            <<<grid, kThreads, 0, stream>>>(args);
        break;
      default:
        rms_norm_forward_kernel<T, TW, VEC, kGated, 0, kResidual>
            <<<grid, kThreads, 0, stream>>>(args);
    }
  }
}

template <typename T, typename TW, int VEC>
void forward_typed(const RmsNormForwardArgs& args, dim3 grid, cudaStream_t stream) {
  if (args.flavour == RmsNormFlavour::kGated) {
    forward_flavoured<T, TW, VEC, true, false>(args, grid, stream);
  } else if (args.residual.data != nullptr) {
    forward_flavoured<T, TW, VEC, false, true>(args, grid, stream);
  } else {
    forward_flavoured<T, TW, VEC, false, false>(args, grid, stream);
  }
}

template <typename T, typename TW>
int launch_forward(const RmsNormForwardArgs& args, cudaStream_t stream) {
  const int64_t blocks = (args.shape.rows + kRmsNormForwardWarps - 1) / kRmsNormForwardWarps;
  if (blocks > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  const dim3 grid(static_cast<unsigned int>(blocks));
  const bool gated = args.flavour == RmsNormFlavour::kGated;
  const RowOperand none;
  if (can_vectorize<T>(args.shape, {&args.x, gated ? &args.z : &none, &args.residual},
                       {args.y, args.sum})) {
    forward_typed<T, TW, 16 / sizeof(T)>(args, grid, stream);
  } else {
    forward_typed<T, TW, 1>(args, grid, stream);
  }
  return static_cast<int>(cudaGetLastError());
}

// The backward's register-resident plan for rows of `chunks` 16-byte packs per lane and
// operand (stages == 0: the streaming kernel). Chosen so that nothing spills under the
// 128-register cap (ptxas -v, sm_90): one stage holds 2 or 3 operands * chunks packs, and
// a lane also keeps chunks * VEC floats of column sums (unless shared_acc) and, gated, of
// silu and silu' between the passes; 16-bit rows cost more, as ptxas keeps both passes'
// unpacked floats. With one chunk, 3 stages (two rows prefetched) where they fit; with
// four, no row ahead, but a warp still has all 8 packs of its row in flight (and at the
// model's cols = 1024 each warp owns a single row anyway). The residual add's stream
// gradient is one more operand per stage; the plans keep their stages (no spills, ptxas).
struct BackwardPlan {
  int stages;
  bool shared_acc;
};

constexpr BackwardPlan backward_plan(bool gated, int element_bytes, int chunks) {
  const bool wide = element_bytes == 4;  // FP32 rows: VEC = 4, no unpacking
  if (gated) {
    if (chunks == 1) return wide ? BackwardPlan{3, false} : BackwardPlan{2, false};
    if (chunks == 2) return wide ? BackwardPlan{2, false} : BackwardPlan{1, true};
    return {0, false};
  }
  if (chunks == 1) return {3, false};
  if (chunks == 2) return wide ? BackwardPlan{2, false} : BackwardPlan{2, true};
  if (chunks == 4) return wide ? BackwardPlan{1, false} : BackwardPlan{1, true};
  return {0, false};
}

template <typename T, typename TW, int VEC, bool kGated, int CHUNKS, bool kResidual>
void backward_launch(const RmsNormBackwardArgs& args, const RmsNormBackwardLaunch& launch,
                     cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned int>(launch.programs));
  const int threads = launch.warps * 32;
  const size_t shared = static_cast<size_t>(launch.shared_bytes);
  constexpr BackwardPlan kPlan =
      CHUNKS == 0 ? BackwardPlan{0, false} : backward_plan(kGated, sizeof(T), CHUNKS);
  if constexpr (kPlan.stages == 0) {
    rms_norm_backward_kernel<T, TW, VEC, kGated, 0, 1, false, kResidual>
        <<<grid, threads, shared, stream>>>(args, launch.rows_per_program);
  } else {
    rms_norm_backward_kernel<T, TW, VEC, kGated, CHUNKS, kPlan.stages, kPlan.shared_acc, kResidual>
        <<<grid, threads, shared, stream>>>(args, launch.rows_per_program);
  }
}

template <typename T, typename TW, int VEC, bool kGated, bool kResidual>
void backward_flavoured(const RmsNormBackwardArgs& args, const RmsNormBackwardLaunch& launch,
                        cudaStream_t stream) {
  if constexpr (VEC == 1) {
    backward_launch<T, TW, 1, kGated, 0, kResidual>(args, launch, stream);
  } else {
    switch (args.streaming_only ? 0 : resident_chunks(args.shape.cols, VEC, 4)) {
      case 1: backward_launch<T, TW, VEC, kGated, 1, kResidual>(args, launch, stream); break;
      case 2: backward_launch<T, TW, VEC, kGated, 2, kResidual>(args, launch, stream); break;
      case 4: backward_launch<T, TW, VEC, kGated, 4, kResidual>(args, launch, stream); break;
      default: backward_launch<T, TW, VEC, kGated, 0, kResidual>(args, launch, stream);
    }
  }
}

template <typename T, typename TW, int VEC>
void backward_typed(const RmsNormBackwardArgs& args, const RmsNormBackwardLaunch& launch,
                    cudaStream_t stream) {
  if (args.flavour == RmsNormFlavour::kGated) {
    backward_flavoured<T, TW, VEC, true, false>(args, launch, stream);
  } else if (args.grad_sum.data != nullptr) {
    backward_flavoured<T, TW, VEC, false, true>(args, launch, stream);
  } else {
    backward_flavoured<T, TW, VEC, false, false>(args, launch, stream);
  }
}

template <typename T, typename TW>
int launch_backward(const RmsNormBackwardArgs& args, cudaStream_t stream) {
  const RmsNormBackwardLaunch launch =
      derive_rms_norm_backward_launch(args.shape.rows, args.shape.cols);
  if (launch.programs > 0x7fffffffLL) return static_cast<int>(cudaErrorInvalidConfiguration);
  const bool gated = args.flavour == RmsNormFlavour::kGated;
  const RowOperand none;
  const bool vectorised =
      can_vectorize<T>(args.shape, {&args.x, &args.grad_y, gated ? &args.z : &none, &args.grad_sum},
                       {args.dx, gated ? args.dz : nullptr});
  constexpr int kVec = 16 / sizeof(T);
  // Note [RMSNorm with the residual add]: the 16-bit rows of 2 and 4 packs per lane (the
  // model's hidden 1024 in BF16 is 4) spill with the stream gradient as a third operand
  // (ptxas), and the fused kernel is slower than the plain backward plus a separate add
  // (measured: docs/benchmarks.md, Decisions). There the plain kernel runs and the
  // stream gradient is added after it, with the same roundings, so the same bits.
  const bool add_after = args.grad_sum.data != nullptr && sizeof(T) == 2 && vectorised &&
                         !args.streaming_only && resident_chunks(args.shape.cols, kVec, 4) >= 2;
  if (add_after) {
    RmsNormBackwardArgs plain = args;
    plain.grad_sum = RowOperand();
    backward_typed<T, TW, kVec>(plain, launch, stream);
    const int64_t packs = args.shape.rows * (args.shape.cols / kVec);
    const int64_t blocks = (packs + kAddThreads * kAddItems - 1) / (kAddThreads * kAddItems);
    if (contiguous_rows(args.shape, args.grad_sum) && packs < (int64_t{1} << 31)) {
      add_stream_gradient_kernel<T, kVec, true>
          <<<static_cast<unsigned int>(blocks), kAddThreads, 0, stream>>>(args.shape, args.grad_sum,
                                                                          args.dx);
    } else {
      add_stream_gradient_kernel<T, kVec, false>
          <<<static_cast<unsigned int>(blocks), kAddThreads, 0, stream>>>(args.shape, args.grad_sum,
                                                                          args.dx);
    }
  } else if (vectorised) {
    backward_typed<T, TW, kVec>(args, launch, stream);
  } else {
    backward_typed<T, TW, 1>(args, launch, stream);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int launch_rms_norm_forward(const RmsNormForwardArgs& args, CUstream_st* stream) {
  if (!rms_norm_supports_cols(args.shape.cols) || args.shape.rows < 0 || args.shape.row_dims < 1 ||
      args.shape.row_dims > kRmsNormMaxRowDims) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const bool residual = args.residual.data != nullptr;
  if (residual && (args.flavour != RmsNormFlavour::kZeroCentred || args.sum == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (args.shape.rows == 0) return static_cast<int>(cudaSuccess);
  switch (args.dtype) {
    // The weight is in the activation dtype or FP32: for FP32 activations both are float.
    case NormDtype::kFloat32: return launch_forward<float, float>(args, stream);
    case NormDtype::kFloat16:
      return args.weight_fp32 ? launch_forward<__half, float>(args, stream)
                              : launch_forward<__half, __half>(args, stream);
    case NormDtype::kBFloat16:
      return args.weight_fp32 ? launch_forward<__nv_bfloat16, float>(args, stream)
                              : launch_forward<__nv_bfloat16, __nv_bfloat16>(args, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int launch_rms_norm_backward(const RmsNormBackwardArgs& args, CUstream_st* stream) {
  if (!rms_norm_supports_cols(args.shape.cols) || args.shape.rows < 0 || args.shape.row_dims < 1 ||
      args.shape.row_dims > kRmsNormMaxRowDims) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (args.grad_sum.data != nullptr && args.flavour != RmsNormFlavour::kZeroCentred) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (args.shape.rows == 0) return static_cast<int>(cudaSuccess);
  switch (args.dtype) {
    case NormDtype::kFloat32: return launch_backward<float, float>(args, stream);
    case NormDtype::kFloat16:
      return args.weight_fp32 ? launch_backward<__half, float>(args, stream)
                              : launch_backward<__half, __half>(args, stream);
    case NormDtype::kBFloat16:
      return args.weight_fp32 ? launch_backward<__nv_bfloat16, float>(args, stream)
                              : launch_backward<__nv_bfloat16, __nv_bfloat16>(args, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

int launch_rms_norm_reduce_partials(const float* partials, int64_t programs, int64_t cols,
                                    NormDtype weight_dtype, void* dw, CUstream_st* stream) {
  if (!rms_norm_supports_cols(cols) || programs < 0) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned int>((cols + kRmsNormReduceCols - 1) / kRmsNormReduceCols));
  constexpr int kThreads = kRmsNormReduceCols * kRmsNormReduceSlices;
  switch (weight_dtype) {
    case NormDtype::kFloat32:
      rms_norm_reduce_partials_kernel<float>
          <<<grid, kThreads, 0, stream>>>(partials, programs, cols, static_cast<float*>(dw));
      break;
    case NormDtype::kFloat16:
      rms_norm_reduce_partials_kernel<__half>
          <<<grid, kThreads, 0, stream>>>(partials, programs, cols, static_cast<__half*>(dw));
      break;
    case NormDtype::kBFloat16:
      rms_norm_reduce_partials_kernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(
          partials, programs, cols, static_cast<__nv_bfloat16*>(dw));
      break;
    default: return static_cast<int>(cudaErrorInvalidValue);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gdr::kernels
