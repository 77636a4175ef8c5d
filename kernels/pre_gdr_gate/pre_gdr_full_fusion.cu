// CUDA kernels of full pre-GDR fusion: causal depthwise conv1d + SiLU + split + L2 norm of
// q/k + repeat onto value heads + FP32 layout for the GDR core, forward and backward
// (contract and formulas: kernels/pre_gdr_gate/pre_gdr_full_fusion.h).
//
// Work split: one program = one head group (a q, k or v head: dk or dv conv channels) x
// kFullFusionWarps * strip consecutive tokens of one sequence; each warp walks its own
// strip of tokens in order, lanes owning per_lane contiguous channels (one vector load),
// so the conv's 4-token window slides through registers and every qkv element is read
// once plus a 3-token halo per strip (served by L1/L2: the neighbouring warp reads the
// same tokens). The L2 norm of a head is a butterfly shuffle over the head's lanes, which
// leaves the identical sum in every lane.
//
// Bytes and roofline estimate (0.8B training shape: B*T = 8192, C = 6144, Hv = 16,
// dk = dv = 128, BF16): forward reads qkv once (8192 * 6144 * 2 B = 101 MB) and writes q,
// k, v in FP32 (3 * 8192 * 2048 * 4 B = 201 MB): 302 MB, ~63 us at an HBM peak of 4.8 TB/s.
// Backward reads qkv (101 MB) and grad_q/k/v (201 MB), writes grad_qkv (101 MB) and a 98 KB
// conv-weight accumulator: ~403 MB, ~84 us; the strip halo (3 of 16 tokens) is recomputed,
// not saved. Measured against this floor: docs/benchmarks.md, Full pre-GDR fusion.
// The unfused ATen path (conv, SiLU, slices, FP32 casts, pow/sum/rsqrt/mul, repeat, and
// their autograd) moves several times these bytes in ~15 kernels forward and ~25 backward.
//
// Why atomics for the conv-weight gradient: it sums dy * x over every token; per-program
// sums added atomically cost one pass. The order of those float additions depends on
// scheduling, so the op refuses deterministic mode (ops/policy/determinism_manifest.txt).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/common/storage_element.cuh"
#include "kernels/pre_gdr_gate/pre_gdr_full_fusion.h"
#include "kernels/pre_gdr_gate/pre_gdr_full_fusion_math.h"

namespace gdr::kernels {
namespace {

constexpr int kThreads = kFullFusionWarps * 32;
constexpr int kTaps = kFullFusionConvTaps;

// The unfused path stores the conv output, the SiLU output and their gradients in the
// activation dtype; round_to<In> (kernels/common/storage_element.cuh) reproduces those values.

// kN contiguous elements at p as floats; `vec`: p is aligned to kN * sizeof(T) bytes, so
// the row moves in 16-byte (or smaller) vector accesses. Built from storage_element.cuh's
// Pack, load_pack and StorageElement in this loop form, not from its load_floats /
// store_floats / load_float: with those nvcc's code here changed (the FP32
// full_fusion_forward_kernel<float, 8, 4> grew by ~1200 SASS instructions, the 16-bit
// kernels' scalar loads became read-only-path loads).
template <int kN, typename T>
__device__ __forceinline__ void load_row(const T* __restrict__ p, bool vec, float (&out)[kN]) {
  if (vec) {
    constexpr int kChunk = kPackElements<T, kN>;
#pragma unroll
    for (int c = 0; c < kN / kChunk; ++c) {
      const Pack<T, kChunk> pack = load_pack<T, kChunk>(p + c * kChunk);
#pragma unroll
      for (int i = 0; i < kChunk; ++i) out[c * kChunk + i] = StorageElement<T>::to_float(pack.v[i]);
    }
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) out[i] = StorageElement<T>::to_float(p[i]);
  }
}

template <int kN, typename T>
__device__ __forceinline__ void store_row(T* __restrict__ p, bool vec, const float (&in)[kN]) {
  if (vec) {
    constexpr int kChunk = kPackElements<T, kN>;
#pragma unroll
    for (int c = 0; c < kN / kChunk; ++c) {
      Pack<T, kChunk> pack;
#pragma unroll
      for (int i = 0; i < kChunk; ++i)
        pack.v[i] = StorageElement<T>::from_float(in[c * kChunk + i]);
      *reinterpret_cast<Pack<T, kChunk>*>(p + c * kChunk) = pack;
    }
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) p[i] = StorageElement<T>::from_float(in[i]);
  }
}

