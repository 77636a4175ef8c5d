// Registers the CUDA graph capture of gdr/cuda_graph.h. Link //gdr:cuda_graph_cuda into
// CUDA binaries; it needs libtorch_cuda (at::cuda::CUDAGraph and its private memory pools).
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <optional>
#include <vector>

#include "gdr/cuda_graph.h"

namespace gdr {
namespace {

class CudaGraphWork final : public CapturedWork {
 public:
  ~CudaGraphWork() override {
    for (cudaEvent_t event : marks_) cudaEventDestroy(event);
  }

  void capture(const std::function<void(CapturedWork&)>& body) {
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
        body(*this);
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

  size_t mark() override {
    // The current stream of the calling thread: the body's, or, for a mark set in an
    // autograd hook, the backward node's, which is the capture stream too (the engine runs
    // a node on the stream its forward ran on).
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
    TORCH_CHECK(status == cudaStreamCaptureStatusActive,
                "CapturedWork::mark: expected to be called inside the capture body, on the "
                "capturing stream, but the current stream is not capturing");
    cudaEvent_t event = nullptr;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
    marks_.push_back(event);
    // External: the graph keeps the record as a node, and every replay records the event
    // when it passes that node (a plain record inside a capture only orders the capture).
    C10_CUDA_CHECK(cudaEventRecordWithFlags(event, stream, cudaEventRecordExternal));
    return marks_.size() - 1;
  }

  void on_side_stream_after(size_t index, const std::function<void()>& work) override {
    TORCH_CHECK(index < marks_.size(), "CapturedWork::on_side_stream_after: mark ", index,
                " does not exist; the capture set ", marks_.size(), " marks");
    if (!side_.has_value()) side_ = c10::cuda::getStreamFromPool();
    C10_CUDA_CHECK(cudaStreamWaitEvent(side_->stream(), marks_[index], 0));
    c10::cuda::CUDAStreamGuard on_side(*side_);
    work();
  }

  void join_side_stream() override {
    if (!side_.has_value()) return;
    at::cuda::CUDAEvent side_done;
    side_done.record(*side_);
    side_done.block(c10::cuda::getCurrentCUDAStream());
  }

 private:
  at::cuda::CUDAGraph graph_;
  std::vector<cudaEvent_t> marks_;
  std::optional<c10::cuda::CUDAStream> side_;
};

std::unique_ptr<CapturedWork> capture_cuda_graph(const std::function<void(CapturedWork&)>& body) {
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
