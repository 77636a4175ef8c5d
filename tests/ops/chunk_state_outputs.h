// Helpers of the chunk state pass's CPU emulation tests: the pass's outputs as one list in
// the order the tests compare them, and the FP32 operand layouts the GDR core hands over.
#pragma once

#include <ATen/ATen.h>

#include <tuple>
#include <vector>

namespace gdr::test_support {

// o, final state, states, v_new, then du, dw, dqd, dp, dkend, dg_last, d_initial.
inline std::vector<at::Tensor> state_pass_outputs(
    const std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>& forward,
    const std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                     at::Tensor>& backward) {
  const auto& [o, s, states, v_new] = forward;
  const auto& [du, dw, dqd, dp, dkend, dg_last, d_initial] = backward;
  return {o, s, states, v_new, du, dw, dqd, dp, dkend, dg_last, d_initial};
}

// FP32 u and w as slices of one [U | W] tensor, and the upstream gradient transposed in
// memory: the layouts the core hands the pass.
struct Fp32CoreLayouts {
  at::Tensor u, w, grad_o;
};

inline Fp32CoreLayouts fp32_core_layouts(const at::Tensor& u, const at::Tensor& w,
                                         const at::Tensor& grad_o) {
  const at::Tensor uw = at::cat({u, w}, -1).to(at::kFloat);
  const int64_t dv = u.size(-1), dk = w.size(-1);
  return {uw.narrow(-1, 0, dv), uw.narrow(-1, dv, dk),
          grad_o.to(at::kFloat).transpose(0, 1).contiguous().transpose(0, 1)};
}

}  // namespace gdr::test_support