// Sum over the first `lanes` lanes of each aligned group of `lanes` (a power of two <= 32).
// Every lane ends with the same bits (each butterfly stage adds the same two values).
// All 32 lanes must call it.
__device__ __forceinline__ float lanes_sum(float v, int lanes) {
  for (int offset = lanes / 2; offset > 0; offset /= 2)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// Where one lane of one head group sits. q/k groups: which = 0 (q) or 1 (k), head = key
// head; v groups: which = 2, head = value head.
struct GroupPlace {
  int which = 0;
  int64_t head = 0;
  int64_t head_dim = 0;
  int64_t group_channel = 0;  // first conv channel of the group
  int lanes = 0;
};

__device__ __forceinline__ GroupPlace place_group(const FullFusionShape& s, int64_t group,
                                                  int per_lane) {
  GroupPlace p;
  if (group < 2 * s.num_k_heads) {
    p.which = static_cast<int>(group / s.num_k_heads);
    p.head = group - p.which * s.num_k_heads;
    p.head_dim = s.head_k_dim;
    p.group_channel = p.which * s.key_dim() + p.head * s.head_k_dim;
  } else {
    p.which = 2;
    p.head = group - 2 * s.num_k_heads;
    p.head_dim = s.head_v_dim;
    p.group_channel = 2 * s.key_dim() + p.head * s.head_v_dim;
  }
  p.lanes = static_cast<int>(p.head_dim / per_lane);
  return p;
}

template <typename In, int kN>
__device__ __forceinline__ void load_weights(const In* __restrict__ conv_weight, int64_t channel,
                                             bool active, float (&w)[kN][kTaps]) {
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < kTaps; ++j)
      w[i][j] =
          active ? StorageElement<In>::to_float(conv_weight[(channel + i) * kTaps + j]) : 0.0f;
  }
}

// ----------------------------------------------------------------------------
// CUDA kernels

struct Flags {
  bool vec_qkv = false;   // qkv rows aligned for vector loads
  bool vec_grad = false;  // grad_q/k/v rows aligned
  bool vec_out = false;   // q/k/v (forward) or grad_qkv (backward) rows aligned
};

// One warp's strip of kStrip tokens of one head group (see the file comment).
template <typename In, int kN, bool kNorm, int kStrip>
__device__ __forceinline__ void forward_strip(const FullFusionForwardArgs& args, int64_t group,
                                              int64_t b, int64_t t_begin, int lane, Flags flags) {
  const FullFusionShape& s = args.shape;
  const GroupPlace place = place_group(s, group, kN);
  const bool active = lane < place.lanes;
  const int64_t T = s.seq;
  const int64_t channel = place.group_channel + lane * kN;
  const In* __restrict__ x = static_cast<const In*>(args.qkv) + b * args.qkv_stride_b + channel;
  float w[kN][kTaps];
  load_weights<In, kN>(static_cast<const In*>(args.conv_weight), channel, active, w);

  // window[j] = x[t - 3 + j]; tokens before 0 are the conv's zero padding.
  float window[kTaps][kN];
#pragma unroll
  for (int j = 0; j < kTaps - 1; ++j) {
    const int64_t t = t_begin - (kTaps - 1) + j;
    if (active && t >= 0 && t < T) {
      load_row<kN>(x + t * args.qkv_stride_t, flags.vec_qkv, window[j]);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) window[j][i] = 0.0f;
    }
  }
  float next[kN];
  if (active && t_begin < T) {
    load_row<kN>(x + t_begin * args.qkv_stride_t, flags.vec_qkv, next);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) next[i] = 0.0f;
  }
  const int64_t repeats = s.num_v_heads / s.num_k_heads;
