// FP32 <-> storage conversion and VEC-wide packed loads and stores, shared by the fused
// kernels whose bodies also compile as host C++ for their emulation tests (RMSNorm,
// causal conv1d, cross-entropy). The includer defines __device__ / __forceinline__ on the
// host; nvcc builds get the half and bfloat16 conversions here, host builds specialise
// StorageElement for their own 16-bit types (e.g. c10::BFloat16). One set of conversions
// (round to nearest even) for every kernel, so the kernels' rounding points agree.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace gdr::kernels {

template <typename T>
struct StorageElement;

template <>
struct StorageElement<float> {
  static __device__ __forceinline__ float to_float(float v) { return v; }
  static __device__ __forceinline__ float from_float(float v) { return v; }
};

#if defined(__CUDACC__)
template <>
struct StorageElement<__half> {
  static __device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half from_float(float v) { return __float2half_rn(v); }
};

template <>
struct StorageElement<__nv_bfloat16> {
  static __device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 from_float(float v) {
    return __float2bfloat16_rn(v);
  }
};
#endif

// VEC consecutive elements moved as one aligned load / store (16 bytes when vectorised).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// One aligned VEC-wide load, kept packed until it is used (fewer registers than floats, so
// several loads can be in flight at once).
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack(const T* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Pack<T, VEC>*>(p);
#else
  Pack<T, VEC> pack;
  for (int k = 0; k < VEC; ++k) pack.v[k] = p[k];
  return pack;
#endif
}

template <typename T, int VEC>
__device__ __forceinline__ void unpack(const Pack<T, VEC>& pack, float (&out)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = StorageElement<T>::to_float(pack.v[k]);
}

template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[VEC]) {
  unpack<T, VEC>(load_pack<T, VEC>(p), out);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[VEC]) {
#if defined(__CUDA_ARCH__)
  Pack<T, VEC> pack;
#pragma unroll
  for (int k = 0; k < VEC; ++k) pack.v[k] = StorageElement<T>::from_float(in[k]);
  *reinterpret_cast<Pack<T, VEC>*>(p) = pack;
#else
  for (int k = 0; k < VEC; ++k) p[k] = StorageElement<T>::from_float(in[k]);
#endif
}

}  // namespace gdr::kernels
