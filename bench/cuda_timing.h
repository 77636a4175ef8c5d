// Median time of a host callable measured with CUDA events on the current stream: the
// timing loop every benchmark in bench/ shares (warm-up calls first, then one event pair
// per call, median of the samples).
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace gdr::bench {

inline double median_event_ms(const std::function<void()>& fn, int warmup, int repeats) {
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> samples;
  for (int i = 0; i < repeats; ++i) {
    cudaEventRecord(start, stream);
    fn();
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0;
    cudaEventElapsedTime(&ms, start, stop);
    samples.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

}  // namespace gdr::bench
