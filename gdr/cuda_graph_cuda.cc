// Registers the CUDA graph capture of gdr/cuda_graph.h. Link //gdr:cuda_graph_cuda into
// CUDA binaries; it needs libtorch_cuda (at::cuda::CUDAGraph and its private memory pools).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdlib>
#include <optional>
#include <vector>

#include "gdr/cuda_graph.h"

namespace gdr {
namespace {

// cuStreamWaitValue32 (driver API) through the runtime's entry-point lookup, so the binary
// needs no libcuda link of its own.
using WaitValue32 = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);
WaitValue32 wait_value32() {
  static const WaitValue32 fn = [] {
    void* entry = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuStreamWaitValue32", &entry, 12000,
                                                    cudaEnableDefault, &found));
    TORCH_CHECK(found == cudaDriverEntryPointSuccess && entry != nullptr,
                "CapturedWork: the CUDA driver has no cuStreamWaitValue32 (needed for graph "
                "marks)");
    return reinterpret_cast<WaitValue32>(entry);
  }();
  return fn;
}

// Note [Graph marks] implementation: a mark is a 4-byte flag the graph sets with a memset
// node (every byte 1) when it passes the mark; a side stream waits for it with
// cuStreamWaitValue32, a wait the GPU's front end does without any kernel. Every replay
// first clears the flags on the replaying stream, and the side stream waits for that clear
// before its first flag wait after the replay, so a flag set by an earlier replay never
// lets it through. External event nodes (cudaEventRecordExternal) instead, ~300 of them in
// the microbatch graph, make the 0.8B step much slower (measured: docs/benchmarks.md,
// Decisions).
constexpr int64_t kMaxMarks = 4096;
constexpr cuuint32_t kMarkSet = 0x01010101;

class CudaGraphWork final : public CapturedWork {
 public:
  void capture(const std::function<void(CapturedWork&)>& body,
               const CudaGraphWork* share_memory_with) {
    // Capture needs a stream other than the legacy default one; the side stream first
    // waits for everything already queued on the caller's stream (the body's inputs).
    const c10::cuda::CUDAStream caller = c10::cuda::getCurrentCUDAStream();
    flags_ = at::zeros({kMaxMarks}, at::TensorOptions().device(at::kCUDA).dtype(at::kInt));
    // Captures sharing a pool capture on one stream: the caching allocator hands a freed
    // block only to allocations on the stream it was freed on, so a capture on another
    // stream would take new memory instead of the earlier capture's temporaries.
    if (share_memory_with != nullptr) {
      capture_stream_ = share_memory_with->capture_stream_;
    } else {
      capture_stream_ = c10::cuda::getStreamFromPool();
    }
    const c10::cuda::CUDAStream side = *capture_stream_;
    at::cuda::CUDAEvent inputs_ready;
    inputs_ready.record(caller);
    inputs_ready.block(side);
    {
      c10::cuda::CUDAStreamGuard on_side(side);
      // {0, 0} asks CUDAGraph for a new private pool.
      graph_.capture_begin(share_memory_with != nullptr ? share_memory_with->pool_
                                                        : at::cuda::MempoolId_t{0, 0});
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
      pool_ = graph_.pool();  // CUDAGraph gives it out only once the capture has ended
    }
    at::cuda::CUDAEvent captured;
    captured.record(side);
    captured.block(caller);
  }

  void replay() override {
    TORCH_CHECK(!side_unjoined_,
                "CapturedWork::replay: join_side_stream() first; the side "
                "stream may still be waiting for the previous replay's marks");
    if (marks_ > 0) {
      const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream();
      C10_CUDA_CHECK(cudaMemsetAsync(flags_.data_ptr<int32_t>(), 0, marks_ * sizeof(int32_t),
                                     stream.stream()));
      flags_cleared_.record(stream);
      side_waits_for_clear_ = true;
    }
    graph_.replay();
  }

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
    TORCH_CHECK(marks_ < static_cast<size_t>(kMaxMarks), "CapturedWork::mark: at most ", kMaxMarks,
                " marks per capture");
    C10_CUDA_CHECK(
        cudaMemsetAsync(flags_.data_ptr<int32_t>() + marks_, 1, sizeof(int32_t), stream));
    return marks_++;
  }

  void on_side_stream_after(size_t index, const std::function<void()>& work) override {
    TORCH_CHECK(index < marks_, "CapturedWork::on_side_stream_after: mark ", index,
                " does not exist; the capture set ", marks_, " marks");
    if (!side_.has_value()) side_ = c10::cuda::getStreamFromPool();
    if (side_waits_for_clear_) {
      flags_cleared_.block(*side_);
      side_waits_for_clear_ = false;
    }
    const auto flag = reinterpret_cast<CUdeviceptr>(flags_.data_ptr<int32_t>() + index);
    const CUresult waited =
        wait_value32()(side_->stream(), flag, kMarkSet, CU_STREAM_WAIT_VALUE_EQ);
    TORCH_CHECK(waited == CUDA_SUCCESS,
                "CapturedWork::on_side_stream_after: cuStreamWaitValue32 "
                "failed with CUresult ",
                static_cast<int>(waited));
    side_unjoined_ = true;
    c10::cuda::CUDAStreamGuard on_side(*side_);
    work();
  }

  void join_side_stream() override {
    if (!side_.has_value()) return;
    at::cuda::CUDAEvent side_done;
    side_done.record(*side_);
    side_done.block(c10::cuda::getCurrentCUDAStream());
    side_unjoined_ = false;
  }

 private:
  at::cuda::CUDAGraph graph_;
  at::cuda::MempoolId_t pool_{0, 0};  // graph_'s memory pool, for later captures to share
  std::optional<c10::cuda::CUDAStream> capture_stream_;  // the stream it was captured on
  at::Tensor flags_;                                     // int32 [kMaxMarks]: flag i is mark i's
  size_t marks_ = 0;
  at::cuda::CUDAEvent flags_cleared_;
  bool side_waits_for_clear_ = false;
  bool side_unjoined_ = false;  // work was queued on the side stream since the last join
  std::optional<c10::cuda::CUDAStream> side_;
};

std::unique_ptr<CapturedWork> capture_cuda_graph(const std::function<void(CapturedWork&)>& body,
                                                 const CapturedWork* share_memory_with) {
  // Every CapturedWork in a CUDA binary is a CudaGraphWork (this file registers the only
  // capture), so the downcast cannot pick another type.
  auto work = std::make_unique<CudaGraphWork>();
  work->capture(body, static_cast<const CudaGraphWork*>(share_memory_with));
  return work;
}

const bool registered = [] {
  register_cuda_graph_capture(&capture_cuda_graph);
  // Every CUDA trainer binary links this file, and static initialisation runs before the
  // first CUDA call, which is when the driver reads this: a launch queue 4x the default,
  // so an eager step's ~2,000 launches per microbatch do not stall the host on a full
  // queue (an explicit setting wins; Note [Microbatch graphs] in gdr/microbatch_graphs.h).
  setenv("CUDA_SCALE_LAUNCH_QUEUES", "4x", /*overwrite=*/0);
  return true;
}();

}  // namespace
}  // namespace gdr
