// CUDA kernels of the fused gated activations (kernels/gated_activation/gated_activation.h): one
// pass forward (y = act(gate) * x) and one backward (grad_gate, grad_x), rounding where the unfused
// ATen ops round (Note [Gated activation rounding]). Memory-bound: 16-byte vectors (8 BF16/FP16 or
// 4 FP32 elements) per thread when every operand allows, else elements; the roofline is HBM
// bandwidth over 3 (forward) and 5 (backward) tensor passes.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "kernels/common/storage_element.cuh"
#include "kernels/gated_activation/gated_activation.h"

namespace gdr::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 8192;  // grid-stride beyond: ~60 blocks per SM on an H200

// round_to<T> (kernels/common/storage_element.cuh) below is the value an ATen op would have
// stored: FP32 math rounded to T (identity for FP32).

// ATen's formulas (silu_kernel, sigmoid_kernel_cuda), FP32 opmath.
template <GatedActivation A>
__device__ __forceinline__ float activation(float gate) {
  if constexpr (A == GatedActivation::kSilu) {
    return gate / (1.0f + expf(-gate));
  } else {
    return 1.0f / (1.0f + expf(-gate));
  }
}

// Element e of a segmented operand (GatedOperand), as an element offset.
__device__ __forceinline__ int64_t offset_of(const GatedOperand& op, int64_t numel, int64_t e) {
  if (op.segment >= numel) return e;
  const int64_t segment = e / op.segment;
  return segment * op.pitch + (e - segment * op.segment);
}

template <typename T, GatedActivation A>
__device__ __forceinline__ float forward_value(float gate, float x) {
  return round_to<T>(activation<A>(gate)) * x;  // mul(act(gate), x): FP32 product of stored values
}

// (grad_gate, grad_x) of one element. grad_x = dy * a (mul's backward); da = dy * x is
// stored in T (mul's output) before the activation's backward: silu_backward(da, gate)
// for silu, sigmoid_backward(da, a) for sigmoid, whose BF16/FP16 kernel rounds every
// intermediate (c10::BFloat16 / c10::Half arithmetic): (da * (1 - a)) * a.
template <typename T, GatedActivation A>
__device__ __forceinline__ void backward_values(float dy, float gate, float x, float& grad_gate,
                                                float& grad_x) {
  const float a = round_to<T>(activation<A>(gate));
  grad_x = dy * a;
  const float da = round_to<T>(dy * x);
  if constexpr (A == GatedActivation::kSilu) {
    const float sig = 1.0f / (1.0f + expf(-gate));
    grad_gate = da * sig * (1.0f + gate * (1.0f - sig));
  } else {
    grad_gate = round_to<T>(da * round_to<T>(1.0f - a)) * a;
  }
}

template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T, GatedActivation A, bool kVectorised>
__global__ void __launch_bounds__(kThreads) gated_forward_kernel(const GatedForwardArgs args) {
  constexpr int V = kVectorised ? kVec<T> : 1;
  const T* gate = static_cast<const T*>(args.gate.data);
  const T* x = static_cast<const T*>(args.x.data);
  T* y = static_cast<T*>(args.y);
  const int64_t items = args.numel / V;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t e = i * V;
    float g[V], xv[V], out[V];
    load_floats<T, V>(gate + offset_of(args.gate, args.numel, e), g);
    load_floats<T, V>(x + offset_of(args.x, args.numel, e), xv);
#pragma unroll
    for (int k = 0; k < V; ++k) out[k] = forward_value<T, A>(g[k], xv[k]);
    store_floats<T, V>(y + e, out);
  }
}

