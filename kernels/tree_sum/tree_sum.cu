// The pairwise tree sum (kernels/tree_sum/tree_sum.h): elementwise, memory-bound. Each thread takes
// four consecutive elements per grid-stride round (16-byte FP32 / 8-byte 16-bit loads
// when every pointer is aligned and numel % 4 == 0, scalar otherwise), runs the program
// in registers (run_program) and stores slot 0. Roofline:
// HBM bandwidth over (sum of input bytes + 4 bytes of output) per element.
//
// Determinism: each output element is one thread's fixed sequence of FP32 adds (the
// program, a pure function of the leaf counts); no atomics, nothing across threads.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/common/storage_element.cuh"
#include "kernels/tree_sum/tree_sum.h"

namespace gdr::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kVec = 4;

// Four consecutive elements of one input (aligned to 4 elements) as a float4: one 16-byte
// (FP32) or 8-byte (16-bit) load.
template <typename T>
__device__ __forceinline__ float4 load4_as(const void* base, int64_t at) {
  float v[kVec];
  load_floats<T, kVec>(static_cast<const T*>(base) + at, v);
  return make_float4(v[0], v[1], v[2], v[3]);
}

__device__ __forceinline__ float4 load4(const void* base, TreeSumDtype dtype, int64_t at) {
  switch (dtype) {
    case TreeSumDtype::kFloat32: return load4_as<float>(base, at);
    case TreeSumDtype::kBFloat16: return load4_as<__nv_bfloat16>(base, at);
    default: return load4_as<__half>(base, at);
  }
}

__device__ __forceinline__ float load1(const void* base, TreeSumDtype dtype, int64_t at) {
  switch (dtype) {
    case TreeSumDtype::kFloat32: return load_float(static_cast<const float*>(base) + at);
    case TreeSumDtype::kBFloat16: return load_float(static_cast<const __nv_bfloat16*>(base) + at);
    default: return load_float(static_cast<const __half*>(base) + at);
  }
}

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// The program over one group of elements: T is float4 (vectorised) or float (scalar).
// The slot index is uniform across the grid, so the switches are uniform branches and
// every slot stays in a register (a runtime-indexed array would live in local memory,
// and unrolled compare-and-select over all slots per step made the kernel issue-bound).
template <typename T, typename Load, typename Add>
__device__ __forceinline__ T run_program(const TreeSumArgs& args, Load load, Add add) {
  static_assert(kTreeSumMaxSlots == 8, "the switches below name every slot");
  T s0, s1, s2, s3, s4, s5, s6, s7;
  for (int k = 0; k < args.step_count; ++k) {
    const TreeSumStep step = args.steps[k];
    if (step.input >= 0) {
      const T value = load(step.input);
      switch (step.slot) {
        case 0: s0 = value; break;
        case 1: s1 = value; break;
        case 2: s2 = value; break;
        case 3: s3 = value; break;
        case 4: s4 = value; break;
        case 5: s5 = value; break;
        case 6: s6 = value; break;
        default: s7 = value; break;
      }
    } else {
      switch (step.slot) {
        case 0: s0 = add(s0, s1); break;
        case 1: s1 = add(s1, s2); break;
        case 2: s2 = add(s2, s3); break;
        case 3: s3 = add(s3, s4); break;
        case 4: s4 = add(s4, s5); break;
        case 5: s5 = add(s5, s6); break;
        default: s6 = add(s6, s7); break;
      }
    }
  }
  return s0;
}

template <bool kVectorised>
__global__ void __launch_bounds__(kThreads) tree_sum_kernel(const TreeSumArgs args) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  if constexpr (kVectorised) {
    const int64_t groups = args.numel / kVec;
    for (int64_t g = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; g < groups;
         g += stride) {
      const int64_t at = g * kVec;
      const float4 sum = run_program<float4>(
          args, [&](int i) { return load4(args.inputs[i], args.dtypes[i], at); }, add4);
      *reinterpret_cast<float4*>(args.out + at) = sum;
    }
  } else {
    for (int64_t at = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; at < args.numel;
         at += stride) {
      const float sum = run_program<float>(
          args, [&](int i) { return load1(args.inputs[i], args.dtypes[i], at); },
          [](float a, float b) { return a + b; });
      args.out[at] = sum;
    }
  }
}

bool aligned(const void* p, int bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

}  // namespace

int launch_tree_sum(const TreeSumArgs& args, cudaStream_t stream) {
  if (args.numel == 0) return cudaSuccess;
  bool vectorised = args.numel % kVec == 0 && aligned(args.out, 16);
  for (int i = 0; i < args.input_count; ++i) {
    vectorised =
        vectorised && aligned(args.inputs[i], args.dtypes[i] == TreeSumDtype::kFloat32 ? 16 : 8);
  }
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t work = vectorised ? args.numel / kVec : args.numel;
  // Enough blocks for every SM several times over; a grid-stride loop does the rest.
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 8LL * sms ? wanted : 8LL * sms);
  if (vectorised) {
    tree_sum_kernel<true><<<blocks, kThreads, 0, stream>>>(args);
  } else {
    tree_sum_kernel<false><<<blocks, kThreads, 0, stream>>>(args);
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace gdr::kernels
