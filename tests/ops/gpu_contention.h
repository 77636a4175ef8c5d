// GpuContention: while alive, another host thread keeps two other CUDA streams busy with
// matmuls and reductions, so replay tests check bit-exactness under a loaded GPU (the
// condition in which scheduling-dependent reductions would show up).
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <thread>

namespace gdr::test_support {

class GpuContention {
 public:
  GpuContention() : thread_([this] { run(); }) {}
  ~GpuContention() {
    stop_.store(true);
    thread_.join();
  }
  GpuContention(const GpuContention&) = delete;
  GpuContention& operator=(const GpuContention&) = delete;

 private:
  void run() {
    c10::cuda::CUDAStream s1 = c10::cuda::getStreamFromPool(), s2 = c10::cuda::getStreamFromPool();
    at::Tensor m;
    {
      c10::cuda::CUDAStreamGuard g(s1);
      m = at::randn({2048, 2048}, at::TensorOptions().device(at::kCUDA));
    }
    s1.synchronize();
    while (!stop_.load()) {
      {
        c10::cuda::CUDAStreamGuard g(s1);
        at::Tensor r = at::matmul(m, m);
      }
      {
        c10::cuda::CUDAStreamGuard g(s2);
        at::Tensor r = m.sum(0);
      }
    }
    s1.synchronize();
    s2.synchronize();
  }

  std::atomic<bool> stop_{false};
  std::thread thread_;  // last: starts after stop_ exists
};

}  // namespace gdr::test_support