template <typename T, GatedActivation A, bool kVectorised>
__global__ void __launch_bounds__(kThreads) gated_backward_kernel(const GatedBackwardArgs args) {
  constexpr int V = kVectorised ? kVec<T> : 1;
  const T* dy = static_cast<const T*>(args.grad_y);
  const T* gate = static_cast<const T*>(args.gate.data);
  const T* x = static_cast<const T*>(args.x.data);
  T* grad_gate = static_cast<T*>(args.grad_gate);
  T* grad_x = static_cast<T*>(args.grad_x);
  const int64_t items = args.numel / V;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t e = i * V;
    float d[V], g[V], xv[V], dg[V], dx[V];
    load_floats<T, V>(dy + e, d);
    load_floats<T, V>(gate + offset_of(args.gate, args.numel, e), g);
    load_floats<T, V>(x + offset_of(args.x, args.numel, e), xv);
#pragma unroll
    for (int k = 0; k < V; ++k) backward_values<T, A>(d[k], g[k], xv[k], dg[k], dx[k]);
    store_floats<T, V>(grad_gate + e, dg);
    store_floats<T, V>(grad_x + e, dx);
  }
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whole vectors only: every pointer on 16 bytes, and segments, pitches and numel multiples
// of the vector, so no vector straddles a segment.
bool vector_ok(int64_t numel, int vec, std::initializer_list<GatedOperand> operands,
               std::initializer_list<const void*> outputs) {
  if (numel % vec != 0) return false;
  for (const GatedOperand& op : operands) {
    if (!aligned16(op.data)) return false;
    if (op.segment < numel && (op.segment % vec != 0 || op.pitch % vec != 0)) return false;
  }
  for (const void* p : outputs) {
    if (!aligned16(p)) return false;
  }
  return true;
}

bool operand_ok(const GatedOperand& op, int64_t numel) {
  return op.data != nullptr && op.segment >= 1 && (op.segment >= numel || op.pitch >= op.segment);
}

unsigned int blocks_for(int64_t items) {
  return static_cast<unsigned int>(
      std::max<int64_t>(1, std::min<int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks)));
}

template <typename Fn>
int dispatch(GatedDtype dtype, GatedActivation activation, Fn&& fn) {
  auto with_type = [&](auto type_tag) {
    using T = decltype(type_tag);
    if (activation == GatedActivation::kSilu) {
      return fn(T{}, std::integral_constant<GatedActivation, GatedActivation::kSilu>{});
    }
    return fn(T{}, std::integral_constant<GatedActivation, GatedActivation::kSigmoid>{});
  };
  switch (dtype) {
    case GatedDtype::kFloat32: return with_type(float{});
    case GatedDtype::kFloat16: return with_type(__half{});
    case GatedDtype::kBFloat16: return with_type(__nv_bfloat16{});
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace

// ----------------------------------------------------------------------------
// kernel launchers

int launch_gated_activation_forward(const GatedForwardArgs& args, CUstream_st* stream) {
  if (args.numel < 0 ||
      (args.numel > 0 && (!operand_ok(args.gate, args.numel) || !operand_ok(args.x, args.numel) ||
                          args.y == nullptr))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (args.numel == 0) return static_cast<int>(cudaSuccess);
  return dispatch(args.dtype, args.activation, [&](auto type_tag, auto act) {
    using T = decltype(type_tag);
    constexpr GatedActivation A = decltype(act)::value;
    if (vector_ok(args.numel, kVec<T>, {args.gate, args.x}, {args.y})) {
      gated_forward_kernel<T, A, true>
          <<<blocks_for(args.numel / kVec<T>), kThreads, 0, stream>>>(args);
    } else {
      gated_forward_kernel<T, A, false><<<blocks_for(args.numel), kThreads, 0, stream>>>(args);
    }
    return static_cast<int>(cudaGetLastError());
  });
}

int launch_gated_activation_backward(const GatedBackwardArgs& args, CUstream_st* stream) {
  if (args.numel < 0 ||
      (args.numel > 0 &&
       (args.grad_y == nullptr || !operand_ok(args.gate, args.numel) ||
        !operand_ok(args.x, args.numel) || args.grad_gate == nullptr || args.grad_x == nullptr))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  if (args.numel == 0) return static_cast<int>(cudaSuccess);
  return dispatch(args.dtype, args.activation, [&](auto type_tag, auto act) {
    using T = decltype(type_tag);
    constexpr GatedActivation A = decltype(act)::value;
    const GatedOperand grad_y{args.grad_y, args.numel, args.numel};
    if (vector_ok(args.numel, kVec<T>, {grad_y, args.gate, args.x},
                  {args.grad_gate, args.grad_x})) {
      gated_backward_kernel<T, A, true>
          <<<blocks_for(args.numel / kVec<T>), kThreads, 0, stream>>>(args);
    } else {
      gated_backward_kernel<T, A, false><<<blocks_for(args.numel), kThreads, 0, stream>>>(args);
    }
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace gdr::kernels
