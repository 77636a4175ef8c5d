// The optimizer tail of a training step in one multi-tensor pass: gradient clipping
// (g = grad * coef), the AdamW update of the FP32 master, exp_avg and exp_avg_sq, and the
// FP32 -> BF16 store of the new master into the model's BF16 parameter. It replaces
// ATen's _foreach_mul_ + _fused_adamw_ + _foreach_copy_ (three multi-tensor kernel
// families, the gradients read twice) with one launch, and gives their bits: the math is
// ATen's adam_math (ADAMW mode, FP32 opmath) written the same way and compiled with the
// same nvcc floating-point defaults (Note in kernels/fused_adamw/fused_adamw.cu). Purely
// elementwise: no atomics, nothing across threads. Host contract here; the kernel in
// kernels/fused_adamw/fused_adamw.cu; the op in ops/fused_adamw/fused_adamw_op.h.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

#if defined(__CUDACC__)
#define GDR_FUSED_ADAMW_HD __host__ __device__ __forceinline__
#else
#define GDR_FUSED_ADAMW_HD inline
#endif

namespace gdr::kernels {

// Elements per block; every tensor is cut into ceil(numel / kFusedAdamWChunk) chunks, one
// block each.
constexpr int64_t kFusedAdamWChunk = 8192;

// One tensor of the update. All pointers to contiguous memory of numel elements; grad is
// written (with the clipped gradient) only when FusedAdamWArgs::scale_grad; bf16_param
// (__nv_bfloat16, may be null) receives the rounded (nearest-even) new master.
struct FusedAdamWTensor {
  float* master;
  float* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* bf16_param;
  int64_t numel;
};
static_assert(sizeof(FusedAdamWTensor) == 48, "the host builds the table with this layout");

inline int64_t fused_adamw_chunks(int64_t numel) {
  return (numel + kFusedAdamWChunk - 1) / kFusedAdamWChunk;
}

// The tensor a block works on: the last i < count with chunk_begin[i] <= chunk (tensors
// with no elements own no chunk, so of equal offsets the last is the one with chunks).
// chunk < chunk_begin[count].
GDR_FUSED_ADAMW_HD int fused_adamw_tensor_of(const int64_t* chunk_begin, int count, int64_t chunk) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (chunk_begin[mid] <= chunk) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

struct FusedAdamWArgs {
  // Device memory: tensor_count entries, and tensor_count + 1 chunk offsets (chunk_begin[0]
  // = 0, chunk_begin[i + 1] = chunk_begin[i] + fused_adamw_chunks(tensors[i].numel)).
  const FusedAdamWTensor* tensors = nullptr;
  const int64_t* chunk_begin = nullptr;
  int tensor_count = 0;
  int64_t total_chunks = 0;  // chunk_begin[tensor_count], known on the host
  // The hyperparameters as ATen's functor casts them (double -> float, round to nearest).
  float lr = 0, beta1 = 0, beta2 = 0, weight_decay = 0, eps = 0;
  // The step being taken (1 on the first), as the float ATen reads from its state_steps.
  float step = 1;
  // grad * coef (one FP32 multiply, as _foreach_mul_ with the double coef does) when
  // scale_grad, which also stores that product into grad; grad as is otherwise.
  float coef = 1;
  bool scale_grad = false;
};

// Runs the update over every chunk on `stream`; returns the launch's cudaError_t as an int.
int launch_fused_adamw(const FusedAdamWArgs& args, cudaStream_t stream);

}  // namespace gdr::kernels
