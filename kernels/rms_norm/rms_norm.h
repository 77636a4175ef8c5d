// Fused RMSNorm forward and backward for the two norms of the Qwen3.5 model:
//   zero-centred: y = x * rstd * (1 + w)
//   gated:        y = (x * rstd) * w * silu(z)
// with rstd = rsqrt(mean(x^2) + eps) over the last dim (`cols`) of each row. Plain C++ (no
// CUDA or torch headers): the launch rules below are host code, testable without a GPU.
//
// Layout contract: x, z, grad_y are rows of `cols` contiguous elements; the rows are
// addressed through up to kRmsNormMaxRowDims leading dims with arbitrary element strides
// (RowOperand), so views such as a narrow() of a wider last dim or a transpose of the
// leading dims need no copy. y, dx, dz are written contiguous [rows, cols]; rstd is FP32
// [rows]. x, z, grad_y, y, dx, dz share one storage dtype (NormDtype); the weight is either
// that dtype or FP32. Math is FP32 whatever the storage type. Every launcher runs on the
// stream it is given. Note [RMSNorm determinism]: every output is deterministic by
// construction (no atomics): rows are independent, and the weight gradient is a sum of
// per-program FP32 partial rows in program-index order by a second kernel, with a grid
// that is a pure function of (rows, cols).
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

enum class NormDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

enum class RmsNormFlavour : int { kZeroCentred = 0, kGated = 1 };

constexpr int kRmsNormMaxRowDims = 4;

// Largest supported row: the backward keeps one FP32 partial row per warp in shared
// memory, and one warp's row must fit the default 48 KiB.
constexpr int64_t kRmsNormMaxCols = 12288;

// The rows of a tensor whose last dim is contiguous: row r is decomposed over
// RmsNormShape::row_sizes (last size fastest) and its first element sits at
// data + sum_k index_k * row_strides[k] (element strides).
struct RowOperand {
  const void* data = nullptr;
  int64_t row_strides[kRmsNormMaxRowDims] = {0, 0, 0, 0};
};

struct RmsNormShape {
  int64_t rows = 0;
  int64_t cols = 0;
  int row_dims = 1;  // number of leading dims in row_sizes, 1..kRmsNormMaxRowDims
  int64_t row_sizes[kRmsNormMaxRowDims] = {0, 0, 0, 0};
};

struct RmsNormForwardArgs {
  RmsNormFlavour flavour = RmsNormFlavour::kZeroCentred;
  NormDtype dtype = NormDtype::kFloat32;  // x, z, y
  bool weight_fp32 = false;               // weight in FP32, else in `dtype`
  RmsNormShape shape;
  RowOperand x, z;               // z: gated only
  const void* weight = nullptr;  // [cols], contiguous
  float eps = 0.0f;
  void* y = nullptr;      // [rows, cols] contiguous, `dtype`
  float* rstd = nullptr;  // [rows]; may be null (no backward will follow)
  // Zero-centred only, optional (Note [RMSNorm with the residual add]): when
  // residual.data is set, the row normalised is sum = x + residual, rounded to `dtype` as
  // ATen's add rounds it, and written to `sum` ([rows, cols] contiguous, `dtype`).
  RowOperand residual;
  void* sum = nullptr;
  // The streaming one-row-at-a-time kernel, whose bits the faster register-resident
  // variants reproduce (Note [RMSNorm register-resident rows]); for tests and benchmarks
  // (the execution policy's rms_norm_kernel = streaming in ops/rms_norm/rms_norm_op_cuda.cc;
  // environment override GDR_RMS_NORM_KERNEL).
  bool streaming_only = false;
};

struct RmsNormBackwardArgs {
  RmsNormFlavour flavour = RmsNormFlavour::kZeroCentred;
  NormDtype dtype = NormDtype::kFloat32;  // grad_y, x, z, dx, dz
  bool weight_fp32 = false;
  RmsNormShape shape;
  RowOperand grad_y, x, z;
  const void* weight = nullptr;
  const float* rstd = nullptr;  // [rows], from the forward
  void* dx = nullptr;           // [rows, cols] contiguous, `dtype`
  void* dz = nullptr;           // gated only
  float* partials = nullptr;    // [programs, cols] FP32 scratch, every slot written
  bool streaming_only = false;  // as in RmsNormForwardArgs
  // Zero-centred only, optional (Note [RMSNorm with the residual add]): when
  // grad_sum.data is set, dx = round(round(dx) + grad_sum): the gradient of the sum that
  // the forward normalised, with the residual stream's gradient added as autograd would
  // add it. x is then that sum.
  RowOperand grad_sum;
};

// Forward: one row per warp, kRmsNormForwardWarps rows per block. Rows are independent,
// so the block size changes no bits; 8 warps halve the blocks to schedule at 32768 short
// rows (cols = 128) against 4.
constexpr int kRmsNormForwardWarps = 8;

// Backward grid, a pure function of (rows, cols) so that the weight gradient's summation
// order never depends on the device or the load. Each program (block of `warps` warps)
// owns rows [p * rows_per_program, (p + 1) * rows_per_program); warp w takes rows w,
// w + warps, ... of it, accumulating its FP32 column sums in shared memory in row order;
// the warps' sums are added in warp order into the program's partial row.
struct RmsNormBackwardLaunch {
  int warps = 0;
  int64_t rows_per_program = 0;
  int64_t programs = 0;        // grid.x; 0 when rows == 0
  int64_t scratch_floats = 0;  // programs * cols
  int64_t shared_bytes = 0;    // warps * cols * sizeof(float)
};

constexpr int kRmsNormBackwardMaxWarps = 4;
constexpr int64_t kRmsNormTargetPrograms = 512;  // about 4 per SM of an H100/H200
constexpr int64_t kRmsNormSharedBudget = 48 * 1024;

RmsNormBackwardLaunch derive_rms_norm_backward_launch(int64_t rows, int64_t cols);

// The ordered second pass: block of kRmsNormReduceCols columns x kRmsNormReduceSlices
// slices; slice s sums programs s, s + slices, ... in order, then slice sums are added in
// slice order. A pure function of `programs`.
constexpr int kRmsNormReduceCols = 32;
constexpr int kRmsNormReduceSlices = 16;

// True when `cols` can be launched (1 <= cols <= kRmsNormMaxCols).
bool rms_norm_supports_cols(int64_t cols);

// Returns 0 (cudaSuccess) or the CUDA error code of the launch.
int launch_rms_norm_forward(const RmsNormForwardArgs& args, CUstream_st* stream);

// Writes dx (and dz) and launch.scratch_floats partial sums into args.partials, where
// launch = derive_rms_norm_backward_launch(rows, cols).
int launch_rms_norm_backward(const RmsNormBackwardArgs& args, CUstream_st* stream);

// Sums the [programs, cols] partial rows in program-index order and writes dw ([cols],
// `weight_dtype`). programs == 0 writes zeros.
int launch_rms_norm_reduce_partials(const float* partials, int64_t programs, int64_t cols,
                                    NormDtype weight_dtype, void* dw, CUstream_st* stream);

}  // namespace gdr::kernels