#pragma unroll
  for (int step = 0; step < kStrip; ++step) {
    const int64_t t = t_begin + step;
#pragma unroll
    for (int i = 0; i < kN; ++i) window[kTaps - 1][i] = next[i];
    // Issue the next token's load before this token's math and stores.
    if (step + 1 < kStrip && active && t + 1 < T) {
      load_row<kN>(x + (t + 1) * args.qkv_stride_t, flags.vec_qkv, next);
    }
    float out[kN];
    float sum_sq = 0.0f;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const float taps[kTaps] = {window[0][i], window[1][i], window[2][i], window[3][i]};
      const float y = round_to<In>(full_fusion_conv(w[i], taps));
      out[i] = round_to<In>(full_fusion_silu(y));
      sum_sq += out[i] * out[i];
    }
    const int64_t token = b * T + t;
    if constexpr (kNorm) {
      const float r = full_fusion_rsqrt(lanes_sum(sum_sq, place.lanes) + kFullFusionL2Eps);
#pragma unroll
      for (int i = 0; i < kN; ++i) out[i] *= r;
      if (active && t < T) {
        float* dst = (place.which == 0 ? args.q : args.k) +
                     (token * s.num_v_heads + place.head * repeats) * s.head_k_dim + lane * kN;
        for (int64_t rep = 0; rep < repeats; ++rep)
          store_row<kN>(dst + rep * s.head_k_dim, flags.vec_out, out);
      }
    } else {
      if (active && t < T) {
        store_row<kN>(args.v + (token * s.num_v_heads + place.head) * s.head_v_dim + lane * kN,
                      flags.vec_out, out);
      }
    }
#pragma unroll
    for (int j = 0; j < kTaps - 1; ++j) {
#pragma unroll
      for (int i = 0; i < kN; ++i) window[j][i] = window[j + 1][i];
    }
  }
}

template <typename In, int kNqk, int kNv>
__global__ void __launch_bounds__(kThreads)
    full_fusion_forward_kernel(FullFusionForwardArgs args, int64_t tiles_per_seq, Flags flags) {
  constexpr int kStrip = kFullFusionForwardStrip;
  const int64_t group = blockIdx.y;
  const int64_t b = blockIdx.x / tiles_per_seq;
  const int64_t tile = blockIdx.x - b * tiles_per_seq;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t t_begin = (tile * kFullFusionWarps + warp) * kStrip;
  if (group < 2 * args.shape.num_k_heads) {
    forward_strip<In, kNqk, true, kStrip>(args, group, b, t_begin, lane, flags);
  } else {
    forward_strip<In, kNv, false, kStrip>(args, group, b, t_begin, lane, flags);
  }
}

// Gradient reaching one lane's channels at one token: for q/k the sum over the value
// heads the key head was repeated onto.
template <int kN, bool kNorm>
__device__ __forceinline__ void load_grad(const FullFusionBackwardArgs& args,
                                          const GroupPlace& place, int64_t token, int lane,
                                          bool vec, float (&g)[kN]) {
  const FullFusionShape& s = args.shape;
  if constexpr (kNorm) {
    const int64_t repeats = s.num_v_heads / s.num_k_heads;
    const float* src = (place.which == 0 ? args.grad_q : args.grad_k) +
                       (token * s.num_v_heads + place.head * repeats) * s.head_k_dim + lane * kN;
    load_row<kN>(src, vec, g);
    for (int64_t rep = 1; rep < repeats; ++rep) {
      float more[kN];
      load_row<kN>(src + rep * s.head_k_dim, vec, more);
#pragma unroll
      for (int i = 0; i < kN; ++i) g[i] += more[i];
    }
  } else {
    load_row<kN>(args.grad_v + (token * s.num_v_heads + place.head) * s.head_v_dim + lane * kN, vec,
                 g);
  }
}

