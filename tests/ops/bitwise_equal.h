// bitwise_equal: the same shape, dtype and bytes (NaN payloads and signed zeros included),
// the comparison every determinism test makes. Two undefined tensors are equal; 0-dim
// tensors (a loss) compare too.
#pragma once

#include <ATen/ATen.h>

namespace gdr::test_support {

inline bool bitwise_equal(const at::Tensor& x, const at::Tensor& y) {
  if (!x.defined() || !y.defined()) return x.defined() == y.defined();
  if (x.sizes() != y.sizes() || x.scalar_type() != y.scalar_type()) return false;
  return at::equal(x.contiguous().reshape({-1}).view(at::kByte),
                   y.contiguous().reshape({-1}).view(at::kByte));
}

}  // namespace gdr::test_support
