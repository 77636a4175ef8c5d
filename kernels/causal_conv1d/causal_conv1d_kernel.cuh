// The causal conv1d + SiLU kernel bodies (device code only; contract, math and launch rules
// in kernels/causal_conv1d/causal_conv1d.h). Included by kernels/causal_conv1d/causal_conv1d.cu,
// which wraps them in
// __global__ kernels, and by the CPU test //tests/ops:causal_conv1d_kernel_emulation_test,
// which supplies host stand-ins for the CUDA built-ins (__device__, __forceinline__,
// threadIdx, blockIdx, __syncthreads; expf and fmaf come from <math.h>) and runs this very
// code with one host thread per CUDA thread, so the indexing, the sequence tails and the
// summation order are checked on machines without a GPU. Storage conversions come from
// kernels/common/storage_element.cuh (a host includer specialises StorageElement for its 16-bit
// types). NOTE: keep this file free of other includes (beyond the headers it names) and of CUDA
// APIs beyond those listed: the emulation test defines exactly those.
//
// Note [Causal conv determinism] (see also kernels/causal_conv1d/causal_conv1d.h)
// y and dx are per-element functions of x, dy and w (taps summed in a fixed order), so
// only dw reduces across threads. Its order: each thread sums dpre * x over the tokens of
// its tile in token order (one FP32 fmaf chain per (channel, tap)); the block's
// kCausalConvTileRows tiles are then added in tile-row order (threadIdx.y 0, 1, ...) through
// shared memory, and the block writes its channels' slots of the program's partial row
// (program = blockIdx.x; every slot written exactly once, including by blocks whose tiles
// run past the last sequence, which write zeros: no zero-fill, no atomics);
// reduce_partials_block then sums the partial rows by fixed slices of programs, slices in
// order. The grid comes from derive_causal_conv_backward_launch(shape) alone.
#pragma once

#include "kernels/causal_conv1d/causal_conv1d.h"
#include "kernels/common/storage_element.cuh"

namespace gdr::kernels::causal_conv_detail {

// Tokens whose loads a thread issues before using the first of them: one load per thread
// in flight would leave HBM idle at the occupancy these register-heavy kernels get (2-3
// blocks of 256 threads per SM). Defaults; forward_tile and backward_tile take others
// (kernels/causal_conv1d/causal_conv1d.cu picks the forward's per storage type: 8 x 8 bytes for
// 16-bit types). Backward: 8 x (x, dy) x 4 bytes in 16-bit dtypes. Larger groups cost registers
// (ptxas -v: ~125 for the backward at K = 4).
constexpr int kForwardTokensInFlight = 4;
constexpr int kBackwardTokensInFlight = 8;

// at::silu's opmath formula, p / (1 + exp(-p)).
__device__ __forceinline__ float silu(float p) { return p / (1.0f + expf(-p)); }

// at::silu_backward's opmath formula, dy * s * (1 + p * (1 - s)) with s = sigmoid(p).
__device__ __forceinline__ float silu_backward(float dy, float p) {
  const float s = 1.0f / (1.0f + expf(-p));
  return dy * s * (1.0f + p * (1.0f - s));
}

// pre[t] = sum_j w[j] * window[j] with window[j] = x[t + j - K + 1]: the first product,
// then one fmaf per tap in j order (explicit, so host and device round alike).
template <int K>
__device__ __forceinline__ float conv_taps(const float (&w)[K], const float (&window)[K]) {
  float acc = w[0] * window[0];
#pragma unroll
  for (int j = 1; j < K; ++j) acc = fmaf(w[j], window[j], acc);
  return acc;
}

// dx[t] = sum_j w[j] * dpre[t + K - 1 - j] with dpre_window[i] = dpre[t + i]; taps in j
// order as above.
template <int K>
__device__ __forceinline__ float conv_taps_transposed(const float (&w)[K],
                                                      const float (&dpre_window)[K]) {
  float acc = w[0] * dpre_window[K - 1];
#pragma unroll
  for (int j = 1; j < K; ++j) acc = fmaf(w[j], dpre_window[K - 1 - j], acc);
  return acc;
}

// The tile of this thread (see kCausalConvChannelThreads in kernels/causal_conv1d/causal_conv1d.h).
struct ThreadTile {
  bool active = false;  // false: no channels or no tokens here (the grid's tails)
  int64_t channel = 0;  // first of its VEC channels
  int64_t batch = 0;
  int64_t begin = 0, end = 0;  // tokens [begin, end) of sequence `batch`
};

template <int VEC>
__device__ __forceinline__ ThreadTile thread_tile(const CausalConvShape& shape, int64_t tile_tokens,
                                                  int64_t tiles_per_seq) {
  ThreadTile tile;
  const int64_t group = static_cast<int64_t>(blockIdx.y) * kCausalConvChannelThreads +
                        static_cast<int64_t>(threadIdx.x);
  const int64_t index =
      static_cast<int64_t>(blockIdx.x) * kCausalConvTileRows + static_cast<int64_t>(threadIdx.y);
  tile.channel = group * VEC;
  if (tile.channel >= shape.channels || index >= shape.batch * tiles_per_seq) return tile;
  tile.active = true;
  tile.batch = index / tiles_per_seq;
  tile.begin = (index % tiles_per_seq) * tile_tokens;
  tile.end = tile.begin + tile_tokens < shape.seq ? tile.begin + tile_tokens : shape.seq;
  return tile;
}

// w[v][j] = weight[channel + v, j] in FP32.
template <typename T, int VEC, int K>
__device__ __forceinline__ void load_weights(const void* weight, int64_t channel,
                                             float (&w)[VEC][K]) {
  const T* p = static_cast<const T*>(weight) + channel * K;
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
#pragma unroll
    for (int j = 0; j < K; ++j) w[v][j] = StorageElement<T>::to_float(p[v * K + j]);
  }
}