// One warp's strip: kStrip owned tokens plus 3 halo tokens after them, whose dy the
// owned tokens' grad_qkv needs (grad_qkv[t] reads dy[t .. t + 3]). Halo tokens add nothing
// to the conv-weight sums (their owner strip adds them).
template <typename In, int kN, bool kNorm, int kStrip>
__device__ __forceinline__ void backward_strip(const FullFusionBackwardArgs& args, int64_t group,
                                               int64_t b, int64_t t_begin, int lane, Flags flags,
                                               float (&dw_sum)[kN][kTaps]) {
  const FullFusionShape& s = args.shape;
  const GroupPlace place = place_group(s, group, kN);
  const bool active = lane < place.lanes;
  const int64_t T = s.seq;
  const int64_t channel = place.group_channel + lane * kN;
  const In* __restrict__ x = static_cast<const In*>(args.qkv) + b * args.qkv_stride_b + channel;
  In* __restrict__ dx_out = static_cast<In*>(args.grad_qkv) + b * T * s.conv_dim() + channel;
  float w[kN][kTaps];
  load_weights<In, kN>(static_cast<const In*>(args.conv_weight), channel, active, w);

  float window[kTaps][kN];     // x[t - 3 + j]
  float dy_window[kTaps][kN];  // dy[t - 3 + j]
#pragma unroll
  for (int j = 0; j < kTaps - 1; ++j) {
    const int64_t t = t_begin - (kTaps - 1) + j;
    if (active && t >= 0 && t < T) {
      load_row<kN>(x + t * args.qkv_stride_t, flags.vec_qkv, window[j]);
    } else {
#pragma unroll
      for (int i = 0; i < kN; ++i) window[j][i] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) dy_window[j][i] = 0.0f;
  }
  float next_x[kN], next_g[kN];
  if (active && t_begin < T) {
    load_row<kN>(x + t_begin * args.qkv_stride_t, flags.vec_qkv, next_x);
    load_grad<kN, kNorm>(args, place, b * T + t_begin, lane, flags.vec_grad, next_g);
  } else {
#pragma unroll
    for (int i = 0; i < kN; ++i) next_x[i] = next_g[i] = 0.0f;
  }
  constexpr int kSteps = kStrip + kTaps - 1;
  for (int step = 0; step < kSteps; ++step) {
    const int64_t t = t_begin + step;
    const bool in_seq = t < T;
    float g[kN];
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      window[kTaps - 1][i] = next_x[i];
      g[i] = next_g[i];
    }
    if (step + 1 < kSteps && active && t + 1 < T) {
      load_row<kN>(x + (t + 1) * args.qkv_stride_t, flags.vec_qkv, next_x);
      load_grad<kN, kNorm>(args, place, b * T + t + 1, lane, flags.vec_grad, next_g);
    }
    float y[kN], act[kN];
    float sum_sq = 0.0f, dot = 0.0f;
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const float taps[kTaps] = {window[0][i], window[1][i], window[2][i], window[3][i]};
      y[i] = round_to<In>(full_fusion_conv(w[i], taps));
      act[i] = round_to<In>(full_fusion_silu(y[i]));
      sum_sq += act[i] * act[i];
      dot += g[i] * act[i];
    }
    float r = 0.0f;
    if constexpr (kNorm) {
      r = full_fusion_rsqrt(lanes_sum(sum_sq, place.lanes) + kFullFusionL2Eps);
      dot = lanes_sum(dot, place.lanes);
    }
