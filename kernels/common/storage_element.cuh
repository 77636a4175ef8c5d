// FP32 <-> storage conversion and packed loads and stores: the one set every kernel in
// kernels/ uses to read its float / __half / __nv_bfloat16 operands as FP32 and to store
// FP32 results back. The bodies that also compile as host C++ for their emulation tests
// (RMSNorm, causal conv1d, cross-entropy, embedding rows) include it too: the includer
// defines __device__ / __forceinline__ on the host; nvcc builds get the half and bfloat16
// conversions and the read-only-cache (__ldg) loads here, host builds specialise
// StorageElement for their own 16-bit types (e.g. c10::BFloat16). One set of conversions
// (widening exact, narrowing round to nearest even) for every kernel, so the kernels'
// rounding points agree. Conversions are element by element: a packed access gives the
// bits of VEC scalar ones (ptxas fuses adjacent 16-bit conversions into the paired
// instructions itself).
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
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

// The value an FP32 result has once stored in T and read back: where the unfused ATen
// composition a kernel reproduces stores an intermediate in the activation dtype.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return StorageElement<T>::to_float(StorageElement<T>::from_float(v));
}

// One element as a float, and one float stored (rounded to T).
template <typename T>
__device__ __forceinline__ float load_float(const T* p) {
  return StorageElement<T>::to_float(*p);
}

template <typename T>
__device__ __forceinline__ void store_float(T* p, float v) {
  *p = StorageElement<T>::from_float(v);
}

#if defined(__CUDACC__)
// One element through the read-only data cache (__ldg, ld.global.nc): only for operands
// that no thread writes while the kernel runs.
template <typename T>
__device__ __forceinline__ float load_float_ldg(const T* p) {
  return StorageElement<T>::to_float(__ldg(p));
}
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

#if defined(__CUDACC__)
// The built-in vector type of a pack's size: what __ldg takes for one vector load.
template <int kBytes>
struct PackWord;
template <>
struct PackWord<4> {
  using Type = unsigned int;
};
template <>
struct PackWord<8> {
  using Type = uint2;
};
template <>
struct PackWord<16> {
  using Type = uint4;
};

// load_pack through the read-only data cache (__ldg, one ld.global.nc of the pack's width):
// only for operands that no thread writes while the kernel runs.
template <typename T, int VEC>
__device__ __forceinline__ Pack<T, VEC> load_pack_ldg(const T* p) {
  using Word = typename PackWord<static_cast<int>(sizeof(Pack<T, VEC>))>::Type;
  Pack<T, VEC> pack;
  *reinterpret_cast<Word*>(&pack) = __ldg(reinterpret_cast<const Word*>(p));
  return pack;
}
#endif

// The pack by value: a const reference to a temporary (store_pack(p, load_pack(q))) made
// nvcc store it in 2- and 4-byte pieces instead of one vector store.
template <typename T, int VEC>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, VEC> pack) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Pack<T, VEC>*>(p) = pack;
#else
  for (int k = 0; k < VEC; ++k) p[k] = pack.v[k];
#endif
}

template <typename T, int VEC>
__device__ __forceinline__ void unpack(const Pack<T, VEC>& pack, float (&out)[VEC]) {
#pragma unroll
  for (int k = 0; k < VEC; ++k) out[k] = StorageElement<T>::to_float(pack.v[k]);
}

// Elements of T per pack when load_floats / store_floats move VEC of them: all VEC in one
// pack up to 16 bytes (the widest vector access on sm_90), else 16-byte packs, so a row is
// only ever assumed aligned to 16 bytes.
template <typename T, int VEC>
constexpr int kPackElements = static_cast<int>(sizeof(T)) * VEC > 16
                                  ? 16 / static_cast<int>(sizeof(T))
                                  : VEC;

// VEC consecutive elements (aligned to the pack, kPackElements) as floats. A row of one
// pack keeps the plain form: the chunk loop, even of one pass, changed nvcc's code (the
// FP32 scalar gated-activation backward grew by ~270 SASS instructions).
template <typename T, int VEC>
__device__ __forceinline__ void load_floats(const T* p, float (&out)[VEC]) {
  constexpr int kChunk = kPackElements<T, VEC>;
  static_assert(VEC % kChunk == 0, "whole packs");
  if constexpr (kChunk == VEC) {
    unpack<T, VEC>(load_pack<T, VEC>(p), out);
  } else {
#pragma unroll
    for (int c = 0; c < VEC / kChunk; ++c) {
      const Pack<T, kChunk> pack = load_pack<T, kChunk>(p + c * kChunk);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) out[c * kChunk + k] = StorageElement<T>::to_float(pack.v[k]);
    }
  }
}

#if defined(__CUDACC__)
// load_floats through the read-only data cache (load_pack_ldg).
template <typename T, int VEC>
__device__ __forceinline__ void load_floats_ldg(const T* p, float (&out)[VEC]) {
  constexpr int kChunk = kPackElements<T, VEC>;
  static_assert(VEC % kChunk == 0, "whole packs");
  if constexpr (kChunk == VEC) {
    unpack<T, VEC>(load_pack_ldg<T, VEC>(p), out);
  } else {
#pragma unroll
    for (int c = 0; c < VEC / kChunk; ++c) {
      const Pack<T, kChunk> pack = load_pack_ldg<T, kChunk>(p + c * kChunk);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) out[c * kChunk + k] = StorageElement<T>::to_float(pack.v[k]);
    }
  }
}
#endif

// VEC floats stored as VEC consecutive elements (aligned to the pack, kPackElements), each
// rounded by StorageElement<T>::from_float.
template <typename T, int VEC>
__device__ __forceinline__ void store_floats(T* p, const float (&in)[VEC]) {
#if defined(__CUDA_ARCH__)
  constexpr int kChunk = kPackElements<T, VEC>;
  static_assert(VEC % kChunk == 0, "whole packs");
  if constexpr (kChunk == VEC) {
    Pack<T, VEC> pack;
#pragma unroll
    for (int k = 0; k < VEC; ++k) pack.v[k] = StorageElement<T>::from_float(in[k]);
    *reinterpret_cast<Pack<T, VEC>*>(p) = pack;
  } else {
#pragma unroll
    for (int c = 0; c < VEC / kChunk; ++c) {
      Pack<T, kChunk> pack;
#pragma unroll
      for (int k = 0; k < kChunk; ++k)
        pack.v[k] = StorageElement<T>::from_float(in[c * kChunk + k]);
      *reinterpret_cast<Pack<T, kChunk>*>(p + c * kChunk) = pack;
    }
  }
#else
  for (int k = 0; k < VEC; ++k) p[k] = StorageElement<T>::from_float(in[k]);
#endif
}

}  // namespace gdr::kernels