// The K - 1 inputs before token `begin` into window[v][0 .. K-2] (zeros before t = 0).
template <typename T, int VEC, int K>
__device__ __forceinline__ void load_history(const T* x, int64_t token_stride, int64_t begin,
                                             float (&window)[VEC][K]) {
#pragma unroll
  for (int i = 0; i < K - 1; ++i) {
    const int64_t t = begin - (K - 1) + i;
    float in[VEC];
    if (t >= 0) {
      unpack<T, VEC>(load_pack<T, VEC>(x + t * token_stride), in);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) in[v] = 0.0f;
    }
#pragma unroll
    for (int v = 0; v < VEC; ++v) window[v][i] = in[v];
  }
}

template <int VEC, int K>
__device__ __forceinline__ void shift_left(float (&window)[VEC][K]) {
#pragma unroll
  for (int v = 0; v < VEC; ++v) {
#pragma unroll
    for (int i = 0; i + 1 < K; ++i) window[v][i] = window[v][i + 1];
  }
}

// ----------------------------------------------------------------------------
// CUDA kernel bodies

// N consecutive tokens of the forward from `x` (token t0) to `y`: all N loads first, then
// the outputs. window[v][i] holds x[t - K + 1 + i] for the token t being computed.
template <typename T, int VEC, int K, int N>
__device__ __forceinline__ void forward_tokens(const T* x, int64_t token_stride, T* y,
                                               int64_t channels, const float (&w)[VEC][K],
                                               float (&window)[VEC][K]) {
  Pack<T, VEC> raw[N];
#pragma unroll
  for (int u = 0; u < N; ++u) raw[u] = load_pack<T, VEC>(x + u * token_stride);
#pragma unroll
  for (int u = 0; u < N; ++u) {
    float in[VEC], out[VEC];
    unpack<T, VEC>(raw[u], in);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      window[v][K - 1] = in[v];
      out[v] = silu(round_to<T>(conv_taps<K>(w[v], window[v])));  // rounded again by the store
    }
    store_floats<T, VEC>(y + u * channels, out);
    shift_left<VEC, K>(window);
  }
}

