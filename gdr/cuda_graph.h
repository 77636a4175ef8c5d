// The hook through which gdr/cuda_graph_cuda.cc (linked only into CUDA binaries) lets the
// trainer (CPU-only libtorch) capture a microbatch's work into a CUDA graph, the same
// pattern as gdr/distributed_backend.h: CPU builds never need libtorch_cuda.
#pragma once

#include <functional>
#include <memory>

namespace gdr {

// Work captured once and replayed many times on the current CUDA stream.
class CapturedWork {
 public:
  virtual ~CapturedWork() = default;
  // Queues the captured kernels on the current stream of the capture's device; reads the
  // capture's input tensors and overwrites its output tensors (their addresses are fixed).
  virtual void replay() = 0;
};

// Runs `body` once under stream capture on a side stream of the current CUDA device and
// returns the graph. The body's kernels are recorded, not executed: replay() runs them.
// Tensors the body allocates come from the graph's private memory pool and keep their
// addresses across replays; hold a reference to each one read after a replay. Throws
// (c10::Error) when the body does something capture forbids (a host sync, a pageable copy).
using CudaGraphCapture = std::unique_ptr<CapturedWork> (*)(const std::function<void()>& body);

// Called once by a static initializer in gdr/cuda_graph_cuda.cc.
void register_cuda_graph_capture(CudaGraphCapture capture);

// Null when the binary does not link //gdr:cuda_graph_cuda.
CudaGraphCapture cuda_graph_capture();

}  // namespace gdr