#pragma unroll
    for (int i = 0; i < kN; ++i) {
      const float ds = round_to<In>(kNorm ? full_fusion_l2_backward(g[i], act[i], r, dot) : g[i]);
      dy_window[kTaps - 1][i] =
          (active && in_seq) ? round_to<In>(full_fusion_silu_backward(ds, y[i])) : 0.0f;
    }
    if (step < kStrip) {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
#pragma unroll
        for (int j = 0; j < kTaps; ++j)
          dw_sum[i][j] = fmaf(dy_window[kTaps - 1][i], window[j][i], dw_sum[i][j]);
      }
    }
    const int64_t t_out = t - (kTaps - 1);  // grad_qkv[t_out] has all its dy now
    if (step >= kTaps - 1 && active && t_out < T) {
      float dx[kN];
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        const float dys[kTaps] = {dy_window[0][i], dy_window[1][i], dy_window[2][i],
                                  dy_window[3][i]};
        dx[i] = full_fusion_conv_backward(w[i], dys);
      }
      store_row<kN>(dx_out + t_out * s.conv_dim(), flags.vec_out, dx);
    }
#pragma unroll
    for (int j = 0; j < kTaps - 1; ++j) {
#pragma unroll
      for (int i = 0; i < kN; ++i) {
        window[j][i] = window[j + 1][i];
        dy_window[j][i] = dy_window[j + 1][i];
      }
    }
  }
}

// Each warp's [channel][tap] conv-weight sums of its strip, to shared memory; the kernel
// then adds them over warps in warp order and atomically adds its head's W x 4 sums into
// the FP32 [C, 4] accumulator.
template <int kN>
__device__ __forceinline__ void stage_conv_weight_grad(const GroupPlace& place, int lane,
                                                       const float (&dw_sum)[kN][kTaps],
                                                       float* shared) {
  const int warp = threadIdx.x / 32;
  const int per_warp = static_cast<int>(place.head_dim) * kTaps;
  if (lane >= place.lanes) return;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
#pragma unroll
    for (int j = 0; j < kTaps; ++j)
      shared[warp * per_warp + (lane * kN + i) * kTaps + j] = dw_sum[i][j];
  }
}

// Largest head (256 channels) x 4 taps per warp.
constexpr int kMaxWarpDw = 256 * kTaps;