// Forward of one thread's tile (kCausalConvForwardTileTokens tokens x VEC channels): each
// token is loaded once, the K - 1 before the tile once more (the halo); whole groups of
// kForwardTokensInFlight tokens, then the tail one by one.
template <typename T, int VEC, int K, int kInFlight = kForwardTokensInFlight>
__device__ __forceinline__ void forward_tile(const CausalConvForwardArgs& a) {
  const CausalConvShape& shape = a.shape;
  const int64_t tiles_per_seq =
      (shape.seq + kCausalConvForwardTileTokens - 1) / kCausalConvForwardTileTokens;
  const ThreadTile tile = thread_tile<VEC>(shape, kCausalConvForwardTileTokens, tiles_per_seq);
  if (!tile.active) return;  // no barrier follows
  float w[VEC][K];
  load_weights<T, VEC, K>(a.weight, tile.channel, w);
  const T* x = static_cast<const T*>(a.x.data) + tile.batch * a.x.batch_stride + tile.channel;
  T* y = static_cast<T*>(a.y) + tile.batch * shape.seq * shape.channels + tile.channel;
  float window[VEC][K];
  load_history<T, VEC, K>(x, a.x.token_stride, tile.begin, window);
  const int64_t stride = a.x.token_stride, channels = shape.channels;
  int64_t t = tile.begin;
  for (; t + kInFlight <= tile.end; t += kInFlight) {
    forward_tokens<T, VEC, K, kInFlight>(x + t * stride, stride, y + t * channels, channels, w,
                                         window);
  }
  for (; t < tile.end; ++t) {
    forward_tokens<T, VEC, K, 1>(x + t * stride, stride, y + t * channels, channels, w, window);
  }
}

// Row stride (floats) of a thread's dw sums in the block's combine buffer: odd, so the 32
// lanes of a warp writing slot i hit 32 different banks.
template <int VEC, int K>
constexpr int combine_stride() {
  return (VEC * K) % 2 == 0 ? VEC * K + 1 : VEC * K;
}

// Floats of shared memory backward_tile needs.
template <int VEC, int K>
constexpr int combine_floats() {
  return kCausalConvTileRows * kCausalConvChannelThreads * combine_stride<VEC, K>();
}

// Per-thread state of the backward walk over steps s (see backward_tile).
template <int VEC, int K>
struct BackwardState {
  float w[VEC][K];
  float window[VEC][K];       // x[s - K + 1 .. s] once step s has its input
  float dpre_window[VEC][K];  // dpre[s - K + 1 .. s] after step s
  float tap_sums[VEC * K];    // slot v * K + j: sum over the tile of dpre[t] * x[t + j - K + 1]
};

// Where the backward walk reads and writes: token s of x and dy, token t of dx.
template <typename T>
struct BackwardRows {
  const T* x;
  const T* dy;
  T* dx;
  int64_t x_stride, dy_stride, channels;
};

// One step s of the backward walk: dpre[s] from x[s] and dy[s] (`has_input`; zero past T),
// its dw terms (`adds_to_dw`: s inside the tile, not the halo), and dx[s - K + 1]
// (`emits_dx`: s - K + 1 inside the tile). Inlined with constant flags in the tile's
// interior.
template <typename T, int VEC, int K>
__device__ __forceinline__ void backward_step(const Pack<T, VEC>& raw_x, const Pack<T, VEC>& raw_dy,
                                              bool has_input, bool adds_to_dw, bool emits_dx,
                                              const BackwardRows<T>& rows, int64_t s,
                                              BackwardState<VEC, K>& st) {
  float dpre[VEC];
  if (has_input) {
    float in[VEC], grad[VEC];
    unpack<T, VEC>(raw_x, in);
    unpack<T, VEC>(raw_dy, grad);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      st.window[v][K - 1] = in[v];
      const float pre = round_to<T>(conv_taps<K>(st.w[v], st.window[v]));
      dpre[v] = round_to<T>(silu_backward(grad[v], pre));
    }
    if (adds_to_dw) {
#pragma unroll
      for (int v = 0; v < VEC; ++v) {
#pragma unroll
        for (int j = 0; j < K; ++j) {
          st.tap_sums[v * K + j] = fmaf(dpre[v], st.window[v][j], st.tap_sums[v * K + j]);
        }
      }
    }
    shift_left<VEC, K>(st.window);
  } else {
#pragma unroll
    for (int v = 0; v < VEC; ++v) dpre[v] = 0.0f;
  }
  shift_left<VEC, K>(st.dpre_window);
