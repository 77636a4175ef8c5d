// Median time of a host callable measured with CUDA events on the current stream: the
// timing loop every benchmark in bench/ shares (warm-up calls first, then one event pair
// per call, median of the samples).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace gdr::bench {

// One event pair on the current stream: time_ms(fn) records, runs fn, records, waits.
class EventTimer {
 public:
  EventTimer() : stream_(c10::cuda::getCurrentCUDAStream().stream()) {
    cudaEventCreate(&start_);
    cudaEventCreate(&stop_);
  }
  ~EventTimer() {
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
  }
  EventTimer(const EventTimer&) = delete;
  EventTimer& operator=(const EventTimer&) = delete;

  double time_ms(const std::function<void()>& fn) {
    cudaEventRecord(start_, stream_);
    fn();
    cudaEventRecord(stop_, stream_);
    cudaEventSynchronize(stop_);
    float ms = 0;
    cudaEventElapsedTime(&ms, start_, stop_);
    return ms;
  }

 private:
  cudaStream_t stream_;
  cudaEvent_t start_, stop_;
};

// The median of samples (the upper one of the middle two for an even count); samples must
// not be empty.
inline double median_of(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

inline double median_event_ms(const std::function<void()>& fn, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) fn();
  EventTimer timer;
  std::vector<double> samples;
  for (int i = 0; i < repeats; ++i) samples.push_back(timer.time_ms(fn));
  return median_of(std::move(samples));
}

// The median of `pairs` per-pair time ratios numerator / denominator, the two calls
// alternating (each with its own event pair and synchronisation) and taking turns to go
// first. Host-bound times of 10-20 us drift by several us between runs and machines, so
// two medians taken seconds apart compare the drift as much as the callables; pairing
// puts both under the same conditions.
inline double median_paired_ratio(const std::function<void()>& numerator,
                                  const std::function<void()>& denominator, int warmup, int pairs) {
  for (int i = 0; i < warmup; ++i) {
    numerator();
    denominator();
  }
  EventTimer timer;
  std::vector<double> ratios;
  for (int i = 0; i < pairs; ++i) {
    double num = 0, den = 0;
    if (i % 2 == 0) {
      num = timer.time_ms(numerator);
      den = timer.time_ms(denominator);
    } else {
      den = timer.time_ms(denominator);
      num = timer.time_ms(numerator);
    }
    ratios.push_back(num / den);
  }
  return median_of(std::move(ratios));
}

// GPU time of one call of `fn` without host overhead: `warmup_calls` eager calls on a side
// stream (autotuning, cuDNN algorithm choice and allocations happen before capture), then
// `calls_per_graph` calls captured in one CUDA graph, median replay time (median_event_ms)
// divided by calls_per_graph. Returns -1 when the work cannot be captured (a host sync
// inside, say), with the reason in *error when error is given (else on stderr); the broken
// capture is ended first, so the stream and the caching allocator leave capture mode and
// the caller can go on measuring other cases.
inline double median_graph_ms(const std::function<void()>& fn, int calls_per_graph,
                              int warmup_calls, int warmup, int repeats,
                              std::string* error = nullptr) {
  c10::cuda::CUDAStream capture_stream = c10::cuda::getStreamFromPool();
  c10::cuda::getCurrentCUDAStream().synchronize();  // inputs made on the current stream
  c10::cuda::CUDAStreamGuard guard(capture_stream);
  for (int i = 0; i < warmup_calls; ++i) fn();
  capture_stream.synchronize();
  at::cuda::CUDAGraph graph;
  try {
    graph.capture_begin();
    try {
      for (int i = 0; i < calls_per_graph; ++i) fn();
    } catch (...) {
      // capture_end leaves the allocator's capture pool, then throws for the invalidated
      // capture; the body's error is the one worth reporting.
      try {
        graph.capture_end();
      } catch (...) {
      }
      (void)cudaGetLastError();
      throw;
    }
    graph.capture_end();
    return median_event_ms([&] { graph.replay(); }, warmup, repeats) / calls_per_graph;
  } catch (const c10::Error& e) {
    if (error != nullptr) {
      *error = e.what_without_backtrace();
    } else {
      std::fprintf(stderr, "graph capture failed: %s\n", e.what_without_backtrace());
    }
    return -1.0;
  } catch (const std::exception& e) {
    if (error != nullptr) {
      *error = e.what();
    } else {
      std::fprintf(stderr, "graph capture failed: %s\n", e.what());
    }
    return -1.0;
  }
}

// One case timed both ways: eager (median_event_ms: events around one host call, so host
// and launch overhead count) and graph (median_graph_ms: GPU time alone), in that order.
struct Timing {
  double eager = 0, graph = 0;
};

inline Timing median_eager_and_graph_ms(const std::function<void()>& fn, int calls_per_graph,
                                        int warmup_calls, int warmup, int repeats) {
  return {median_event_ms(fn, warmup, repeats),
          median_graph_ms(fn, calls_per_graph, warmup_calls, warmup, repeats)};
}

// The bandwidth baseline of an op whose compulsory traffic is `bytes`: a device-to-device
// copy of bytes / 2 (bytes / 2 read, bytes / 2 written), as a callable to time on the
// current stream; it owns its buffers.
inline std::function<void()> device_copy(int64_t bytes) {
  const auto options = at::TensorOptions().device(at::kCUDA).dtype(at::kByte);
  const at::Tensor src = at::empty({bytes / 2}, options), dst = at::empty({bytes / 2}, options);
  return [src, dst] {
    cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), static_cast<size_t>(src.numel()),
                    cudaMemcpyDeviceToDevice, c10::cuda::getCurrentCUDAStream().stream());
  };
}

}  // namespace gdr::bench
