// Registers the NCCL backend for gdr::ProcessGroup (see gdr/distributed_backend.h). Link
// //gdr:distributed_nccl into CUDA binaries; it needs libtorch_cuda, which carries c10d's
// ProcessGroupNCCL and loads libnccl.
#define USE_C10D_NCCL 1
#include <c10/cuda/CUDAFunctions.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <cstdlib>

#include "gdr/distributed_backend.h"

namespace gdr {
namespace {

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int world_size, int local_rank,
                                                    std::chrono::milliseconds timeout) {
  const int devices = c10::cuda::device_count();
  TORCH_CHECK(local_rank < devices, "LOCAL_RANK ", local_rank, " needs CUDA device ", local_rank,
              " but this process sees ", devices, " device(s)");
  // Every tensor the trainer makes after this lands on the rank's own GPU (at::kCUDA with no
  // index means the current device).
  c10::cuda::set_device(static_cast<c10::DeviceIndex>(local_rank));
  // Blocking wait: Work::wait() holds the host until the collective ends and throws when it
  // exceeds the timeout, so a dead or hung peer surfaces as all_reduce_sum's error (one
  // clear line naming the step) instead of the watchdog aborting the process. Our step
  // synchronises on the losses anyway, so this costs nothing. An explicit setting wins.
  setenv("TORCH_NCCL_BLOCKING_WAIT", "1", /*overwrite=*/0);
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(
      c10::make_intrusive<c10d::PrefixStore>("nccl/", store), rank, world_size, options);
}

const bool registered = [] {
  register_nccl_backend_factory(&make_nccl_backend);
  return true;
}();

}  // namespace
}  // namespace gdr