#pragma unroll
  for (int v = 0; v < VEC; ++v) st.dpre_window[v][K - 1] = dpre[v];
  if (emits_dx) {
    float out[VEC];
#pragma unroll
    for (int v = 0; v < VEC; ++v) out[v] = conv_taps_transposed<K>(st.w[v], st.dpre_window[v]);
    store_floats<T, VEC>(rows.dx + (s - (K - 1)) * rows.channels, out);
  }
}

// N consecutive steps s0 .. s0 + N - 1 with the same (compile-time) flags: all loads first,
// then the steps in order.
template <typename T, int VEC, int K, int N, bool kHasInput, bool kAddsToDw, bool kEmitsDx>
__device__ __forceinline__ void backward_steps(const BackwardRows<T>& rows, int64_t s0,
                                               BackwardState<VEC, K>& st) {
  Pack<T, VEC> raw_x[N], raw_dy[N];
  if (kHasInput) {
#pragma unroll
    for (int u = 0; u < N; ++u) {
      raw_x[u] = load_pack<T, VEC>(rows.x + (s0 + u) * rows.x_stride);
      raw_dy[u] = load_pack<T, VEC>(rows.dy + (s0 + u) * rows.dy_stride);
    }
  }
#pragma unroll
  for (int u = 0; u < N; ++u) {
    backward_step<T, VEC, K>(raw_x[u], raw_dy[u], kHasInput, kAddsToDw, kEmitsDx, rows, s0 + u, st);
  }
}

// Backward of one thread's tile [begin, end) x VEC channels, then the block's dw partial
// row. The walk covers steps s = begin .. end + K - 2 (backward_step): the first K - 1
// (the prologue) only fill dpre_window, the last K - 1 (the epilogue) recompute the next
// tile's first dpre (the halo) for dx without adding to dw. Each stretch runs as groups of
// steps whose loads are issued before the first is used (kBackwardTokensInFlight in the
// interior, then 4, 2, 1 for its remainder); tiles shorter than K - 1 tokens and the epilogue of a
// sequence's last tile (steps past T) run one guarded step at a time. The order of the
// steps, hence of every sum, is the same whichever way they are grouped.
// `combine` holds combine_floats<VEC, K>() floats; every thread of the block must call
// this (it has a barrier).
template <typename T, int VEC, int K, int kInFlight = kBackwardTokensInFlight>
__device__ __forceinline__ void backward_tile(const CausalConvBackwardArgs& a, int64_t tile_tokens,
                                              int64_t tiles_per_seq, float* combine) {
  constexpr int kSlots = VEC * K;
  const CausalConvShape& shape = a.shape;
  const ThreadTile tile = thread_tile<VEC>(shape, tile_tokens, tiles_per_seq);
  BackwardState<VEC, K> st;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) st.tap_sums[i] = 0.0f;

  if (tile.active) {
    load_weights<T, VEC, K>(a.weight, tile.channel, st.w);
    BackwardRows<T> rows;
    rows.x = static_cast<const T*>(a.x.data) + tile.batch * a.x.batch_stride + tile.channel;
    rows.dy =
        static_cast<const T*>(a.grad_y.data) + tile.batch * a.grad_y.batch_stride + tile.channel;
    rows.dx = static_cast<T*>(a.dx) + tile.batch * shape.seq * shape.channels + tile.channel;
    rows.x_stride = a.x.token_stride;
    rows.dy_stride = a.grad_y.token_stride;
    rows.channels = shape.channels;
    load_history<T, VEC, K>(rows.x, rows.x_stride, tile.begin, st.window);
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
#pragma unroll
      for (int i = 0; i < K; ++i) st.dpre_window[v][i] = 0.0f;  // never read for t >= begin
    }
    const int64_t steps_end = tile.end + K - 1;
    const int64_t interior_begin = tile.begin + K - 1;  // first step that emits dx
    auto guarded_step = [&](int64_t s) {
      Pack<T, VEC> raw_x, raw_dy;
      const bool has_input = s < shape.seq;
      if (has_input) {
        raw_x = load_pack<T, VEC>(rows.x + s * rows.x_stride);
        raw_dy = load_pack<T, VEC>(rows.dy + s * rows.dy_stride);
      }
      backward_step<T, VEC, K>(raw_x, raw_dy, has_input, s < tile.end, s >= interior_begin, rows, s,
                               st);
    };
    if (tile.end < interior_begin) {
#pragma unroll 1
      for (int64_t s = tile.begin; s < steps_end; ++s) guarded_step(s);
    } else {
      // Prologue: inputs exist (s < end <= T) and count towards dw; no dx yet.
      backward_steps<T, VEC, K, K - 1, true, true, false>(rows, tile.begin, st);
      int64_t s = interior_begin;
#pragma unroll 1
      for (; s + kInFlight <= tile.end; s += kInFlight) {
        backward_steps<T, VEC, K, kInFlight, true, true, true>(rows, s, st);
      }
      if (kInFlight > 8 && s + 8 <= tile.end) {
        backward_steps<T, VEC, K, 8, true, true, true>(rows, s, st);
        s += 8;
      }
      if (s + 4 <= tile.end) {
        backward_steps<T, VEC, K, 4, true, true, true>(rows, s, st);
        s += 4;
      }
      if (s + 2 <= tile.end) {
        backward_steps<T, VEC, K, 2, true, true, true>(rows, s, st);
        s += 2;
      }
      if (s < tile.end) {
        backward_steps<T, VEC, K, 1, true, true, true>(rows, s, st);
        s += 1;
      }
      // Epilogue: the halo, from the next tile's inputs while they exist.
      if (steps_end <= shape.seq) {
        backward_steps<T, VEC, K, K - 1, true, false, true>(rows, s, st);
      } else {
#pragma unroll 1
        for (; s < steps_end; ++s) guarded_step(s);
      }
    }
  }

  // The block's tile rows, added in row order into the program's partial row (Note [Causal
  // conv determinism]). Slot q of the block's run of 32 * kSlots slots is lane q / kSlots,
  // slot q % kSlots: consecutive threads write consecutive floats.
  constexpr int kStride = combine_stride<VEC, K>();
  const int lane = static_cast<int>(threadIdx.x);
  const int row = static_cast<int>(threadIdx.y);
  float* mine = combine + (row * kCausalConvChannelThreads + lane) * kStride;
