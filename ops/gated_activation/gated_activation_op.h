// Fused gated activations of the Qwen3.5 model as one autograd op each way:
//   silu:    y = silu(gate) * x      (the MLP: silu(gate_proj(h)) * up_proj(h))
//   sigmoid: y = x * sigmoid(gate)   (gated attention: attn * sigmoid(gate))
// gate and x: one dtype (Float, Half, BFloat16; Double on the CPU), one device, the same
// number of elements, taken elementwise in row-major order; y has x's shape, grad_gate
// gate's. On CUDA the kernels of kernels/gated_activation/gated_activation.h read a contiguous
// operand, or one whose last dim is contiguous and whose leading dims step uniformly (a piece split
// off a wider projection), in place; anything else is copied contiguous first. Outputs and
// gradients carry the unfused ATen ops' bits (Note [Gated activation rounding]); the CPU
// implementation is those ATen ops. Elementwise, deterministic by construction.
//
// The model's switch: the execution policy's gated_activation = fused|composite
// (kernels.gated_activation, environment override GDR_GATED_ACTIVATION; default fused)
// picks this op or the ATen composite on CUDA (models/qwen/layers.cc).
#pragma once

#include <ATen/core/Tensor.h>

#include "ops/policy/execution_policy.h"

#include <tuple>

namespace gdr {

enum class GatedActivationKind : int64_t { kSilu = 0, kSigmoid = 1 };

// The unfused ATen ops (autograd through them): at::silu(gate) * x, x * gate.sigmoid(),
// with gate viewed in x's shape. The reference, and the model's path on the CPU.
at::Tensor gated_activation_composite(const at::Tensor& gate, const at::Tensor& x,
                                      GatedActivationKind kind);

// The autograd-aware fused op (dispatches to CPU or CUDA).
at::Tensor gated_activation_fused(const at::Tensor& gate, const at::Tensor& x,
                                  GatedActivationKind kind);

// The forward and backward ops alone (no autograd): y; (grad_gate, grad_x).
at::Tensor gated_activation_forward(const at::Tensor& gate, const at::Tensor& x,
                                    GatedActivationKind kind);
std::tuple<at::Tensor, at::Tensor> gated_activation_backward(const at::Tensor& grad_y,
                                                             const at::Tensor& gate,
                                                             const at::Tensor& x,
                                                             GatedActivationKind kind);

// The model's entry: the fused op for CUDA inputs of dtype Float, Half or BFloat16 when the
// switch says fused, else the composite.
at::Tensor gated_activation(const at::Tensor& gate, const at::Tensor& x, GatedActivationKind kind);

}  // namespace gdr
