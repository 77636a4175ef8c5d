#include <cstddef>
#include <vector>

#include "kernels/tree_sum/tree_sum.h"

namespace gdr::kernels {

bool tree_sum_program(const int64_t* leaf_counts, int count, TreeSumArgs* args) {
  if (count < 1 || count > kTreeSumMaxInputs) return false;
  std::vector<int64_t> stack;  // leaves of each slot's partial sum
  std::vector<TreeSumStep> steps;
  for (int i = 0; i < count; ++i) {
    if (leaf_counts[i] < 1) return false;
    if (static_cast<int>(stack.size()) == kTreeSumMaxSlots) return false;
    steps.push_back({static_cast<int8_t>(i), static_cast<int8_t>(stack.size())});
    stack.push_back(leaf_counts[i]);
    while (stack.size() >= 2 && stack[stack.size() - 1] == stack[stack.size() - 2]) {
      steps.push_back({-1, static_cast<int8_t>(stack.size() - 2)});
      stack[stack.size() - 2] += stack.back();
      stack.pop_back();
    }
  }
  while (stack.size() >= 2) {
    steps.push_back({-1, static_cast<int8_t>(stack.size() - 2)});
    stack[stack.size() - 2] += stack.back();
    stack.pop_back();
  }
  args->input_count = count;
  args->step_count = static_cast<int>(steps.size());
  for (size_t k = 0; k < steps.size(); ++k) args->steps[k] = steps[k];
  return true;
}

}  // namespace gdr::kernels
