// Exhaustive GPU check of the pre-GDR gate backward's fast paths (Note [Gate backward fast
// paths] in kernels/pre_gdr_gate/pre_gdr_gate_element.cuh): every float input, compared bit for bit
// with the IEEE operations and with the per-element reference form. Test support only.
#pragma once

#include <cstdint>

namespace gdr::kernels {

struct GateElementCheckCounts {
  // Inputs x with reciprocal_fast_path_exact(x), and those whose fast reciprocal differs
  // from __frcp_rn(x).
  uint64_t reciprocal_checked = 0, reciprocal_mismatches = 0;
  // Inputs pre <= 20 (or NaN) whose z = expf(pre) passes
  // quotient_over_successor_fast_path_exact, and those whose fast z / (z + 1) differs
  // from the IEEE quotient.
  uint64_t division_checked = 0, division_mismatches = 0;
  // Four-element calls of gate_backward_elements4 (lane 0 takes every float as a, lanes
  // 1-3 bijective remixes of it; b likewise), and the calls where any output of any lane
  // (da, db, both sums) differs from gate_backward_element's.
  uint64_t element_checked = 0, element_mismatches = 0;
};

// Runs the check over all 2^32 bit patterns on the current device (blocking). Returns 0
// (cudaSuccess) or the CUDA error code.
int check_pre_gdr_gate_element_fast_paths(GateElementCheckCounts* counts);

}  // namespace gdr::kernels
