#include "ops/recompute/recompute_op.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <memory>

#include "ops/policy/autograd_policy.h"

namespace gdr {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Holds the block in the autograd context (saved_data takes IValues only).
struct BlockHolder : torch::CustomClassHolder {
  explicit BlockHolder(RecomputedBlock f) : fn(std::move(f)) {}
  RecomputedBlock fn;
};

constexpr char kBlock[] = "block";
constexpr char kDefined[] = "defined";

// Detached copies of `inputs` that are graph leaves requiring grad where the originals did.
variable_list detached_leaves(at::TensorList inputs) {
  variable_list leaves;
  leaves.reserve(inputs.size());
  for (const at::Tensor& t : inputs) {
    if (!t.defined()) {
      leaves.emplace_back();
      continue;
    }
    at::Tensor leaf = t.detach();
    leaf.set_requires_grad(t.requires_grad());
    leaves.push_back(std::move(leaf));
  }
  return leaves;
}

// The block's inputs with the undefined ones put back where `defined` says (autograd takes
// defined tensors only).
variable_list with_undefined(const c10::List<bool>& defined, at::TensorList tensors) {
  variable_list inputs;
  size_t next = 0;
  for (bool d : defined) inputs.push_back(d ? tensors.at(next++) : at::Tensor());
  return inputs;
}

class RecomputeFunction : public torch::autograd::Function<RecomputeFunction> {
 public:
  // `tensors` (the defined inputs) as a TensorList: autograd counts each of its tensors as an
  // input (a std::vector argument would count as one non-tensor argument).
  static variable_list forward(AutogradContext* ctx, const RecomputedBlock& fn,
                               const c10::List<bool>& defined, at::TensorList tensors) {
    save_execution_policy(ctx);
    ctx->saved_data[kBlock] = at::IValue::make_capsule(c10::make_intrusive<BlockHolder>(fn));
    ctx->saved_data[kDefined] = defined;
    ctx->save_for_backward(tensors.vec());
    variable_list outputs;
    {
      // Gradients on, as in the backward's run (Note [Recomputation]); the graph built here
      // dies with `leaves` at the end of the scope.
      at::AutoGradMode grad_on(true);
      const variable_list leaves = detached_leaves(with_undefined(defined, tensors));
      for (at::Tensor& out : fn(leaves)) {
        TORCH_CHECK(out.defined() && at::isFloatingType(out.scalar_type()),
                    "recompute_in_backward: expected the block's outputs to be defined floating "
                    "tensors");
        bool aliases_input = false;
        for (const at::Tensor& leaf : leaves)
          aliases_input |= leaf.defined() && out.is_alias_of(leaf);
        // An input handed back (a layer whose residual is its input) leaves as a copy: autograd
        // wants a Function's outputs to be its own tensors.
        outputs.push_back(aliases_input ? out.detach().clone() : out.detach());
      }
    }
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
    const RecomputedBlock& fn =
        static_cast<BlockHolder*>(ctx->saved_data.at(kBlock).toCapsule().get())->fn;
    const c10::List<bool> defined = ctx->saved_data.at(kDefined).toBoolList();
    const variable_list leaves =
        detached_leaves(with_undefined(defined, ctx->get_saved_variables()));
    variable_list outputs;
    {
      at::AutoGradMode grad_on(true);
      outputs = fn(leaves);
    }
    TORCH_CHECK(outputs.size() == grad_outputs.size(), "recompute_in_backward: the block returned ",
                outputs.size(), " outputs in the backward's run but ", grad_outputs.size(),
                " in the forward's");
    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (!grad_outputs[i].defined() || !outputs[i].requires_grad()) continue;
      roots.push_back(outputs[i]);
      root_grads.push_back(grad_outputs[i]);
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    // One slot per forward argument: fn, defined, then each defined input.
    variable_list grad_inputs = {at::Tensor(), at::Tensor()};
    for (const at::Tensor& leaf : leaves) {
      if (!leaf.defined()) continue;
      grad_inputs.push_back(leaf.requires_grad() ? leaf.grad() : at::Tensor());
    }
    return grad_inputs;
  }
};

}  // namespace

std::vector<at::Tensor> recompute_in_backward(const RecomputedBlock& fn,
                                              const std::vector<at::Tensor>& inputs) {
  bool any_requires_grad = false;
  for (const at::Tensor& t : inputs) any_requires_grad |= t.defined() && t.requires_grad();
  if (!at::GradMode::is_enabled() || !any_requires_grad) return fn(inputs);
  c10::List<bool> defined;
  std::vector<at::Tensor> tensors;
  for (const at::Tensor& t : inputs) {
    defined.push_back(t.defined());
    if (t.defined()) tensors.push_back(t);
  }
  return RecomputeFunction::apply(fn, defined, at::TensorList(tensors));
}

}  // namespace gdr
