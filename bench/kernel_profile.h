// print_kernel_profile: runs a callable once under PyTorch's Kineto profiler and prints
// where the GPU time went, for the benchmarks that say "where the time goes": the top CUDA
// kernels by GPU time with their launch counts, GPU-busy vs wall time (a launch-bound run
// shows busy << wall), and optionally the most-called host operators and which host operator
// launched each kernel.
#pragma once

#include <functional>
#include <string>

namespace gdr::bench {

struct KernelProfileOptions {
  int top_kernels = 25;
  int top_host_operators = 0;  // 0: no host table
  // Rows of GPU time by (launching host operator, kernel), 0: no table. The operator is the
  // innermost one open on the launching thread, with up to 2 outer ones for context (autograd
  // nodes). Only eager launches can be attributed: all kernels of a CUDA graph come from one
  // cudaGraphLaunch and show as "(CUDA graph replay)".
  int top_attributed = 0;
};

// `work` must leave the GPU idle-able: the profile ends with a device synchronise.
void print_kernel_profile(const std::string& title, const std::function<void()>& work,
                          const KernelProfileOptions& options = {});

}  // namespace gdr::bench
