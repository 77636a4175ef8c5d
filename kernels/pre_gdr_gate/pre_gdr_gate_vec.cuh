// Four adjacent elements of a gate operand as one aligned vector (8 bytes for the 16-bit
// types, 16 for FP32): the loads and stores of the vectorised gate kernels
// (kernels/pre_gdr_gate/pre_gdr_gate.cu) and of their roofline probes (kernels/pre_gdr_gate/pre_gdr_gate_roofline.cu).
// Widening is exact and narrowing rounds to nearest even, element by element, so a vector
// access gives the bits of four scalar ones. Device code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace gdr::kernels {

template <typename In>
struct InVec;  // four elements of In, loaded as one aligned vector
template <>
struct InVec<float> {
  using Raw = float4;
  __device__ __forceinline__ static void unpack(const Raw& r, float (&v)[4]) {
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
  }
};
template <>
struct InVec<__nv_bfloat16> {
  using Raw = uint2;
  __device__ __forceinline__ static void unpack(const Raw& r, float (&v)[4]) {
    // Exact widening, the same bits as __bfloat162float on each element.
    const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.x));
    const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&r.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
};
template <>
struct InVec<__half> {
  using Raw = uint2;
  __device__ __forceinline__ static void unpack(const Raw& r, float (&v)[4]) {
    const float2 lo = __half22float2(*reinterpret_cast<const __half2*>(&r.x));
    const float2 hi = __half22float2(*reinterpret_cast<const __half2*>(&r.y));
    v[0] = lo.x, v[1] = lo.y, v[2] = hi.x, v[3] = hi.y;
  }
};

template <typename In>
__device__ __forceinline__ void load_vec(const In* p, float (&v)[4]) {
  using Raw = typename InVec<In>::Raw;
  InVec<In>::unpack(__ldg(reinterpret_cast<const Raw*>(p)), v);
}

// Four floats stored as one aligned vector of the output type, each rounded as
// store_from_float rounds it (round to nearest even).
__device__ __forceinline__ void store_vec(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store_vec(__nv_bfloat16* p, const float (&v)[4]) {
  const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]);
  const __nv_bfloat162 hi = __floats2bfloat162_rn(v[2], v[3]);
  uint2 raw;
  raw.x = *reinterpret_cast<const uint32_t*>(&lo);
  raw.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = raw;
}
__device__ __forceinline__ void store_vec(__half* p, const float (&v)[4]) {
  const __half2 lo = __floats2half2_rn(v[0], v[1]);
  const __half2 hi = __floats2half2_rn(v[2], v[3]);
  uint2 raw;
  raw.x = *reinterpret_cast<const uint32_t*>(&lo);
  raw.y = *reinterpret_cast<const uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(p) = raw;
}

}  // namespace gdr::kernels
