// The hook through which gdr/distributed_nccl.cc (linked only into CUDA binaries) gives
// gdr/distributed.cc (CPU-only libtorch) a NCCL process group, so CPU builds never need
// libtorch_cuda or NCCL.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>

namespace gdr {

// Binds this process to CUDA device `local_rank` and returns a NCCL backend over `store`
// whose collectives give up after `timeout`. Throws (c10::Error) on failure.
using NcclBackendFactory = c10::intrusive_ptr<c10d::Backend> (*)(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int world_size, int local_rank,
    std::chrono::milliseconds timeout);

// Called once by a static initializer in gdr/distributed_nccl.cc; null until then.
void register_nccl_backend_factory(NcclBackendFactory factory);

}  // namespace gdr
