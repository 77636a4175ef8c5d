// The pairwise (binary-counter) sum of a few same-shaped tensors in one pass: every output
// element is computed in registers from all inputs by the fixed tree of Note [Gradient
// reduction tree] (gdr/distributed.h), so the result has the bits of the add-by-add
// evaluation of the same tree, with one read of each input and one write of the output
// instead of one read-modify-write pass per add. Used by PairwiseSum for the microbatch
// gradients (Note [Deferred gradient leaves] in gdr/distributed.cc). Host contract here;
// kernels in kernels/tree_sum/tree_sum.cu; the program builder in
// kernels/tree_sum/tree_sum_program.cc.
#pragma once

#include <cstdint>

typedef struct CUstream_st* cudaStream_t;

namespace gdr::kernels {

constexpr int kTreeSumMaxInputs = 16;
// Partial sums held at once (the program's stack depth).
constexpr int kTreeSumMaxSlots = 8;
constexpr int kTreeSumMaxSteps = 2 * kTreeSumMaxInputs;

enum class TreeSumDtype : int8_t { kFloat32, kBFloat16, kFloat16 };

// One step of the program: input >= 0 pushes that input (widened to FP32, exact) into
// slot `slot`; input < 0 adds slot `slot` + 1 into slot `slot` (older += newer, one FP32
// add). The result is slot 0 after the last step.
struct TreeSumStep {
  int8_t input;
  int8_t slot;
};

struct TreeSumArgs {
  const void* inputs[kTreeSumMaxInputs] = {};
  TreeSumDtype dtypes[kTreeSumMaxInputs] = {};
  int input_count = 0;
  TreeSumStep steps[kTreeSumMaxSteps] = {};
  int step_count = 0;
  int64_t numel = 0;
  // FP32, numel elements; may be one of the FP32 inputs (each element is read by the
  // thread that writes it, before it writes it).
  float* out = nullptr;
};

// The program of the binary-counter tree over inputs that hold leaf_counts[i] leaves each,
// in order: push each input, and while the two newest partial sums hold equally many
// leaves merge them (older += newer); then merge what is left, newest into older. This is
// PairwiseSum's order (gdr/distributed.cc). False (args untouched) when count is 0 or
// above kTreeSumMaxInputs, a count is < 1, or the stack would exceed kTreeSumMaxSlots.
bool tree_sum_program(const int64_t* leaf_counts, int count, TreeSumArgs* args);

// Runs args.steps over every element on `stream`; returns the launch's cudaError_t as an
// int. Inputs and out must be contiguous; numel may be 0.
int launch_tree_sum(const TreeSumArgs& args, cudaStream_t stream);

}  // namespace gdr::kernels
