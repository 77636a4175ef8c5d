// Note [Gate backward fast paths] (kernels/pre_gdr_gate/pre_gdr_gate_element.cuh), checked by
// exhaustion: over every 32-bit pattern, the fast reciprocal and division give the IEEE bits
// wherever their range tests pass, and the four-element backward gives gate_backward_element's bits
// for every input (the fast paths and the fallback both).
#include <gtest/gtest.h>

#include <cstdint>

#include "kernels/pre_gdr_gate/pre_gdr_gate_element_check.h"

namespace gdr {
namespace {

TEST(GateElementFastPaths, MatchTheIeeeOperationsOnEveryFloat) {
  kernels::GateElementCheckCounts counts;
  ASSERT_EQ(kernels::check_pre_gdr_gate_element_fast_paths(&counts), 0);
  // Biased exponents 1..252, both signs, every mantissa.
  EXPECT_EQ(counts.reciprocal_checked, uint64_t{2} * 252 * (uint64_t{1} << 23));
  EXPECT_EQ(counts.reciprocal_mismatches, 0u);
  // Every pre <= 20 whose exp is 0 or in [2^-60, 2^60]: the 2^31 - 2^23 negative
  // non-NaN patterns less the ~1.1e7 in about (-103.97, -41.59), plus the 1.1e9
  // non-negative ones up to 20: about 3.229e9.
  EXPECT_GT(counts.division_checked, uint64_t{3'200'000'000});
  EXPECT_EQ(counts.division_mismatches, 0u);
  EXPECT_EQ(counts.element_checked, uint64_t{1} << 32);
  EXPECT_EQ(counts.element_mismatches, 0u);
  std::printf("reciprocal %llu checked, division %llu checked, elements %llu checked\n",
              static_cast<unsigned long long>(counts.reciprocal_checked),
              static_cast<unsigned long long>(counts.division_checked),
              static_cast<unsigned long long>(counts.element_checked));
}

}  // namespace
}  // namespace gdr