template <typename In, int kNqk, int kNv>
__global__ void __launch_bounds__(kThreads)
    full_fusion_backward_kernel(FullFusionBackwardArgs args, int64_t tiles_per_seq, Flags flags) {
  constexpr int kStrip = kFullFusionBackwardStrip;
  __shared__ float dw_shared[kFullFusionWarps * kMaxWarpDw];
  const int64_t group = blockIdx.y;
  const int64_t b = blockIdx.x / tiles_per_seq;
  const int64_t tile = blockIdx.x - b * tiles_per_seq;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t t_begin = (tile * kFullFusionWarps + warp) * kStrip;
  GroupPlace place;
  if (group < 2 * args.shape.num_k_heads) {
    place = place_group(args.shape, group, kNqk);
    float dw_sum[kNqk][kTaps] = {};
    backward_strip<In, kNqk, true, kStrip>(args, group, b, t_begin, lane, flags, dw_sum);
    stage_conv_weight_grad<kNqk>(place, lane, dw_sum, dw_shared);
  } else {
    place = place_group(args.shape, group, kNv);
    float dw_sum[kNv][kTaps] = {};
    backward_strip<In, kNv, false, kStrip>(args, group, b, t_begin, lane, flags, dw_sum);
    stage_conv_weight_grad<kNv>(place, lane, dw_sum, dw_shared);
  }
  __syncthreads();
  const int per_warp = static_cast<int>(place.head_dim) * kTaps;
  for (int idx = threadIdx.x; idx < per_warp; idx += kThreads) {
    float total = 0.0f;
    for (int w = 0; w < kFullFusionWarps; ++w) total += dw_shared[w * per_warp + idx];
    atomicAdd(args.grad_conv_weight + place.group_channel * kTaps + idx, total);
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

// NOTE: per_lane is 4 or 8 (full_fusion_head_layout); keep the two in sync.
template <typename Fn>
void dispatch_per_lane(int per_lane_qk, int per_lane_v, Fn&& fn) {
  using Four = std::integral_constant<int, 4>;
  using Eight = std::integral_constant<int, 8>;
  if (per_lane_qk == 4) {
    per_lane_v == 4 ? fn(Four{}, Four{}) : fn(Four{}, Eight{});
  } else {
    per_lane_v == 4 ? fn(Eight{}, Four{}) : fn(Eight{}, Eight{});
  }
}

int element_bytes(ScalarKind kind) { return kind == ScalarKind::kFloat32 ? 4 : 2; }

bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

struct LaunchPlan {
  int per_lane_qk = 0, per_lane_v = 0, max_per_lane = 0;
  int64_t tiles_per_seq = 0;
  dim3 grid;
};

LaunchPlan plan_launch(const FullFusionShape& s, int strip) {
  LaunchPlan plan;
  plan.per_lane_qk = full_fusion_head_layout(s.head_k_dim).per_lane;
  plan.per_lane_v = full_fusion_head_layout(s.head_v_dim).per_lane;
  plan.max_per_lane = std::max(plan.per_lane_qk, plan.per_lane_v);
  const int64_t tile_tokens = int64_t{kFullFusionWarps} * strip;
  plan.tiles_per_seq = (s.seq + tile_tokens - 1) / tile_tokens;
  plan.grid =
      dim3(static_cast<unsigned>(s.batch * plan.tiles_per_seq), static_cast<unsigned>(s.groups()));
  return plan;
}

}  // namespace

int launch_pre_gdr_full_fusion_forward(const FullFusionForwardArgs& args, CUstream_st* stream) {
  if (!validate_full_fusion_shape(args.shape).empty()) return cudaErrorInvalidValue;
  const LaunchPlan plan = plan_launch(args.shape, kFullFusionForwardStrip);
  const int64_t n = plan.max_per_lane;
  Flags flags;
  flags.vec_qkv = aligned(args.qkv, n * element_bytes(args.kind)) && args.qkv_stride_b % n == 0 &&
                  args.qkv_stride_t % n == 0;
  flags.vec_grad = false;
  flags.vec_out = aligned(args.q, n * 4) && aligned(args.k, n * 4) && aligned(args.v, n * 4);
  dispatch_kind(args.kind, [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_per_lane(plan.per_lane_qk, plan.per_lane_v, [&](auto qk, auto v) {
      full_fusion_forward_kernel<In, decltype(qk)::value, decltype(v)::value>
          <<<plan.grid, kThreads, 0, stream>>>(args, plan.tiles_per_seq, flags);
    });
  });
  return cudaGetLastError();
}

int launch_pre_gdr_full_fusion_backward(const FullFusionBackwardArgs& args, CUstream_st* stream) {
  if (!validate_full_fusion_shape(args.shape).empty()) return cudaErrorInvalidValue;
  const LaunchPlan plan = plan_launch(args.shape, kFullFusionBackwardStrip);
  const int64_t n = plan.max_per_lane;
  Flags flags;
  flags.vec_qkv = aligned(args.qkv, n * element_bytes(args.kind)) && args.qkv_stride_b % n == 0 &&
                  args.qkv_stride_t % n == 0;
  flags.vec_grad =
      aligned(args.grad_q, n * 4) && aligned(args.grad_k, n * 4) && aligned(args.grad_v, n * 4);
  flags.vec_out =
      aligned(args.grad_qkv, n * element_bytes(args.kind)) && args.shape.conv_dim() % n == 0;
  dispatch_kind(args.kind, [&](auto in_tag) {
    using In = decltype(in_tag);
    dispatch_per_lane(plan.per_lane_qk, plan.per_lane_v, [&](auto qk, auto v) {
      full_fusion_backward_kernel<In, decltype(qk)::value, decltype(v)::value>
          <<<plan.grid, kThreads, 0, stream>>>(args, plan.tiles_per_seq, flags);
    });
  });
  return cudaGetLastError();
}

}  // namespace gdr::kernels
