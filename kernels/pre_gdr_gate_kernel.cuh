// The pre-GDR gate kernel bodies (device code only; formulas and layouts in
// kernels/pre_gdr_gate.h and the shared design note pre_gdr_gate.md). Included by
// kernels/pre_gdr_gate.cu, which wraps each body in a __global__ kernel and adds the
// mode-specific emission of the backward's per-program sums (atomics live there, never
// here), and by the CPU test //tests/ops:pre_gdr_gate_kernel_emulation_test, which supplies
// host stand-ins and runs these very bodies with one host thread per CUDA thread.
// NOTE: besides kernels/pre_gdr_gate.h and kernels/pre_gdr_gate_math.h this file uses only
// __device__, __forceinline__, __syncthreads, threadIdx, blockIdx, __ldg (float, float4,
// unsigned short, uint2, uint4), float4 / uint2 / uint4, __uint_as_float, __umulhi, expf,
// fabsf, fmaxf, fmaf, and four primitives the includer defines first:
//   float gate_fast_rcp(float x)                   ~1/x (1 ulp; rcp.approx on the GPU)
//   unsigned gate_pack_bf16x2(float lo, float hi)  two BF16, round to nearest even
//   unsigned gate_pack_half2(float lo, float hi)   two FP16, round to nearest even
//   float gate_half_to_float(unsigned bits)        FP16 bits (low 16) to float
// The emulation test defines exactly those.
//
// Why the kernels look like this: at the large shapes the old one-element-per-thread
// kernels were issue-bound (2-byte loads, a 64-bit index split per element, accurate
// log1pf and divisions), not bandwidth-bound. Here a thread owns `vec` consecutive heads
// of a token row (one 16-byte load of BF16 when vec = 8), the per-head constants come
// from a shared table once per thread, row offsets are computed once per row (a
// multiply-high division only for non-token-linear layouts), and the softplus uses the
// cheap formulation of Note [Gate fast math].
#pragma once

#include "kernels/pre_gdr_gate.h"
#include "kernels/pre_gdr_gate_math.h"

namespace gdr::kernels::gate_detail {

// 16-bit storage types (the bits as stored by at::BFloat16 / at::Half).
struct Bf16 {
  unsigned short bits;
};
struct Half {
  unsigned short bits;
};

// ----------------------------------------------------------------------------
// Element conversion, loads and stores

__device__ __forceinline__ float narrow_to_float(Bf16, unsigned bits) {
  return __uint_as_float((bits & 0xffffu) << 16);
}
__device__ __forceinline__ float narrow_to_float(Half, unsigned bits) {
  return gate_half_to_float(bits & 0xffffu);
}
__device__ __forceinline__ unsigned pack_narrow(Bf16, float lo, float hi) {
  return gate_pack_bf16x2(lo, hi);
}
__device__ __forceinline__ unsigned pack_narrow(Half, float lo, float hi) {
  return gate_pack_half2(lo, hi);
}

__device__ __forceinline__ float load_one(const float* p) { return __ldg(p); }
template <typename Narrow>
__device__ __forceinline__ float load_one(const Narrow* p) {
  return narrow_to_float(Narrow{}, __ldg(reinterpret_cast<const unsigned short*>(p)));
}

// V consecutive elements at an aligned address (V = 4 or 8).
template <int V>
__device__ __forceinline__ void load_vector(const float* p, float (&out)[V]) {
#pragma unroll
  for (int i = 0; i < V / 4; ++i) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(p) + i);
    out[4 * i] = q.x;
    out[4 * i + 1] = q.y;
    out[4 * i + 2] = q.z;
    out[4 * i + 3] = q.w;
  }
}
template <int V, typename Narrow>
__device__ __forceinline__ void load_vector(const Narrow* p, float (&out)[V]) {
  unsigned words[V / 2];
  if constexpr (V == 8) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(p));
    words[0] = q.x;
    words[1] = q.y;
    words[2] = q.z;
    words[3] = q.w;
  } else {
    static_assert(V == 4, "16-bit vector loads are 8 or 16 bytes");
    const uint2 q = __ldg(reinterpret_cast<const uint2*>(p));
    words[0] = q.x;
    words[1] = q.y;
  }
#pragma unroll
  for (int i = 0; i < V / 2; ++i) {
    out[2 * i] = narrow_to_float(Narrow{}, words[i]);
    out[2 * i + 1] = narrow_to_float(Narrow{}, words[i] >> 16);
  }
}

