// expect_close: a kernel's output against a reference with a stated tolerance, for the GPU
// tests that compare fused ops with their composites. Every element must satisfy
// |got - ref| <= rtol |ref| + atol_rel max|ref|, and at most max_loose_fraction of the
// elements may differ by more than FP32 noise (1e-5 relative, 1e-6 of max|ref|).
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>

namespace gdr::test_support {

struct Tolerance {
  double rtol, atol_rel;
  double max_loose_fraction;  // elements allowed beyond FP32 noise
};

inline void expect_close(const at::Tensor& got, const at::Tensor& ref, const Tolerance& tol,
                         const std::string& context) {
  ASSERT_EQ(got.sizes(), ref.sizes()) << context;
  ASSERT_EQ(got.scalar_type(), ref.scalar_type()) << context;
  const at::Tensor f = got.to(at::kDouble), r = ref.to(at::kDouble);
  const at::Tensor diff = (f - r).abs();
  const double scale = r.abs().max().item<double>();
  const at::Tensor bound = r.abs() * tol.rtol + tol.atol_rel * scale + 1e-12;
  const double worst = (diff / bound).max().item<double>();
  EXPECT_LE(worst, 1.0) << context << ": max |diff| " << diff.max().item<double>() << " (max |ref| "
                        << scale << ")";
  const double loose = (diff > r.abs() * 1e-5 + 1e-6 * scale).to(at::kDouble).mean().item<double>();
  EXPECT_LE(loose, tol.max_loose_fraction) << context << ": fraction beyond FP32 noise";
}

}  // namespace gdr::test_support
