// Activation recomputation (the reentrant variant of torch.utils.checkpoint, in C++): a
// block's intermediate activations are dropped after its forward and recomputed in the
// backward, trading one more forward of the block for its activation memory.
//
// Note [Recomputation]: recompute_in_backward(fn, inputs) runs fn(inputs) once in the
// forward, with gradients on and on detached copies of the inputs, and keeps only the
// inputs and the outputs' values (the graph fn built is dropped with its saved tensors).
// The backward restores the forward's execution policy (Note [Execution policy]), runs fn
// again on the saved inputs, and backpropagates the incoming output gradients through that
// run: gradients of the parameters fn reads accumulate into their .grad there, gradients of
// the inputs are returned to the outer backward. Both runs execute the same code with the
// same inputs and policy, with gradients on (so no op may take a no-grad shortcut with other
// bits), hence the same bits as not recomputing: the outputs are those of the plain forward
// and so are all gradients, as long as fn is deterministic, which gdr's blocks are in
// deterministic mode. fn must not draw random numbers (gdr's model has no dropout) and must
// read its parameters from its closure, not from `inputs`.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

namespace gdr {

using RecomputedBlock = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;

// fn(inputs), differentiable, with fn's activations recomputed in the backward. Inputs may
// be undefined (passed through to fn as undefined); outputs must be defined floating
// tensors. Without grad mode, or when no input requires grad, it is just fn(inputs)
// (nothing to recompute for). Otherwise at least one input must require grad, which in a
// model is the hidden state.
std::vector<at::Tensor> recompute_in_backward(const RecomputedBlock& fn,
                                              const std::vector<at::Tensor>& inputs);

}  // namespace gdr
