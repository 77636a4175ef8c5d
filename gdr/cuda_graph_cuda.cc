// Registers the CUDA graph capture of gdr/cuda_graph.h. Link //gdr:cuda_graph_cuda into
// CUDA binaries; it needs libtorch_cuda (at::cuda::CUDAGraph and its private memory pools).
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdlib>

#include "gdr/cuda_graph.h"

namespace gdr {
namespace {

class CudaGraphWork final : public CapturedWork {
 public:
  void capture(const std::function<void()>& body) {
    // Capture needs a stream other than the legacy default one; the side stream first
    // waits for everything already queued on the caller's stream (the body's inputs).
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream();
    const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    at::cuda::CUDAEvent inputs_ready;
    inputs_ready.record(caller);
    inputs_ready.block(side);
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      graph_.capture_begin();
      try {
        body();
      } catch (...) {
        // End the broken capture so the stream and the allocator leave capture mode; the
        // body's error is the one worth reporting.
        try {
          graph_.capture_end();
        } catch (...) {
        }
        throw;
      }
      graph_.capture_end();
    }
    at::cuda::CUDAEvent captured;
    captured.record(side);
    captured.block(caller);
  }

  void replay() override { graph_.replay(); }

 private:
  at::cuda::CUDAGraph graph_;
};

std::unique_ptr<CapturedWork> capture_cuda_graph(const std::function<void()>& body) {
  auto work = std::make_unique<CudaGraphWork>();
  work->capture(body);
  return work;
}

const bool registered = [] {
  register_cuda_graph_capture(&capture_cuda_graph);
  // Every CUDA trainer binary links this file, and static initialisation runs before the
  // first CUDA call, which is when the driver reads this: a launch queue 4x the default,
  // so an eager step's ~2,000 launches per microbatch do not stall the host on a full
  // queue (an explicit setting wins; Note [Microbatch graphs] in gdr/trainer.cc).
  setenv("CUDA_SCALE_LAUNCH_QUEUES", "4x", /*overwrite=*/0);
  return true;
}();

}  // namespace
}  // namespace gdr