// V heads of one row of an operand: one vector load when the plan allows it, else V
// scalar loads stride_h apart. Both give the same values, so the choice never changes
// a result bit.
template <typename In, int V>
__device__ __forceinline__ void load_heads(const GateOperandPlan& op, int64_t row_offset, int h0,
                                           float (&out)[V]) {
  const In* row = static_cast<const In*>(op.data) + row_offset;
  if constexpr (V > 1) {
    if (op.vector) {
      load_vector<V>(row + h0, out);
      return;
    }
  }
  const In* p = row + static_cast<int64_t>(h0) * op.stride_h;
#pragma unroll
  for (int j = 0; j < V; ++j) out[j] = load_one(p + j * op.stride_h);
}

__device__ __forceinline__ void store_one(float* p, float v) { *p = v; }
template <typename Narrow>
__device__ __forceinline__ void store_one(Narrow* p, float v) {
  *reinterpret_cast<unsigned short*>(p) =
      static_cast<unsigned short>(pack_narrow(Narrow{}, v, 0.0f) & 0xffffu);
}

// V consecutive elements of a contiguous output; vector stores when aligned.
template <int V>
__device__ __forceinline__ void store_heads(float* p, const float (&v)[V], bool vector) {
  if constexpr (V >= 4) {
    if (vector) {
#pragma unroll
      for (int i = 0; i < V / 4; ++i) {
        float4 q;
        q.x = v[4 * i];
        q.y = v[4 * i + 1];
        q.z = v[4 * i + 2];
        q.w = v[4 * i + 3];
        reinterpret_cast<float4*>(p)[i] = q;
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) p[j] = v[j];
}
template <int V, typename Narrow>
__device__ __forceinline__ void store_heads(Narrow* p, const float (&v)[V], bool vector) {
  if constexpr (V >= 4) {
    if (vector) {
      if constexpr (V == 8) {
        uint4 q;
        q.x = pack_narrow(Narrow{}, v[0], v[1]);
        q.y = pack_narrow(Narrow{}, v[2], v[3]);
        q.z = pack_narrow(Narrow{}, v[4], v[5]);
        q.w = pack_narrow(Narrow{}, v[6], v[7]);
        *reinterpret_cast<uint4*>(p) = q;
      } else {
        uint2 q;
        q.x = pack_narrow(Narrow{}, v[0], v[1]);
        q.y = pack_narrow(Narrow{}, v[2], v[3]);
        *reinterpret_cast<uint2*>(p) = q;
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < V; ++j) store_one(p + j, v[j]);
}

__device__ __forceinline__ float load_param(const void* p, ScalarKind kind, int64_t i) {
  switch (kind) {
    case ScalarKind::kFloat32: return __ldg(static_cast<const float*>(p) + i);
    case ScalarKind::kFloat16:
      return gate_half_to_float(__ldg(static_cast<const unsigned short*>(p) + i));
    case ScalarKind::kBFloat16:
      return narrow_to_float(Bf16{}, __ldg(static_cast<const unsigned short*>(p) + i));
  }
  return 0.0f;
}

__device__ __forceinline__ void store_param(void* p, ScalarKind kind, int64_t i, float v) {
  switch (kind) {
    case ScalarKind::kFloat32: static_cast<float*>(p)[i] = v; return;
    case ScalarKind::kFloat16: store_one(static_cast<Half*>(p) + i, v); return;
    case ScalarKind::kBFloat16: store_one(static_cast<Bf16*>(p) + i, v); return;
  }
}

// ----------------------------------------------------------------------------
// Row addressing

__device__ __forceinline__ void split_token(const GateTokenSplit& s, int64_t t, int64_t& i0,
                                            int64_t& i1) {
  if (s.fast) {
    const unsigned n = static_cast<unsigned>(t);
    const unsigned q = (__umulhi(n, s.magic) + n) >> s.shift;
    i0 = q;
    i1 = static_cast<int64_t>(n - q * static_cast<unsigned>(s.dim1));
  } else {
    i0 = t / s.dim1;
    i1 = t - i0 * s.dim1;
  }
}

template <bool kSplit>
__device__ __forceinline__ int64_t row_offset(const GateOperandPlan& op, int64_t t, int64_t i0,
                                              int64_t i1) {
  if constexpr (kSplit) return i0 * op.stride0 + i1 * op.stride1;
  return t * op.stride_t;
}

// ----------------------------------------------------------------------------
// Math
//
// Note [Gate fast math]: softplus(pre) = max(pre, 0) + log1p(w) with w = exp(-|pre|) in
// (0, 1], and log1p(w) = 2 atanh(s), s = w / (2 + w) in [0, 1/3], summed as the odd
// series 2s (1 + s^2/3 + ... + s^12/13) (truncation below 2e-8 relative). One accurate
// expf, one approximate reciprocal and eight FMAs replace expf + log1pf; the same w gives
// the derivative sigmoid(pre) = 1 / (1 + w) (pre >= 0) or w / (1 + w) with one more
// reciprocal, instead of an IEEE division. Relative error of softplus below 1e-6 (the
// emulation test checks it against FP64 over the whole range), inside the 1e-5 the GPU
// test allows against the libtorch composite. Above the threshold the value is `pre` and
// the derivative 1, exactly as PyTorch (Note [Softplus threshold]).
__device__ __forceinline__ float gate_log1p_unit(float w) {
  const float s = w * gate_fast_rcp(2.0f + w);
  const float s2 = s * s;
  float p = 1.0f / 13.0f;
  p = fmaf(p, s2, 1.0f / 11.0f);
  p = fmaf(p, s2, 1.0f / 9.0f);
  p = fmaf(p, s2, 1.0f / 7.0f);
  p = fmaf(p, s2, 1.0f / 5.0f);
  p = fmaf(p, s2, 1.0f / 3.0f);
  const float two_s = s + s;
  return fmaf(two_s * s2, p, two_s);
}

__device__ __forceinline__ float gate_softplus_fast(float pre) {
  const float w = expf(-fabsf(pre));
  const float softplus = fmaxf(pre, 0.0f) + gate_log1p_unit(w);
  return pre > kSoftplusThreshold ? pre : softplus;
}

__device__ __forceinline__ void gate_softplus_and_grad_fast(float pre, float& softplus,
                                                            float& grad) {
  const float w = expf(-fabsf(pre));
  const float r = gate_fast_rcp(1.0f + w);
  softplus = fmaxf(pre, 0.0f) + gate_log1p_unit(w);
  grad = pre >= 0.0f ? r : w * r;
  if (pre > kSoftplusThreshold) {
    softplus = pre;
    grad = 1.0f;
  }
}

__device__ __forceinline__ float gate_sigmoid_fast(float x) {
  return gate_fast_rcp(1.0f + expf(-x));
}

// ----------------------------------------------------------------------------
// Forward: block = block_x head-vector lanes x block_y token rows; thread (x, y) takes head
// vectors x, x + block_x, ... and token rows row0 + k * block_y (k < items) of its block,
// all loads of a head vector's rows before any math or store (the stores could alias the
// loads as far as the compiler knows, which would otherwise serialise them). `table`:
// 2 * kForwardTableHeads floats of shared memory.
template <typename In, int V, bool kSplit>
__device__ __forceinline__ void gate_forward_block(const GateForwardPlan& p, float* table) {
  const int tid = threadIdx.x;
  const int threads = p.block_x * p.block_y;
  const bool use_table = p.heads <= kForwardTableHeads;
  if (use_table) {
    for (int h = tid; h < p.heads; h += threads) {
      table[h] = -expf(load_param(p.A_log, p.param_kind, h));
      table[kForwardTableHeads + h] = load_param(p.dt_bias, p.param_kind, h);
    }
    __syncthreads();
  }
  const int x = tid % p.block_x;
  const int y = tid / p.block_x;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * p.block_y * p.items + y;
  for (int hv = x; hv < p.head_vecs; hv += p.block_x) {
    const int h0 = hv * V;
    float neg_exp_A[V], dt[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      neg_exp_A[j] = use_table ? table[h0 + j] : -expf(load_param(p.A_log, p.param_kind, h0 + j));
      dt[j] = use_table ? table[kForwardTableHeads + h0 + j]
                        : load_param(p.dt_bias, p.param_kind, h0 + j);
    }
    constexpr int kMaxItems = kForwardMaxItems;
    float a_val[kMaxItems][V], b_val[kMaxItems][V];
#pragma unroll
    for (int k = 0; k < kMaxItems; ++k) {
      const int64_t t = row0 + static_cast<int64_t>(k) * p.block_y;
      if (k < p.items && t < p.tokens) {
        int64_t i0 = 0, i1 = 0;
        if constexpr (kSplit) split_token(p.token_split, t, i0, i1);
        load_heads<In, V>(p.a, row_offset<kSplit>(p.a, t, i0, i1), h0, a_val[k]);
        load_heads<In, V>(p.b, row_offset<kSplit>(p.b, t, i0, i1), h0, b_val[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < kMaxItems; ++k) {
      const int64_t t = row0 + static_cast<int64_t>(k) * p.block_y;
      if (k < p.items && t < p.tokens) {
        float g[V], beta[V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          g[j] = neg_exp_A[j] * gate_softplus_fast(a_val[k][j] + dt[j]);
          beta[j] = gate_sigmoid_fast(b_val[k][j]);
        }
        const int64_t out = t * p.heads + h0;
        store_heads<V>(p.g + out, g, p.out_vector);
        store_heads<V>(p.beta + out, beta, p.out_vector);
      }
    }
  }
}

// ----------------------------------------------------------------------------
// Backward: one program = block_t tokens x block_h heads, laid out as in Note [Gate head
// vectors]. The grid is one-dimensional with the head-programs of a token range adjacent
// (program p = token-program p / programs_h, head-program p % programs_h): programs that
// read neighbouring 32-byte sectors of the same rows run together, instead of programs_t
// blocks apart as with a (programs_t, programs_h) grid. Thread (row, lane) keeps its 2 * V per-head
// sums in registers in token order; the rows are then combined by a fixed-shape tree in
// shared memory (stride = half the next power of two of rows, halving; row r adds row
// r + stride when that row exists), so the per-program sums are a pure function of the
// shape and the tile. `smem`: gate_backward_shared_floats(...) floats.
//
// Returns true on the threads that hold a program total (row 0, real heads): heads
// head0 .. head0 + V - 1 of total_A_log / total_dt_bias. The caller emits them (atomics or
// a partial row), after which no thread may touch `smem` before a __syncthreads.
// Token rows a thread loads before computing: about 32 values of the four operands (96 or
// 128 bytes in flight per thread) while keeping registers low enough for two 256-thread
// programs per SM.
template <int V>
constexpr int backward_batch() {
  return V == 8 ? 1 : V == 4 ? 2 : 4;
}

template <typename In, int V, bool kSplit>
__device__ __forceinline__ bool gate_backward_program(const GateBackwardPlan& p, float* smem,
                                                      float (&total_A_log)[V],
                                                      float (&total_dt_bias)[V], int& head0) {
  const GateBackwardLaunch& launch = p.launch;
  const int tid = threadIdx.x;
  const int lanes = launch.lanes;
  const int rows = launch.rows;
  const int64_t program_t = static_cast<int64_t>(blockIdx.x) / launch.programs_h;
  const int head_base = static_cast<int>(blockIdx.x % launch.programs_h) * p.block_h;
  float* table = smem;                 // [2][block_h]: -exp(A_log), dt_bias
  float* tree = smem + 2 * p.block_h;  // [2][V][rows][lanes]
  for (int i = tid; i < p.block_h; i += launch.threads) {
    const int h = head_base + i;
    if (h < p.heads) {
      table[i] = -expf(load_param(p.A_log, p.param_kind, h));
      table[p.block_h + i] = load_param(p.dt_bias, p.param_kind, h);
    }
  }
  __syncthreads();

  const int lane = tid % lanes;
  const int row = tid / lanes;
  const bool active = row < rows;
  const int h0 = head_base + lane * V;
  const bool has_heads = active && h0 < p.heads;
  float acc_A_log[V], acc_dt_bias[V];
#pragma unroll
  for (int j = 0; j < V; ++j) acc_A_log[j] = acc_dt_bias[j] = 0.0f;

  if (has_heads) {
    float neg_exp_A[V], dt[V];
#pragma unroll
    for (int j = 0; j < V; ++j) {
      neg_exp_A[j] = table[lane * V + j];
      dt[j] = table[p.block_h + lane * V + j];
    }
    In* da = static_cast<In*>(p.da);
    In* db = static_cast<In*>(p.db);
    constexpr int kBatch = backward_batch<V>();
    const int64_t t_begin = program_t * p.block_t;
    const int64_t t_end = t_begin + p.block_t < p.tokens ? t_begin + p.block_t : p.tokens;
    for (int64_t t0 = t_begin + row; t0 < t_end; t0 += static_cast<int64_t>(kBatch) * rows) {
      float a_val[kBatch][V], b_val[kBatch][V], dg[kBatch][V], dbeta[kBatch][V];
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t t = t0 + static_cast<int64_t>(k) * rows;
        if (t < t_end) {
          int64_t i0 = 0, i1 = 0;
          if constexpr (kSplit) split_token(p.token_split, t, i0, i1);
          load_heads<In, V>(p.a, row_offset<kSplit>(p.a, t, i0, i1), h0, a_val[k]);
          load_heads<In, V>(p.b, row_offset<kSplit>(p.b, t, i0, i1), h0, b_val[k]);
          load_heads<float, V>(p.grad_g, row_offset<kSplit>(p.grad_g, t, i0, i1), h0, dg[k]);
          load_heads<float, V>(p.grad_beta, row_offset<kSplit>(p.grad_beta, t, i0, i1), h0,
                               dbeta[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < kBatch; ++k) {
        const int64_t t = t0 + static_cast<int64_t>(k) * rows;
        if (t < t_end) {
          float da_val[V], db_val[V];
#pragma unroll
          for (int j = 0; j < V; ++j) {
            float softplus, softplus_grad;
            gate_softplus_and_grad_fast(a_val[k][j] + dt[j], softplus, softplus_grad);
            const float g = neg_exp_A[j] * softplus;
            da_val[j] = dg[k][j] * (neg_exp_A[j] * softplus_grad);
            const float beta = gate_sigmoid_fast(b_val[k][j]);
            db_val[j] = dbeta[k][j] * beta * (1.0f - beta);
            acc_A_log[j] = fmaf(dg[k][j], g, acc_A_log[j]);
            acc_dt_bias[j] = acc_dt_bias[j] + da_val[j];
          }
          const int64_t out = t * p.heads + h0;
          store_heads<V>(da + out, da_val, p.out_vector);
          store_heads<V>(db + out, db_val, p.out_vector);
        }
      }
    }
  }

  // Fixed-shape tree over the rows (see above).
  if (active) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      tree[(j * rows + row) * lanes + lane] = acc_A_log[j];
      tree[((V + j) * rows + row) * lanes + lane] = acc_dt_bias[j];
    }
  }
  int span = 1;
  while (span < rows) span <<= 1;
  for (int stride = span >> 1; stride > 0; stride >>= 1) {
    __syncthreads();
    if (active && row < stride && row + stride < rows) {
#pragma unroll
      for (int q = 0; q < 2 * V; ++q) {
        tree[(q * rows + row) * lanes + lane] += tree[(q * rows + row + stride) * lanes + lane];
      }
    }
  }
  __syncthreads();
  head0 = h0;
  if (row != 0 || !has_heads) return false;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    total_A_log[j] = tree[j * rows * lanes + lane];
    total_dt_bias[j] = tree[(V + j) * rows * lanes + lane];
  }
  return true;
}

// Ordered mode: the program's partial row (row program_t = blockIdx.x / programs_h of
// [programs_t, 2, heads]); every slot is written by exactly one program, so no zero-fill
// is needed.
template <int V>
__device__ __forceinline__ void gate_write_partial_row(float* partials, const GateBackwardPlan& p,
                                                       int h0, const float (&total_A_log)[V],
                                                       const float (&total_dt_bias)[V]) {
  const int64_t heads = p.heads;
  float* row = partials + static_cast<int64_t>(blockIdx.x) / p.launch.programs_h * 2 * heads;
#pragma unroll
  for (int j = 0; j < V; ++j) {
    row[h0 + j] = total_A_log[j];
    row[heads + h0 + j] = total_dt_bias[j];
  }
}

// ----------------------------------------------------------------------------
// Ordered second pass: block = kReduceSlotsPerBlock lanes x kReduceRows rows. Lane = one of
// the 2 * heads output slots (coalesced across a warp); row r sums partial rows r, r + R,
// r + 2R, ... sequentially; then row 0 adds the R row sums in row order. The order depends
// on programs_t only, never on scheduling. Writes dA_log / ddt_bias in the parameter dtype
// (no cast kernel afterwards). `sums`: kReduceRows * kReduceSlotsPerBlock floats.
__device__ __forceinline__ void gate_reduce_partials_block(const float* partials,
                                                           int64_t programs_t, int64_t heads,
                                                           ScalarKind param_kind, void* dA_log,
                                                           void* ddt_bias, float* sums) {
  const int lane = threadIdx.x % kReduceSlotsPerBlock;
  const int row = threadIdx.x / kReduceSlotsPerBlock;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * kReduceSlotsPerBlock + lane;
  const int64_t slots = 2 * heads;
  float acc = 0.0f;
  if (slot < slots) {
#pragma unroll 8
    for (int64_t p = row; p < programs_t; p += kReduceRows)
      acc += __ldg(partials + p * slots + slot);
  }
  sums[row * kReduceSlotsPerBlock + lane] = acc;
  __syncthreads();
  if (row != 0 || slot >= slots) return;
  float total = 0.0f;
  for (int r = 0; r < kReduceRows; ++r) total += sums[r * kReduceSlotsPerBlock + lane];
  if (slot < heads) {
    store_param(dA_log, param_kind, slot, total);
  } else {
    store_param(ddt_bias, param_kind, slot - heads, total);
  }
}

}  // namespace gdr::kernels::gate_detail
