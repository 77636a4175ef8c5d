#include "gdr/cuda_graph.h"

#include <atomic>

namespace gdr {
namespace {
std::atomic<CudaGraphCapture> registered_capture{nullptr};
}  // namespace

void register_cuda_graph_capture(CudaGraphCapture capture) { registered_capture.store(capture); }

CudaGraphCapture cuda_graph_capture() { return registered_capture.load(); }

}  // namespace gdr
