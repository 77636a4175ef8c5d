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

#include <cuda/atomic>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/common/storage_element.cuh"
#include "kernels/pre_gdr_gate/pre_gdr_gate.h"
#include "kernels/pre_gdr_gate/pre_gdr_gate_element.cuh"
#include "kernels/pre_gdr_gate/pre_gdr_gate_math.h"

namespace gdr::kernels {
namespace {

// Division by a runtime constant as a multiply-high and a shift (the magic-number method
// PyTorch's IntDivider uses): the kernels divide twice per element (flat index -> token,
// token -> (i0, i1)), and a hardware-less integer divide costs more than the math.
// Valid for dividends and divisors below 2^31.
struct FastDivider32 {
  uint32_t divisor = 1, magic = 0, shift = 0;
  FastDivider32() = default;
  explicit FastDivider32(uint32_t d) : divisor(d) {
    for (shift = 0; shift < 32; ++shift) {
      if ((uint32_t{1} << shift) >= divisor) break;
    }
    const uint64_t one = 1;
    magic = static_cast<uint32_t>(((one << 32) * ((one << shift) - divisor)) / divisor + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    const uint32_t t = __umulhi(n, magic);
    return (t + n) >> shift;
  }
};

template <typename Index>
struct Divider {  // 64-bit fallback: plain division
  Index divisor;
  Divider() = default;
  explicit Divider(Index d) : divisor(d) {}
  __device__ __forceinline__ Index div(Index n) const { return n / divisor; }
};

template <typename Index>
using DividerFor =
    std::conditional_t<std::is_same_v<Index, int32_t>, FastDivider32, Divider<Index>>;

// Token index -> (i0, i1) of a strided [dim0, dim1, heads] operand. Index is 32-bit when
// the whole problem fits, since 64-bit arithmetic costs several times more.
template <typename Index>
struct TokenDecoder {
  DividerFor<Index> dim1;
  __device__ __forceinline__ void split(Index token, Index& i0, Index& i1) const {
    i0 = static_cast<Index>(dim1.div(token));
    i1 = token - i0 * static_cast<Index>(dim1.divisor);
  }
};

// Element offset of (i0, i1, h). kFlat: every operand is contiguous [tokens, heads], so the
// offset is the flat index and no token split is needed; this is the common case and it
// saves the divisions and multiplies that otherwise make these kernels instruction-bound.
template <typename Index>
__device__ __forceinline__ Index strided_offset(const StridedOperand& op, Index i0, Index i1,
                                                Index h) {
  return i0 * static_cast<Index>(op.stride0) + i1 * static_cast<Index>(op.stride1) +
         h * static_cast<Index>(op.stride_h);
}

// Note [Gate reduce launched early]: on Hopper the ordered second pass is launched with
// programmatic stream serialisation (PDL), so the GPU schedules its block while the
// element pass is finishing instead of after it: a plain second launch costs its launch
// latency on the GPU (and, in eager calls, that latency is not hidden behind host work).
// The element pass allows the dependent launch once its rows are summed; the reduce
// kernel's first act is griddepcontrol.wait, which returns only when the whole element
// grid has completed and its memory operations are visible, so the reduce reads exactly
// what a stream-ordered launch would read: same order, same bits. Without the launch
// attribute (pre-Hopper devices) the wait returns at once and the trigger is a no-op.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// ----------------------------------------------------------------------------
// CUDA kernels

// Each thread handles kForwardItemsPerThread elements kForwardThreads apart (coalesced per
// instruction). All loads are issued before any store: without that, the compiler must
// assume g/beta stores may alias a/b and serialises load -> store -> load, leaving too
// few bytes in flight to approach HBM bandwidth.
// Large problems take 8 items per thread (more bytes in flight per thread); small ones 2,
// so that the grid still covers every SM (131k elements at the 0.8B shape would
// otherwise be 64 blocks on a 132-SM GPU).
constexpr int kForwardThreads = 256;
constexpr int kForwardItemsLarge = 8;
constexpr int kForwardItemsSmall = 2;
constexpr int64_t kForwardSmallLimit = int64_t{1} << 21;

// Per-head constants (-exp(A_log), dt_bias) come from a shared-memory table when the head
// count fits, so the per-element work is the activation math alone.
constexpr int kForwardTableHeads = 1024;

// No min-blocks hint: capping registers at 32 for full occupancy made this kernel slower
// (it is issue-bound on the accurate expf/log1pf, not latency-bound; measured:
// docs/benchmarks.md, Decisions).
template <typename In, typename Param, typename Index, bool kFlat, int kForwardItemsPerThread>
__global__ void __launch_bounds__(kForwardThreads)
    gate_forward_kernel(GateForwardArgs args, Index total, DividerFor<Index> heads,
                        TokenDecoder<Index> dec) {
  __shared__ float neg_exp_A_table[kForwardTableHeads];
  __shared__ float dt_table[kForwardTableHeads];
  const In* a = static_cast<const In*>(args.a.data);
  const In* b = static_cast<const In*>(args.b.data);
  const Param* A_log = static_cast<const Param*>(args.A_log);
  const Param* dt_bias = static_cast<const Param*>(args.dt_bias);
  const Index num_heads = static_cast<Index>(heads.divisor);
  const bool use_table = num_heads <= kForwardTableHeads;
  if (use_table) {
    for (Index h = threadIdx.x; h < num_heads; h += kForwardThreads) {
      neg_exp_A_table[h] = -expf(load_float_ldg(A_log + h));
      dt_table[h] = load_float_ldg(dt_bias + h);
    }
    __syncthreads();
  }
  const Index base =
      static_cast<Index>(blockIdx.x) * (kForwardThreads * kForwardItemsPerThread) + threadIdx.x;
  float a_val[kForwardItemsPerThread], b_val[kForwardItemsPerThread];
  Index head[kForwardItemsPerThread];
#pragma unroll
  for (int item = 0; item < kForwardItemsPerThread; ++item) {
    const Index e = base + item * kForwardThreads;
    if (e < total) {
      const Index token = static_cast<Index>(heads.div(e));
      const Index h = e - token * num_heads;
      head[item] = h;
      if constexpr (kFlat) {
        a_val[item] = load_float_ldg(a + e);
        b_val[item] = load_float_ldg(b + e);
      } else {
        Index i0, i1;
        dec.split(token, i0, i1);
        a_val[item] = load_float_ldg(a + strided_offset(args.a, i0, i1, h));
        b_val[item] = load_float_ldg(b + strided_offset(args.b, i0, i1, h));
      }
    }
  }
#pragma unroll
  for (int item = 0; item < kForwardItemsPerThread; ++item) {
    const Index e = base + item * kForwardThreads;
    if (e < total) {
      const Index h = head[item];
      const float neg_exp_A = use_table ? neg_exp_A_table[h] : -expf(load_float_ldg(A_log + h));
      const float dt = use_table ? dt_table[h] : load_float_ldg(dt_bias + h);
      args.g[e] = neg_exp_A * gate_softplus(a_val[item] + dt);
      args.beta[e] = gate_sigmoid(b_val[item]);
    }
  }
}

// Vectorised forward (the common case: every operand contiguous [tokens, heads], heads a
// multiple of kForwardVec, a and b aligned to kForwardVec elements, heads <= the table).
// Each thread owns kForwardVec adjacent heads for its whole life: a block is `rows`
// token rows of `lanes = heads / kForwardVec` threads, so thread t covers the flat
// elements base + t * kForwardVec + [0, kForwardVec) of every row group, and its head
// offset (t % lanes) * kForwardVec is fixed. Per element that removes the index division,
// the per-element table lookups and the table/no-table branch of the scalar kernel, and
// it loads a and b as one 8-byte (16-bit types) or 16-byte (FP32) vector and stores g and
// beta as float4. The math is the scalar kernel's, call for call (gate_softplus,
// gate_sigmoid, the same -expf(A_log) table), so every output bit is the same.
// Items (token-row groups) per thread: all loads issued before the math, as in the scalar
// kernel.
constexpr int kForwardVec = 4;

template <typename In, typename Param, int kItems>
__global__ void __launch_bounds__(kForwardThreads)
    gate_forward_vec_kernel(GateForwardArgs args, int32_t total, int32_t lanes, int32_t row_group) {
  __shared__ float neg_exp_A_table[kForwardTableHeads];
  __shared__ float dt_table[kForwardTableHeads];
  const int32_t heads = lanes * kForwardVec;
  for (int32_t h = threadIdx.x; h < heads; h += blockDim.x) {
    neg_exp_A_table[h] = -expf(load_float_ldg(static_cast<const Param*>(args.A_log) + h));
    dt_table[h] = load_float_ldg(static_cast<const Param*>(args.dt_bias) + h);
  }
  __syncthreads();
  // row_group = (blockDim.x / lanes) * heads elements: the threads past the last full
  // token row of the block have nothing to do.
  const int32_t offset = static_cast<int32_t>(threadIdx.x) * kForwardVec;
  if (offset >= row_group) return;
  const int32_t h0 = (static_cast<int32_t>(threadIdx.x) % lanes) * kForwardVec;
  float neg_exp_A[kForwardVec], dt[kForwardVec];
#pragma unroll
  for (int j = 0; j < kForwardVec; ++j) {
    neg_exp_A[j] = neg_exp_A_table[h0 + j];
    dt[j] = dt_table[h0 + j];
  }
  const In* a = static_cast<const In*>(args.a.data);
  const In* b = static_cast<const In*>(args.b.data);
  const int32_t base = static_cast<int32_t>(blockIdx.x) * (row_group * kItems) + offset;
  float a_val[kItems][kForwardVec], b_val[kItems][kForwardVec];
#pragma unroll
  for (int item = 0; item < kItems; ++item) {
    const int32_t e = base + item * row_group;
    if (e < total) {  // total is a multiple of kForwardVec: a vector is all in or all out
      load_floats_ldg<In, kForwardVec>(a + e, a_val[item]);
      load_floats_ldg<In, kForwardVec>(b + e, b_val[item]);
    }
  }
#pragma unroll
  for (int item = 0; item < kItems; ++item) {
    const int32_t e = base + item * row_group;
    if (e < total) {
      float g[kForwardVec], beta[kForwardVec];
#pragma unroll
      for (int j = 0; j < kForwardVec; ++j) {
        g[j] = neg_exp_A[j] * gate_softplus_select(a_val[item][j] + dt[j]);
        beta[j] = gate_sigmoid(b_val[item][j]);
      }
      store_floats<float, kForwardVec>(args.g + e, g);
      store_floats<float, kForwardVec>(args.beta + e, beta);
    }
  }
}

// One program = block_t tokens x block_h heads, tile.threads threads; rows = threads /
// block_h. Note [Gate backward virtual rows]: the in-block order of the per-head sums
// (dg * g and da), a pure function of the tile, shared by the scalar and the vectorised
// kernel so that both give the same per-program sums bit for bit. The program's tokens
// t_begin + i are dealt to R = kGateVirtualRowsPerRow * rows virtual rows, token i to
// virtual row i % R. Each virtual row sums its tokens' terms from 0.0f in token order;
// the program's sum is then the virtual-row sums added from 0.0f in virtual-row order,
// over rows 0 .. min(R, block_t) - 1 (a row past block_t has no token: its sum is +0.0f,
// and adding +0.0f to a running sum that started at +0.0f never changes it, so leaving
// those rows out is exact).
// - Scalar kernel: thread (row, lane) owns head lane and walks tokens row, row + rows,
//   ... in batches of kBackwardBatch = kGateVirtualRowsPerRow (all loads of a batch
//   before its stores, as in the forward). The k-th token of every batch falls in virtual
//   row row + k * rows, so the thread keeps one pair of sums per k.
// - Vectorised kernel (gate_backward_rows_vec): thread (vrow, vlane) owns kBackwardVec =
//   kGateVirtualRowsPerRow adjacent heads and walks the tokens of virtual row vrow (vrow,
//   vrow + R, ...) with one 8- or 16-byte load per operand and token; R = threads /
//   (block_h / kBackwardVec) virtual rows are exactly its thread rows.
// The scalar pass computes each element with gate_backward_element, the vectorised one
// four at a time with gate_backward_elements4, which gives gate_backward_element's bits
// for every input (Note [Gate backward fast paths]), so da, db and the per-head sums are
// the same bits whichever kernel runs.
constexpr int kBackwardBatch = kGateVirtualRowsPerRow;
constexpr int kBackwardVec = kGateVirtualRowsPerRow;
// Tokens (of kBackwardVec heads) loaded per round. 1: 64 registers (ptxas, sm_90), so
// four 256-thread programs fit an SM and the 512 programs of the 65536 x 64 ordered tile
// are one wave on 132 SMs; 2 took 73-77 registers (three programs per SM, 1.3 waves).
// Either way a round is 4 elements in flight per thread, as the scalar pass's batch.
constexpr int kBackwardVecBatch = 1;
static_assert(kBackwardVec == kForwardVec, "the backward reuses the forward's vector loads");
static_assert(kBackwardVec == 4, "the vectorised pass computes with gate_backward_elements4");

// Scalar element pass (any strides, any head count): fills row_sums ([2][R][block_h]) in
// the order of Note [Gate backward virtual rows].
template <typename In, typename Param, typename Index, bool kFlat>
__device__ __forceinline__ void gate_backward_rows_scalar(const GateBackwardArgs& args, Index heads,
                                                          TokenDecoder<Index> dec, Index t_begin,
                                                          Index t_end, int block_h,
                                                          float* row_sums) {
  const In* a = static_cast<const In*>(args.a.data);
  const In* b = static_cast<const In*>(args.b.data);
  const float* grad_g = static_cast<const float*>(args.grad_g.data);
  const float* grad_beta = static_cast<const float*>(args.grad_beta.data);
  In* da = static_cast<In*>(args.da);
  In* db = static_cast<In*>(args.db);
  const int rows = blockDim.x / block_h;
  const int virtual_rows = kBackwardBatch * rows;
  const int lane = threadIdx.x % block_h;
  const int row = threadIdx.x / block_h;
  const Index h = static_cast<Index>(blockIdx.y) * block_h + lane;

  float sum_A_log[kBackwardBatch], sum_dt_bias[kBackwardBatch];  // virtual row row + k * rows
#pragma unroll
  for (int k = 0; k < kBackwardBatch; ++k) sum_A_log[k] = sum_dt_bias[k] = 0.0f;
  if (h < heads) {
    const float neg_exp_A = -expf(load_float_ldg(static_cast<const Param*>(args.A_log) + h));
    const float dt = load_float_ldg(static_cast<const Param*>(args.dt_bias) + h);
    for (Index t0 = t_begin + row; t0 < t_end; t0 += kBackwardBatch * rows) {
      float a_val[kBackwardBatch], b_val[kBackwardBatch], dg[kBackwardBatch], dbeta[kBackwardBatch];
#pragma unroll
      for (int k = 0; k < kBackwardBatch; ++k) {
        const Index t = t0 + k * rows;
        if (t < t_end) {
          if constexpr (kFlat) {
            const Index e = t * heads + h;
            a_val[k] = load_float_ldg(a + e);
            b_val[k] = load_float_ldg(b + e);
            dg[k] = load_float_ldg(grad_g + e);
            dbeta[k] = load_float_ldg(grad_beta + e);
          } else {
            Index i0, i1;
            dec.split(t, i0, i1);
            a_val[k] = load_float_ldg(a + strided_offset(args.a, i0, i1, h));
            b_val[k] = load_float_ldg(b + strided_offset(args.b, i0, i1, h));
            dg[k] = load_float_ldg(grad_g + strided_offset(args.grad_g, i0, i1, h));
            dbeta[k] = load_float_ldg(grad_beta + strided_offset(args.grad_beta, i0, i1, h));
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kBackwardBatch; ++k) {
        const Index t = t0 + k * rows;
        if (t < t_end) {
          float da_value, db_value;
          gate_backward_element(a_val[k], b_val[k], dg[k], dbeta[k], neg_exp_A, dt, da_value,
                                db_value, sum_A_log[k], sum_dt_bias[k]);
          const Index e = t * heads + h;
          store_float(da + e, da_value);
          store_float(db + e, db_value);
        }
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kBackwardBatch; ++k) {
    const int virtual_row = row + k * rows;
    row_sums[virtual_row * block_h + lane] = sum_A_log[k];
    row_sums[(virtual_rows + virtual_row) * block_h + lane] = sum_dt_bias[k];
  }
}

// Vectorised element pass (every operand contiguous [tokens, heads], heads and block_h
// multiples of kBackwardVec, 32-bit indices, a, b, da, db aligned to kBackwardVec
// elements and grad_g, grad_beta to 16 bytes; backward_vectorisable): the forward's
// recipe. Each thread owns kBackwardVec adjacent heads for the whole program, so the
// per-head constants live in registers and there is no per-element index division;
// a, b (8 bytes for 16-bit types, 16 for FP32), grad_g, grad_beta (16 bytes) are loaded
// and da, db stored as one vector per token. Same order as the scalar pass (Note [Gate
// backward virtual rows]).
template <typename In, typename Param>
__device__ __forceinline__ void gate_backward_rows_vec(const GateBackwardArgs& args, int32_t heads,
                                                       int32_t t_begin, int32_t t_end, int block_h,
                                                       float* row_sums) {
  const In* a = static_cast<const In*>(args.a.data);
  const In* b = static_cast<const In*>(args.b.data);
  const float* grad_g = static_cast<const float*>(args.grad_g.data);
  const float* grad_beta = static_cast<const float*>(args.grad_beta.data);
  In* da = static_cast<In*>(args.da);
  In* db = static_cast<In*>(args.db);
  const int vlanes = block_h / kBackwardVec;
  const int virtual_rows = blockDim.x / vlanes;  // = kGateVirtualRowsPerRow * rows
  const int vlane = threadIdx.x % vlanes;
  const int vrow = threadIdx.x / vlanes;
  const int32_t h0 = static_cast<int32_t>(blockIdx.y) * block_h + vlane * kBackwardVec;

  float sum_A_log[kBackwardVec], sum_dt_bias[kBackwardVec];  // head h0 + j, virtual row vrow
#pragma unroll
  for (int j = 0; j < kBackwardVec; ++j) sum_A_log[j] = sum_dt_bias[j] = 0.0f;
  if (h0 < heads) {  // heads is a multiple of kBackwardVec: a vector is all in or all out
    float neg_exp_A[kBackwardVec], dt[kBackwardVec];
#pragma unroll
    for (int j = 0; j < kBackwardVec; ++j) {
      neg_exp_A[j] = -expf(load_float_ldg(static_cast<const Param*>(args.A_log) + h0 + j));
      dt[j] = load_float_ldg(static_cast<const Param*>(args.dt_bias) + h0 + j);
    }
    for (int32_t t0 = t_begin + vrow; t0 < t_end; t0 += kBackwardVecBatch * virtual_rows) {
      float a_val[kBackwardVecBatch][kBackwardVec], b_val[kBackwardVecBatch][kBackwardVec];
      float dg[kBackwardVecBatch][kBackwardVec], dbeta[kBackwardVecBatch][kBackwardVec];
#pragma unroll
      for (int k = 0; k < kBackwardVecBatch; ++k) {
        const int32_t t = t0 + k * virtual_rows;
        if (t < t_end) {
          const int32_t e = t * heads + h0;
          load_floats_ldg<In, kBackwardVec>(a + e, a_val[k]);
          load_floats_ldg<In, kBackwardVec>(b + e, b_val[k]);
          load_floats_ldg<float, kBackwardVec>(grad_g + e, dg[k]);
          load_floats_ldg<float, kBackwardVec>(grad_beta + e, dbeta[k]);
        }
      }
#pragma unroll
      for (int k = 0; k < kBackwardVecBatch; ++k) {
        const int32_t t = t0 + k * virtual_rows;
        if (t < t_end) {
          float da_value[kBackwardVec], db_value[kBackwardVec];
          gate_backward_elements4(a_val[k], b_val[k], dg[k], dbeta[k], neg_exp_A, dt, da_value,
                                  db_value, sum_A_log, sum_dt_bias);
          const int32_t e = t * heads + h0;
          store_floats<In, kBackwardVec>(da + e, da_value);
          store_floats<In, kBackwardVec>(db + e, db_value);
        }
      }
    }
  }
#pragma unroll
  for (int j = 0; j < kBackwardVec; ++j) {
    row_sums[vrow * block_h + vlane * kBackwardVec + j] = sum_A_log[j];
    row_sums[(virtual_rows + vrow) * block_h + vlane * kBackwardVec + j] = sum_dt_bias[j];
  }
}

// Note [Single-pass ordered reduction]: in kOrderedSinglePass mode every program writes
// its partial row, then takes a ticket from the unsigned counter of its head column
// (blockIdx.y); the program that draws the column's last ticket sums that column's slots
// of all partial rows itself and resets the counter to 0 for the next launch that uses
// it. The integer ticket only elects who sums; it carries no data. The last program adds
// the rows in exactly the order of gate_reduce_partials_kernel (kReduceRows virtual rows
// per slot, row r summing programs r, r + kReduceRows, ... in program order, then the
// rows added in row order), so the single-pass and two-pass variants give the same bits
// and choosing between them is a matter of speed alone. It saves the second launch, which
// eager calls at small (launch-bound) shapes pay on the host; one summing program per
// column keeps the tail to the column's 2 * block_h slots.
//
// Counters: a fixed device array, zero at module load, so no allocation or memset is
// needed (not even under graph capture): kGateTicketColumns counters per slot. The host
// hands each eager stream one slot and each captured launch a slot of its own
// (ops/pre_gdr_gate/pre_gdr_gate_op_cuda.cc), so two launches that may run concurrently never share
// a counter.
__device__ unsigned int g_gate_ticket_slots[kGateTicketSlots * kGateTicketColumns];

// The last step of both ordered variants, for one output slot: its kReduceRows row sums
// added in row order, the total stored to dA_log (slot < heads) or ddt_bias. One
// definition, so that the single-pass tail and the two-pass reduce kernel cannot drift
// apart in order (the GPU test holds them to equal bits).
template <typename Param, typename Slot>
__device__ __forceinline__ void store_ordered_total(
    const float (&row_sums)[kReduceRows][kReduceSlotsPerBlock], int lane, Slot slot, Slot heads,
    Param* dA_log, Param* ddt_bias) {
  float total = 0.0f;
#pragma unroll 8
  for (int r = 0; r < kReduceRows; ++r) total += row_sums[r][lane];
  if (slot < heads) {
    store_float(dA_log + slot, total);
  } else {
    store_float(ddt_bias + (slot - heads), total);
  }
}

// Virtual rows per thread in the tail: kReduceRows over the (threads / 32) thread rows of
// the smallest block the single pass takes.
constexpr int kTailRowsPerThread = kReduceRows / (kSinglePassMinThreads / 32);
constexpr int kTailUnroll = kSinglePassTailUnroll;

// The last program of one head column sums that column's partial rows (Note
// [Single-pass ordered reduction]): the 2 * column_heads slots (dA_log then ddt_bias of
// heads [h_begin, h_begin + column_heads)) in groups of 32 lanes, thread row r of the
// block owning virtual rows r, r + thread_rows, ... below kReduceRows (at most
// kTailRowsPerThread of them, since threads >= kSinglePassMinThreads). Each round loads kTailUnroll
// programs of every owned virtual row before adding, so a group of up to
// kReduceRows * kTailUnroll = 256 partial rows is one round of independent loads. Offsets
// are 32-bit (the host takes the single pass only when the scratch fits), which keeps the
// per-load index work to a multiply-add: the tail runs on one SM while the rest of the
// GPU idles, so its instruction count is its latency.
template <typename Param>
__device__ __forceinline__ void single_pass_tail(const GateBackwardArgs& args,
                                                 const float* partials, int32_t programs_t,
                                                 int32_t heads, int32_t h_begin, int block_h) {
  __shared__ float tail_sums[kReduceRows][kReduceSlotsPerBlock];
  const int lane = threadIdx.x % kReduceSlotsPerBlock;
  const int thread_row = threadIdx.x / kReduceSlotsPerBlock;
  const int thread_rows = blockDim.x / kReduceSlotsPerBlock;
  const int32_t slots = 2 * heads;
  const int32_t column_heads = min(block_h, heads - h_begin);
  for (int32_t group = 0; group < 2 * column_heads; group += kReduceSlotsPerBlock) {
    const int32_t column_slot = group + lane;
    const bool active = column_slot < 2 * column_heads;
    // dA_log slots first, then ddt_bias, as in the partial row and the two-pass kernel.
    const int32_t slot = column_slot < column_heads
                             ? h_begin + column_slot
                             : heads + h_begin + (column_slot - column_heads);
    float acc[kTailRowsPerThread];
#pragma unroll
    for (int k = 0; k < kTailRowsPerThread; ++k) acc[k] = 0.0f;
    for (int32_t p0 = 0; p0 < programs_t; p0 += kReduceRows * kTailUnroll) {
      float v[kTailUnroll][kTailRowsPerThread];
#pragma unroll
      for (int u = 0; u < kTailUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < kTailRowsPerThread; ++k) {
          const int virtual_row = thread_row + k * thread_rows;
          const int32_t p = p0 + u * kReduceRows + virtual_row;
          v[u][k] = active && virtual_row < kReduceRows && p < programs_t
                        ? __ldcg(partials + p * slots + slot)
                        : 0.0f;
        }
      }
      // Adding the +0.0f of a missing program is exact: a sum that starts at +0.0f is
      // never -0.0f, and x + (+0.0f) == x for every other x (NaN stays NaN).
#pragma unroll
      for (int u = 0; u < kTailUnroll; ++u) {
#pragma unroll
        for (int k = 0; k < kTailRowsPerThread; ++k) acc[k] += v[u][k];
      }
    }
#pragma unroll
    for (int k = 0; k < kTailRowsPerThread; ++k) {
      const int virtual_row = thread_row + k * thread_rows;
      if (virtual_row < kReduceRows) tail_sums[virtual_row][lane] = acc[k];
    }
    __syncthreads();
    if (thread_row == 0 && active) {
      store_ordered_total(tail_sums, lane, slot, heads, static_cast<Param*>(args.dA_log),
                          static_cast<Param*>(args.ddt_bias));
    }
    __syncthreads();
  }
}

// __launch_bounds__(1024): at most 64 registers per thread, so four 256-thread programs
// fit an SM in every mode. Unbounded, the single pass's tail (its loads of one round in
// flight) took 80, three programs per SM, and the 512 programs of 16384 x 32 two waves.
template <typename In, typename Param, typename Index, GateReduction kMode, bool kFlat, bool kVec>
__global__ void __launch_bounds__(1024)
    gate_backward_kernel(GateBackwardArgs args, Index tokens, Index heads, TokenDecoder<Index> dec,
                         int block_t, int block_h, float* out) {
  static_assert(!kVec || (kFlat && std::is_same_v<Index, int32_t>),
                "the vectorised pass is for flat operands with 32-bit indices");
  extern __shared__ float row_sums[];  // [2][virtual_rows][block_h]
  __shared__ bool is_last_program;
  const int virtual_rows = kGateVirtualRowsPerRow * (blockDim.x / block_h);
  const Index t_begin = static_cast<Index>(blockIdx.x) * block_t;
  const Index t_end = min(t_begin + static_cast<Index>(block_t), tokens);
  if constexpr (kVec) {
    gate_backward_rows_vec<In, Param>(args, heads, t_begin, t_end, block_h, row_sums);
  } else {
    gate_backward_rows_scalar<In, Param, Index, kFlat>(args, heads, dec, t_begin, t_end, block_h,
                                                       row_sums);
  }
  __syncthreads();
  // See Note [Gate reduce launched early]: the ordered second pass may be scheduled now;
  // it waits for this grid's completion before it reads a partial row.
  if constexpr (kMode == GateReduction::kOrdered) allow_dependent_launch();
  // See Note [Gate backward virtual rows]: the virtual-row sums in virtual-row order.
  const int head_lane = threadIdx.x;
  const Index h = static_cast<Index>(blockIdx.y) * block_h + head_lane;
  if (head_lane < block_h && h < heads) {
    const int used_rows = min(virtual_rows, block_t);
    float total_A_log = 0.0f;
    float total_dt_bias = 0.0f;
    for (int r = 0; r < used_rows; ++r) {
      total_A_log += row_sums[r * block_h + head_lane];
      total_dt_bias += row_sums[(virtual_rows + r) * block_h + head_lane];
    }
    if constexpr (kMode == GateReduction::kAtomic) {
      atomicAdd(out + h, total_A_log);
      atomicAdd(out + heads + h, total_dt_bias);
    } else {
      float* partial_row = out + static_cast<int64_t>(blockIdx.x) * 2 * heads;
      partial_row[h] = total_A_log;
      partial_row[heads + h] = total_dt_bias;
    }
  }
  if constexpr (kMode == GateReduction::kOrderedSinglePass) {
    // See Note [Single-pass ordered reduction].
    // One acq_rel ticket per program, taken by thread 0 after the barrier: the barrier
    // orders the block's partial-row stores before it, the release publishes them GPU
    // wide (cumulativity), and the acquire of the last program orders its reads after
    // every other program's release. A __threadfence() in every thread instead (a
    // sequentially consistent fence plus an L1 invalidation each) made this variant
    // much slower than the two-pass one (measured: docs/benchmarks_log.md).
    __syncthreads();
    if (threadIdx.x == 0) {
      cuda::atomic_ref<unsigned int, cuda::thread_scope_device> ticket(
          g_gate_ticket_slots[args.ticket_slot * kGateTicketColumns + blockIdx.y]);
      is_last_program = ticket.fetch_add(1u, cuda::memory_order_acq_rel) == gridDim.x - 1;
      if (is_last_program) ticket.store(0u, cuda::memory_order_relaxed);
    }
    __syncthreads();
    if (!is_last_program) return;
    single_pass_tail<Param>(args, out, static_cast<int32_t>(gridDim.x), static_cast<int32_t>(heads),
                            static_cast<int32_t>(blockIdx.y) * block_h, block_h);
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
  wait_for_prerequisite_grid();  // Note [Gate reduce launched early]
  float acc = 0.0f;
  if (slot < slots) {
#pragma unroll 8
    for (int64_t p = row; p < programs_t; p += kReduceRows)
      acc += __ldg(partials + p * slots + slot);
  }
  sums[row][lane] = acc;
  __syncthreads();
  if (row != 0 || slot >= slots) return;
  store_ordered_total(sums, lane, slot, heads, dA_log, ddt_bias);
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

constexpr int64_t kInt32Limit = (int64_t{1} << 31) - (int64_t{1} << 20);

int64_t max_offset(const StridedOperand& op, const GateShape& shape) {
  return (shape.dim0 - 1) * op.stride0 + (shape.dim1 - 1) * op.stride1 +
         (shape.heads - 1) * op.stride_h;
}

// 32-bit indexing when every flat index and every operand offset fits.
bool fits_int32(const GateShape& shape, std::initializer_list<StridedOperand> operands) {
  if (shape.tokens() * shape.heads >= kInt32Limit) return false;
  for (const StridedOperand& op : operands) {
    if (max_offset(op, shape) >= kInt32Limit) return false;
  }
  return true;
}

bool is_flat(const StridedOperand& op, const GateShape& shape) {
  return (shape.heads == 1 || op.stride_h == 1) && (shape.dim1 == 1 || op.stride1 == shape.heads) &&
         (shape.dim0 == 1 || op.stride0 == shape.dim1 * shape.heads);
}

bool aligned_to(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

int64_t element_bytes(ScalarKind kind) { return kind == ScalarKind::kFloat32 ? 4 : 2; }

// The vectorised forward's conditions (gate_forward_vec_kernel): contiguous operands,
// heads a multiple of kForwardVec that fits the table, 32-bit indices, a and b aligned
// to one vector, g and beta to a float4. Anything else takes the scalar kernel.
bool forward_vectorisable(const GateForwardArgs& args) {
  const GateShape& shape = args.shape;
  const int64_t vec_bytes = kForwardVec * element_bytes(args.input_kind);
  return is_flat(args.a, shape) && is_flat(args.b, shape) && shape.heads % kForwardVec == 0 &&
         shape.heads <= kForwardTableHeads && fits_int32(shape, {args.a, args.b}) &&
         aligned_to(args.a.data, vec_bytes) && aligned_to(args.b.data, vec_bytes) &&
         aligned_to(args.g, 16) && aligned_to(args.beta, 16);
}

// The vectorised backward's conditions (gate_backward_rows_vec): every operand flat,
// heads and block_h multiples of kBackwardVec, 32-bit indices, a, b, da, db aligned to
// one vector and grad_g, grad_beta to a float4. Anything else takes the scalar pass,
// which keeps the same order (Note [Gate backward virtual rows]), so the bits are the
// same either way.
bool backward_vectorisable(const GateBackwardArgs& args, const GateTile& tile) {
  const GateShape& shape = args.shape;
  const int64_t vec_bytes = kBackwardVec * element_bytes(args.input_kind);
  return is_flat(args.a, shape) && is_flat(args.b, shape) && is_flat(args.grad_g, shape) &&
         is_flat(args.grad_beta, shape) && shape.heads % kBackwardVec == 0 &&
         tile.block_h % kBackwardVec == 0 &&
         fits_int32(shape, {args.a, args.b, args.grad_g, args.grad_beta}) &&
         aligned_to(args.a.data, vec_bytes) && aligned_to(args.b.data, vec_bytes) &&
         aligned_to(args.da, vec_bytes) && aligned_to(args.db, vec_bytes) &&
         aligned_to(args.grad_g.data, 16) && aligned_to(args.grad_beta.data, 16);
}

// Programmatic dependent launch needs compute capability 9.0. Cached per device: the
// attribute query is a driver call, and this runs once per backward. The current device
// is the stream's: a launch into another device's stream fails anyway.
bool current_device_has_programmatic_launch() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];  // 0 unknown, 1 no, 2 yes
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (device < 0 || device >= kMaxDevices) return false;
  int state = cached[device].load(std::memory_order_relaxed);
  if (state == 0) {
    int major = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    state = major >= 9 ? 2 : 1;
    cached[device].store(state, std::memory_order_relaxed);
  }
  return state == 2;
}

}  // namespace

bool pre_gdr_gate_forward_is_vectorised(const GateForwardArgs& args) {
  return forward_vectorisable(args);
}

bool pre_gdr_gate_backward_is_vectorised(const GateBackwardArgs& args, const GateTile& tile) {
  return backward_vectorisable(args, tile);
}

int launch_pre_gdr_gate_forward(const GateForwardArgs& args, CUstream_st* stream) {
  const int64_t total = args.shape.tokens() * args.shape.heads;
  if (total == 0) return cudaSuccess;
  const bool small = total < kForwardSmallLimit;
  if (forward_vectorisable(args)) {
    // Large: 256 threads x 2 row groups (8 elements per thread, as the scalar kernel);
    // small: 128 threads x 1 row group, so the 0.8B shape still spreads over every SM
    // (256 blocks). More lanes than threads (heads > 512) takes the 256-thread block.
    const int32_t lanes = static_cast<int32_t>(args.shape.heads / kForwardVec);
    const int items = small ? 1 : 2;
    const int block = small && lanes <= kForwardThreads / 2 ? kForwardThreads / 2 : kForwardThreads;
    const int32_t row_group = (block / lanes) * lanes * kForwardVec;  // elements per row group
    const int64_t per_block = int64_t{row_group} * items;
    const dim3 grid(static_cast<unsigned>((total + per_block - 1) / per_block));
    dispatch_kind(args.input_kind, [&](auto in_tag) {
      dispatch_kind(args.param_kind, [&](auto param_tag) {
        using In = decltype(in_tag);
        using Param = decltype(param_tag);
        auto kernel = items == 1 ? gate_forward_vec_kernel<In, Param, 1>
                                 : gate_forward_vec_kernel<In, Param, 2>;
        kernel<<<grid, block, 0, stream>>>(args, static_cast<int32_t>(total), lanes, row_group);
      });
    });
    return cudaGetLastError();
  }
  const int64_t per_block = kForwardThreads * (small ? kForwardItemsSmall : kForwardItemsLarge);
  const dim3 grid(static_cast<unsigned>((total + per_block - 1) / per_block));
  dispatch_kind(args.input_kind, [&](auto in_tag) {
    dispatch_kind(args.param_kind, [&](auto param_tag) {
      using In = decltype(in_tag);
      using Param = decltype(param_tag);
      const bool flat = is_flat(args.a, args.shape) && is_flat(args.b, args.shape);
      auto go = [&](auto index_tag, auto flat_tag, auto heads_div, auto dim1_div) {
        using Index = decltype(index_tag);
        constexpr bool kFlat = decltype(flat_tag)::value;
        auto kernel = small ? gate_forward_kernel<In, Param, Index, kFlat, kForwardItemsSmall>
                            : gate_forward_kernel<In, Param, Index, kFlat, kForwardItemsLarge>;
        kernel<<<grid, kForwardThreads, 0, stream>>>(args, static_cast<Index>(total), heads_div,
                                                     TokenDecoder<Index>{dim1_div});
      };
      if (fits_int32(args.shape, {args.a, args.b})) {
        const FastDivider32 heads_div(static_cast<uint32_t>(args.shape.heads));
        const FastDivider32 dim1_div(static_cast<uint32_t>(args.shape.dim1));
        flat ? go(int32_t{}, std::true_type{}, heads_div, dim1_div)
             : go(int32_t{}, std::false_type{}, heads_div, dim1_div);
      } else {
        const Divider<int64_t> heads_div(args.shape.heads), dim1_div(args.shape.dim1);
        flat ? go(int64_t{}, std::true_type{}, heads_div, dim1_div)
             : go(int64_t{}, std::false_type{}, heads_div, dim1_div);
      }
    });
  });
  return cudaGetLastError();
}

int launch_pre_gdr_gate_backward(const GateBackwardArgs& args, const GateTile& tile,
                                 GateReduction reduction, float* out, CUstream_st* stream) {
  if (args.shape.tokens() == 0 || args.shape.heads == 0) return cudaSuccess;
  const GateBackwardLaunch launch = derive_gate_backward_launch(tile, args.shape);
  const bool vectorised = backward_vectorisable(args, tile);
  const dim3 grid(static_cast<unsigned>(launch.programs_t),
                  static_cast<unsigned>(launch.programs_h));
  const size_t shared = static_cast<size_t>(launch.shared_bytes);
  dispatch_kind(args.input_kind, [&](auto in_tag) {
    dispatch_kind(args.param_kind, [&](auto param_tag) {
      using In = decltype(in_tag);
      using Param = decltype(param_tag);
      const bool flat = is_flat(args.a, args.shape) && is_flat(args.b, args.shape) &&
                        is_flat(args.grad_g, args.shape) && is_flat(args.grad_beta, args.shape);
      auto go = [&](auto index_tag, auto mode_tag) {
        using Index = decltype(index_tag);
        constexpr GateReduction kMode = decltype(mode_tag)::value;
        auto kernel = flat ? gate_backward_kernel<In, Param, Index, kMode, true, false>
                           : gate_backward_kernel<In, Param, Index, kMode, false, false>;
        if constexpr (std::is_same_v<Index, int32_t>) {
          if (vectorised) kernel = gate_backward_kernel<In, Param, Index, kMode, true, true>;
        }
        kernel<<<grid, tile.threads, shared, stream>>>(
            args, static_cast<Index>(args.shape.tokens()), static_cast<Index>(args.shape.heads),
            TokenDecoder<Index>{DividerFor<Index>(static_cast<Index>(args.shape.dim1))},
            tile.block_t, tile.block_h, out);
      };
      using Atomic = std::integral_constant<GateReduction, GateReduction::kAtomic>;
      using Ordered = std::integral_constant<GateReduction, GateReduction::kOrdered>;
      using SinglePass = std::integral_constant<GateReduction, GateReduction::kOrderedSinglePass>;
      auto with_index = [&](auto index_tag) {
        switch (reduction) {
          case GateReduction::kAtomic: go(index_tag, Atomic{}); break;
          case GateReduction::kOrdered: go(index_tag, Ordered{}); break;
          case GateReduction::kOrderedSinglePass: go(index_tag, SinglePass{}); break;
        }
      };
      if (fits_int32(args.shape, {args.a, args.b, args.grad_g, args.grad_beta})) {
        with_index(int32_t{});
      } else {
        with_index(int64_t{});
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
  // See Note [Gate reduce launched early]: programmatic serialisation where the device has it.
  cudaLaunchAttribute early_launch;
  early_launch.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  early_launch.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(kReduceSlotsPerBlock * kReduceRows);
  config.stream = stream;
  config.attrs = &early_launch;
  config.numAttrs = current_device_has_programmatic_launch() ? 1 : 0;
  cudaError_t error = cudaSuccess;
  dispatch_kind(param_kind, [&](auto param_tag) {
    using Param = decltype(param_tag);
    error = cudaLaunchKernelEx(&config, gate_reduce_partials_kernel<Param>, partials, programs_t,
                               heads, static_cast<Param*>(dA_log), static_cast<Param*>(ddt_bias));
  });
  return error;
}

}  // namespace gdr::kernels
