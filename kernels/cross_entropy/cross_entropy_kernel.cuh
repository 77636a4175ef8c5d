// The cross-entropy kernel bodies (device code only; contract and launch rules in
// kernels/cross_entropy/cross_entropy.h). Included by kernels/cross_entropy/cross_entropy.cu, which
// wraps them in
// __global__ kernels, and by the CPU test //tests/ops:cross_entropy_kernel_emulation_test,
// which supplies host stand-ins for the CUDA built-ins (__device__, __forceinline__,
// threadIdx, blockIdx, blockDim, __syncthreads, __shfl_xor_sync, exp2f, logf, fmaf, fmaxf,
// INFINITY, NAN) and runs this very code with one host thread per CUDA thread, so
// indexing, tails, ignored rows and the reduction order are checked on machines without
// a GPU. Storage conversions come from
// kernels/common/storage_element.cuh (a host includer specialises StorageElement for its 16-bit
// types). NOTE: keep this file free of other includes (beyond the headers it names) and of CUDA
// APIs beyond those listed: the emulation test defines exactly those.
//
// Note [Online logsumexp] (see also Note [Cross-entropy determinism] in
// kernels/cross_entropy/cross_entropy.h)
// One pass over the row keeps a running (m, s) with s = sum exp(x - m) over the elements
// seen: a pack whose max exceeds m rescales s by exp(m_old - m_new) first. Two partial
// pairs combine as (M, s1 * exp(m1 - M) + s2 * exp(m2 - M)), M = max(m1, m2), with the
// factor skipped (exactly 1) on the side whose m is M; that keeps threads that saw only
// -inf logits (masked vocab entries) or nothing at s = 0 instead of exp(-inf + inf) = NaN. The
// combine is commutative bit for bit (fmaxf and one float addition), which is what lets the warp
// butterfly leave the same bits on every lane. lse = m + log(s).
#pragma once

#include "kernels/common/storage_element.cuh"
#include "kernels/cross_entropy/cross_entropy.h"

