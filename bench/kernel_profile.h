// print_kernel_profile: runs a callable once under PyTorch's Kineto profiler and prints
// where the GPU time went, for the benchmarks that say "where the time goes": the top CUDA
// kernels by GPU time with their launch counts, GPU-busy vs wall time (a launch-bound run
// shows busy << wall), and optionally the most-called host operators.
#pragma once

#include <functional>
#include <string>

namespace gdr::bench {

struct KernelProfileOptions {
  int top_kernels = 25;
  int top_host_operators = 0;  // 0: no host table
};

// `work` must leave the GPU idle-able: the profile ends with a device synchronise.
void print_kernel_profile(const std::string& title, const std::function<void()>& work,
                          const KernelProfileOptions& options = {});

}  // namespace gdr::bench