#pragma unroll
  for (int i = 0; i < kSlots; ++i) mine[i] = st.tap_sums[i];
  __syncthreads();
  const int64_t row_floats = shape.channels * K;
  const int64_t first_slot = static_cast<int64_t>(blockIdx.y) * kCausalConvChannelThreads * kSlots;
  float* partial = a.partials + static_cast<int64_t>(blockIdx.x) * row_floats + first_slot;
  constexpr int kBlockThreads = kCausalConvChannelThreads * kCausalConvTileRows;
  for (int q = row * kCausalConvChannelThreads + lane; q < kCausalConvChannelThreads * kSlots;
       q += kBlockThreads) {
    if (first_slot + q >= row_floats) break;
    const int owner = q / kSlots, slot = q % kSlots;
    float sum = combine[owner * kStride + slot];
    for (int r = 1; r < kCausalConvTileRows; ++r) {
      sum += combine[(r * kCausalConvChannelThreads + owner) * kStride + slot];
    }
    partial[q] = sum;
  }
}

// The ordered second pass over kCausalConvReduceCols slots of the partial rows (1-D block of
// kCausalConvReduceCols * kCausalConvReduceSlices threads); `shared` holds
// kCausalConvReduceSlices * kCausalConvReduceCols floats.
template <typename TW>
__device__ __forceinline__ void reduce_partials_block(const float* partials, int64_t programs,
                                                      int64_t row_floats, TW* dw, float* shared) {
  const int lane = static_cast<int>(threadIdx.x % kCausalConvReduceCols);
  const int slice = static_cast<int>(threadIdx.x / kCausalConvReduceCols);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kCausalConvReduceCols + lane;
  float sum = 0.0f;
  if (col < row_floats) {
    for (int64_t p = slice; p < programs; p += kCausalConvReduceSlices) {
      sum += partials[p * row_floats + col];
    }
  }
  shared[slice * kCausalConvReduceCols + lane] = sum;
  __syncthreads();
  if (slice == 0 && col < row_floats) {
    float total = shared[lane];
    for (int s = 1; s < kCausalConvReduceSlices; ++s)
      total += shared[s * kCausalConvReduceCols + lane];
    dw[col] = StorageElement<TW>::from_float(total);
  }
}

}  // namespace gdr::kernels::causal_conv_detail