namespace gdr::kernels::cross_entropy_detail {

// A running logsumexp: s = sum exp(x - m) over the elements folded in so far.
struct OnlineLse {
  float m;
  float s;
};

__device__ __forceinline__ OnlineLse empty_lse() { return OnlineLse{-INFINITY, 0.0f}; }

// exp(x) = exp2(x * log2(e)): one FMA and one ex2 per element instead of expf's range
// reduction (about 15 instructions), which at V = 248320 would make the pass compute
// bound. exp2f is accurate to 2 ulp; the argument's rounding adds about |x| * 2^-24
// relative, far below the FP32 tolerance of the tests.
constexpr float kLog2e = 1.4426950408889634f;

// Folds VEC elements, in order (Note [Online logsumexp]).
template <int VEC>
__device__ __forceinline__ void fold_pack(const float (&v)[VEC], OnlineLse& acc) {
  float pack_max = v[0];
#pragma unroll
  for (int k = 1; k < VEC; ++k) pack_max = fmaxf(pack_max, v[k]);
  if (pack_max > acc.m) {
    acc.s = acc.s * exp2f((acc.m - pack_max) * kLog2e);
    acc.m = pack_max;
  }
  // m = -inf only while every element seen is -inf (or NaN): exp2(-inf - 0) = 0 then,
  // where exp2(-inf + inf) would be NaN.
  const float offset = acc.m == -INFINITY ? 0.0f : acc.m * kLog2e;
#pragma unroll
  for (int k = 0; k < VEC; ++k) acc.s += exp2f(fmaf(v[k], kLog2e, -offset));
}

// Commutative bit for bit: combine(a, b) and combine(b, a) give the same bits.
__device__ __forceinline__ OnlineLse combine(const OnlineLse& a, const OnlineLse& b) {
  const float m = fmaxf(a.m, b.m);
  const float sa = a.m == m ? a.s : a.s * exp2f((a.m - m) * kLog2e);
  const float sb = b.m == m ? b.s : b.s * exp2f((b.m - m) * kLog2e);
  return OnlineLse{m, sa + sb};
}

// This thread's share of a row of `vocab` logits: packs tid, tid + threads, ... in
// ascending order, then the scalar tail [packs * VEC, vocab) likewise. Trips where all
// kCrossEntropyUnroll packs are in range load them all before folding any (memory-level
// parallelism without per-load predicates); the remainder goes one pack at a time. Both
// keep the same ascending order.
template <typename T, int VEC>
__device__ __forceinline__ OnlineLse fold_row(const T* x, int64_t vocab) {
  const int64_t threads = blockDim.x;
  const int64_t packs = vocab / VEC;
  OnlineLse acc = empty_lse();
  int64_t q = threadIdx.x;
  for (; q + (kCrossEntropyUnroll - 1) * threads < packs; q += kCrossEntropyUnroll * threads) {
    float v[kCrossEntropyUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kCrossEntropyUnroll; ++u) {
      load_floats<T, VEC>(x + (q + u * threads) * VEC, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kCrossEntropyUnroll; ++u) fold_pack<VEC>(v[u], acc);
  }
  for (; q < packs; q += threads) {
    float v[VEC];
    load_floats<T, VEC>(x + q * VEC, v);
    fold_pack<VEC>(v, acc);
  }
  for (int64_t c = packs * VEC + threadIdx.x; c < vocab; c += threads) {
    const float v[1] = {StorageElement<T>::to_float(x[c])};
    fold_pack<1>(v, acc);
  }
  return acc;
}

// The block's pair, valid in thread 0: xor butterfly inside each warp, then thread 0
// folds the warps' pairs in warp order. `shared` holds 2 * kCrossEntropyMaxThreads / 32
// floats.
__device__ __forceinline__ OnlineLse block_lse(OnlineLse acc, float* shared) {
  const int tid = static_cast<int>(threadIdx.x);
  const int lane = tid % 32, warp = tid / 32;
  const int warps = static_cast<int>(blockDim.x / 32);
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) {
    const OnlineLse other{__shfl_xor_sync(0xffffffffu, acc.m, mask),
                          __shfl_xor_sync(0xffffffffu, acc.s, mask)};
    acc = combine(acc, other);
  }
  float* shared_m = shared;
  float* shared_s = shared + kCrossEntropyMaxThreads / 32;
  if (lane == 0) {
    shared_m[warp] = acc.m;
    shared_s[warp] = acc.s;
  }
  __syncthreads();
  if (tid == 0) {
    acc = OnlineLse{shared_m[0], shared_s[0]};
    for (int w = 1; w < warps; ++w) acc = combine(acc, OnlineLse{shared_m[w], shared_s[w]});
  }
  return acc;
}

__device__ __forceinline__ int64_t label_at(const CrossEntropyProblem& p, int64_t b, int64_t t) {
  return p.labels[b * p.labels_batch_stride + t * p.labels_token_stride];
}

// ----------------------------------------------------------------------------
// CUDA kernel bodies

// Forward of scored row n = blockIdx.x (b = n / (T - 1), t = n % (T - 1)). An ignored row
// reads no logits; the whole block leaves together (no barrier follows).
template <typename T, int VEC>
__device__ __forceinline__ void forward_row(const CrossEntropyForwardArgs& a, float* shared) {
  const CrossEntropyProblem& p = a.problem;
  const int64_t n = blockIdx.x;
  const int64_t b = n / (p.tokens - 1), t = n % (p.tokens - 1);
  const int64_t y = label_at(p, b, t + 1);
  if (y == p.ignore_index) {
    if (threadIdx.x == 0) {
      a.row_loss[n] = 0.0f;
      a.row_lse[n] = 0.0f;
    }
    return;
  }
  const T* x =
      static_cast<const T*>(p.logits) + b * p.logits_batch_stride + t * p.logits_token_stride;
  const OnlineLse acc = block_lse(fold_row<T, VEC>(x, p.vocab), shared);
  if (threadIdx.x == 0) {
    const float lse = acc.m + logf(acc.s);
    a.row_lse[n] = lse;
    // An out-of-range target is never read (the NaN poisons the mean).
    a.row_loss[n] = y >= 0 && y < p.vocab ? lse - StorageElement<T>::to_float(x[y]) : NAN;
  }
}

// The ordered mean (one block of kCrossEntropyReduceThreads threads): thread i sums
// rows i, i + threads, ... in order and counts their non-ignored targets; a fixed tree
// over thread indices adds those. `shared_sum` / `shared_count` hold one slot per thread.
__device__ __forceinline__ void reduce_rows(const CrossEntropyProblem& p, const float* row_loss,
                                            float* loss, float* count, float* shared_sum,
                                            int64_t* shared_count) {
  const int tid = static_cast<int>(threadIdx.x);
  const int64_t rows = p.batch * (p.tokens - 1);
  float sum = 0.0f;
  int64_t counted = 0;
  for (int64_t n = tid; n < rows; n += kCrossEntropyReduceThreads) {
    sum += row_loss[n];
    counted += label_at(p, n / (p.tokens - 1), n % (p.tokens - 1) + 1) != p.ignore_index ? 1 : 0;
  }
  shared_sum[tid] = sum;
  shared_count[tid] = counted;
  __syncthreads();
  for (int stride = kCrossEntropyReduceThreads / 2; stride > 0; stride >>= 1) {
    if (tid < stride) {
      shared_sum[tid] += shared_sum[tid + stride];
      shared_count[tid] += shared_count[tid + stride];
    }
    __syncthreads();
  }
  if (tid == 0) {
    const float total = static_cast<float>(shared_count[0]);
    *count = total;
    *loss = shared_sum[0] / total;  // 0 / 0 = NaN when every row is ignored, as in ATen
  }
}

// Writes pack q of a gradient row: scale * (exp(x - lse) - onehot(y)). The target's place
// in the pack is found once per pack (a 32-bit lane index, -1 when y is elsewhere), so
// each element pays one 32-bit compare instead of 64-bit index arithmetic: the pass is
// short of memory parallelism while it computes, and this was a fifth of its instructions.
template <typename T, int VEC>
__device__ __forceinline__ void store_grad(T* out, int64_t q, const float (&v)[VEC], int64_t y,
                                           float lse, float scale) {
  const float offset = lse * kLog2e;
  const int64_t target_offset = y - q * VEC;
  const int target_lane =
      target_offset >= 0 && target_offset < VEC ? static_cast<int>(target_offset) : -1;
  float g[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    const float onehot = k == target_lane ? 1.0f : 0.0f;
    g[k] = scale * (exp2f(fmaf(v[k], kLog2e, -offset)) - onehot);
  }
  store_floats<T, VEC>(out + q * VEC, g);
}

// Writes `value` to every element of a gradient row (VEC packs, then the tail).
template <typename T, int VEC>
__device__ __forceinline__ void fill_row(T* out, int64_t vocab, float value) {
  const int64_t tid = threadIdx.x, threads = blockDim.x;
  const int64_t packs = vocab / VEC;
  float fill[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) fill[k] = value;
  for (int64_t q = tid; q < packs; q += threads) store_floats<T, VEC>(out + q * VEC, fill);
  for (int64_t c = packs * VEC + tid; c < vocab; c += threads) {
    out[c] = StorageElement<T>::from_float(value);
  }
}

// Backward of row r = blockIdx.x of [B, T, V]: zeros on the last position and on ignored
// rows, NaN on a row whose target is out of range (neither reads the logits), else
// g / count * (exp(x - lse) - onehot(y)). VEC > 1 only when
// both the logits rows and the output rows are 16-byte aligned (the launcher's rule).
template <typename T, int VEC>
__device__ __forceinline__ void backward_row(const CrossEntropyBackwardArgs& a) {
  const CrossEntropyProblem& p = a.problem;
  const int64_t r = blockIdx.x;
  const int64_t b = r / p.tokens, t = r % p.tokens;
  const int64_t tid = threadIdx.x, threads = blockDim.x;
  const int64_t vocab = p.vocab;
  const int64_t packs = vocab / VEC;
  T* out = static_cast<T*>(a.grad_logits) + r * vocab;
  const int64_t y = t + 1 < p.tokens ? label_at(p, b, t + 1) : p.ignore_index;
  if (y == p.ignore_index) {
    fill_row<T, VEC>(out, vocab, 0.0f);
    return;
  }
  if (y < 0 || y >= vocab) {  // an out-of-range target poisons its own row only
    fill_row<T, VEC>(out, vocab, NAN);
    return;
  }
  const T* x =
      static_cast<const T*>(p.logits) + b * p.logits_batch_stride + t * p.logits_token_stride;
  const float lse = a.row_lse[b * (p.tokens - 1) + t];
  const float scale = *a.grad_loss / *a.count;
  // Same trip structure as fold_row: full trips load kCrossEntropyUnroll packs first.
  int64_t q = tid;
  for (; q + (kCrossEntropyUnroll - 1) * threads < packs; q += kCrossEntropyUnroll * threads) {
    float v[kCrossEntropyUnroll][VEC];
#pragma unroll
    for (int u = 0; u < kCrossEntropyUnroll; ++u) {
      load_floats<T, VEC>(x + (q + u * threads) * VEC, v[u]);
    }
#pragma unroll
    for (int u = 0; u < kCrossEntropyUnroll; ++u) {
      store_grad<T, VEC>(out, q + u * threads, v[u], y, lse, scale);
    }
  }
  for (; q < packs; q += threads) {
    float v[VEC];
    load_floats<T, VEC>(x + q * VEC, v);
    store_grad<T, VEC>(out, q, v, y, lse, scale);
  }
  for (int64_t c = packs * VEC + tid; c < vocab; c += threads) {
    const float v[1] = {StorageElement<T>::to_float(x[c])};
    store_grad<T, 1>(out, c, v, y, lse, scale);
  }
}

}  // namespace gdr::kernels::cross_entropy_detail
