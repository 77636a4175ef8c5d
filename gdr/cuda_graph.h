// The hook through which gdr/cuda_graph_cuda.cc (linked only into CUDA binaries) lets the
// trainer (CPU-only libtorch) capture a microbatch's work into a CUDA graph, the same
// pattern as gdr/distributed_backend.h: CPU builds never need libtorch_cuda.
#pragma once

#include <cstddef>
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

  // Note [Graph marks]: a mark is a point inside the captured work (everything the body
  // had queued when it called mark()) that other work can wait for without waiting for
  // the whole replay: the trainer starts adding up a parameter's gradient while the
  // replayed backward is still producing the gradients of earlier layers. A mark is a flag
  // the graph itself sets (a memset node) and the side stream waits for on the GPU, so it
  // costs a replay no host work (implementation: gdr/cuda_graph_cuda.cc).
  //
  // Inside the capture body only: marks the current point; returns the mark's index
  // (0, 1, 2, ... in call order). Throws (c10::Error) outside a capture.
  virtual size_t mark() = 0;
  // After replay(): runs `work` with a side stream of the capture's device as the current
  // stream; the side stream first waits for mark `index` of the latest replay. Successive
  // calls share the side stream, so their work runs in call order. Tensors the work
  // allocates must not outlive it unless the caller joins (below) before using them.
  // Join before the next replay() (it throws otherwise): the replay clears the flags.
  virtual void on_side_stream_after(size_t index, const std::function<void()>& work) = 0;
  // The current stream waits for everything queued on the side stream so far.
  virtual void join_side_stream() = 0;
};

// Runs `body` once under stream capture on a side stream of the current CUDA device and
// returns the graph. The body's kernels are recorded, not executed: replay() runs them.
// The body gets the work being captured, for mark(). Tensors the body allocates come from
// the graph's private memory pool and keep their addresses across replays; hold a
// reference to each one read after a replay. Throws (c10::Error) when the body does
// something capture forbids (a host sync, a pageable copy).
//
// `share_memory_with` (null: a pool of its own) names an earlier capture whose memory
// pool this one allocates from, on the same capture stream: the memory the earlier body
// freed (its temporaries) is reused, while the tensors it still holds keep theirs. The
// price: a tensor this capture holds on to (an output) may lie in memory the earlier
// graph uses for temporaries, so replaying the earlier graph overwrites it. Graphs sharing
// a pool must replay in the order they were captured, never concurrently, and a later
// graph's outputs must be read before an earlier graph replays again (PyTorch's rule for
// shared graph pools). The trainer's per-position microbatch graphs (Note [Microbatch
// graphs] in gdr/microbatch_graphs.h) share one pool so that one microbatch's activations
// take memory.
using CudaGraphCapture = std::unique_ptr<CapturedWork> (*)(
    const std::function<void(CapturedWork&)>& body, const CapturedWork* share_memory_with);

// Called once by a static initializer in gdr/cuda_graph_cuda.cc.
void register_cuda_graph_capture(CudaGraphCapture capture);

// Null when the binary does not link //gdr:cuda_graph_cuda.
CudaGraphCapture cuda_graph_capture();

}  // namespace gdr
