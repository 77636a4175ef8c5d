// Host specialisations of kernels/common/storage_element.cuh's StorageElement for ATen's 16-bit
// types, for the kernel emulation tests (include after the kernel body). c10's
// float -> BFloat16 / Half conversions round to nearest even, like the device intrinsics
// __float2bfloat16_rn / __float2half_rn, so the emulation stores the device's bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace gdr::kernels {

template <>
struct StorageElement<c10::BFloat16> {
  static float to_float(c10::BFloat16 v) { return static_cast<float>(v); }
  static c10::BFloat16 from_float(float v) { return c10::BFloat16(v); }
};

template <>
struct StorageElement<c10::Half> {
  static float to_float(c10::Half v) { return static_cast<float>(v); }
  static c10::Half from_float(float v) { return c10::Half(v); }
};

}  // namespace gdr::kernels
