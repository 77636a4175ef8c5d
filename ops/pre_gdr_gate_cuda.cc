// CUDA implementation of the pre-GDR gate op: argument checks, stream, scratch from the
// caching allocator, tile selection and the two reduction modes (see
// Note [Tile selection] and kernels/pre_gdr_gate.cu). Registered for the CUDA dispatch
// key; linked into CUDA binaries only.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/pre_gdr_gate.h"
#include "ops/determinism.h"
#include "ops/pre_gdr_gate.h"
#include "ops/pre_gdr_gate_internal.h"

namespace gdr {
namespace {

using gate_internal::gate_shape;
using gate_internal::scalar_kind;
using gate_internal::strided_operand;

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == cudaSuccess, "pre_gdr_gate: ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

std::tuple<at::Tensor, at::Tensor> pre_gdr_gate_forward_cuda(const at::Tensor& a,
                                                             const at::Tensor& b,
                                                             const at::Tensor& A_log,
                                                             const at::Tensor& dt_bias) {
  gate_internal::check_forward_inputs(a, b, A_log, dt_bias);
  const c10::cuda::CUDAGuard device_guard(a.device());
  const at::Tensor A_log_c = A_log.contiguous();
  const at::Tensor dt_bias_c = dt_bias.contiguous();
  at::Tensor g = at::empty(a.sizes(), a.options().dtype(at::kFloat));
  at::Tensor beta = at::empty(a.sizes(), a.options().dtype(at::kFloat));
  kernels::GateForwardArgs args;
  args.shape = gate_shape(a);
  args.input_kind = scalar_kind(a);
  args.param_kind = scalar_kind(A_log);
  args.a = strided_operand(a);
  args.b = strided_operand(b);
  args.A_log = A_log_c.data_ptr();
  args.dt_bias = dt_bias_c.data_ptr();
  args.g = g.data_ptr<float>();
  args.beta = beta.data_ptr<float>();
  check_launch(
      kernels::launch_pre_gdr_gate_forward(args, c10::cuda::getCurrentCUDAStream().stream()),
      "forward");
  return {g, beta};
}

// Times one candidate tile of the atomic backward on `stream`: re-zeroes the accumulator
// before every launch (so no trial sees another's sums), one warm-up, median of 5.
double time_atomic_backward(const kernels::GateBackwardArgs& args, const kernels::GateTile& tile,
                            float* accumulator, cudaStream_t stream) {
  const size_t acc_bytes = 2 * args.shape.heads * sizeof(float);
  cudaEvent_t start, stop;
  cudaEventCreate(&start);
  cudaEventCreate(&stop);
  std::vector<float> samples;
  for (int rep = 0; rep < 6; ++rep) {
    cudaMemsetAsync(accumulator, 0, acc_bytes, stream);
    cudaEventRecord(start, stream);
    check_launch(kernels::launch_pre_gdr_gate_backward(args, tile, kernels::GateReduction::kAtomic,
                                                       accumulator, stream),
                 "autotune backward");
    cudaEventRecord(stop, stream);
    cudaEventSynchronize(stop);
    float ms = 0.0f;
    cudaEventElapsedTime(&ms, start, stop);
    if (rep > 0) samples.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

// One ticket counter per stream for the single-pass ordered reduction (Note
// [Single-pass ordered reduction]): launches on one stream are serialised, so they can
// share a counter, which every launch leaves at zero. Counters live for the process.
// nullptr when none exists yet and the stream is capturing a graph (no cudaMalloc then).
unsigned int* ticket_counter_for(cudaStream_t stream) {
  static std::mutex mutex;
  static std::unordered_map<cudaStream_t, unsigned int*> counters;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = counters.find(stream);
  if (it != counters.end()) return it->second;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaStreamIsCapturing(stream, &capture);
  if (capture != cudaStreamCaptureStatusNone) return nullptr;
  unsigned int* counter = nullptr;
  TORCH_CHECK(cudaMalloc(&counter, sizeof(unsigned int)) == cudaSuccess,
              "pre_gdr_gate: allocating the ticket counter failed");
  TORCH_CHECK(cudaMemsetAsync(counter, 0, sizeof(unsigned int), stream) == cudaSuccess,
              "pre_gdr_gate: zeroing the ticket counter failed");
  counters.emplace(stream, counter);
  return counter;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pre_gdr_gate_backward_cuda(
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& A_log, const at::Tensor& dt_bias) {
  gate_internal::check_backward_inputs(grad_g, grad_beta, a, b, A_log, dt_bias);
  const c10::cuda::CUDAGuard device_guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const at::Tensor A_log_c = A_log.contiguous();
  const at::Tensor dt_bias_c = dt_bias.contiguous();
  at::Tensor da = at::empty(a.sizes(), a.options());
  at::Tensor db = at::empty(b.sizes(), b.options());

  kernels::GateBackwardArgs args;
  args.shape = gate_shape(a);
  args.input_kind = scalar_kind(a);
  args.param_kind = scalar_kind(A_log);
  args.a = strided_operand(a);
  args.b = strided_operand(b);
  args.grad_g = strided_operand(grad_g);
  args.grad_beta = strided_operand(grad_beta);
  args.A_log = A_log_c.data_ptr();
  args.dt_bias = dt_bias_c.data_ptr();
  args.da = da.data_ptr();
  args.db = db.data_ptr();
  const int64_t heads = args.shape.heads;

  const bool ordered = use_deterministic_mode();
  const std::string dtype_key = std::string("in=") + c10::toString(a.scalar_type()) +
                                "|param=" + c10::toString(A_log.scalar_type()) + "|contiguous=" +
                                (a.is_contiguous() && b.is_contiguous() ? "1" : "0");
  at::Tensor accumulator;  // atomic mode only: FP32 [2, Hv]
  if (!ordered) accumulator = at::empty({2, heads}, a.options().dtype(at::kFloat));
  // Timing needs cudaEventSynchronize, which a capturing stream forbids: during graph
  // capture a cache miss takes the static rule instead (Note [Tile selection]).
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();  // do not let the query's error surface as a launch failure
    capture = cudaStreamCaptureStatusNone;
  }
  std::function<double(const kernels::GateTile&)> time_ms;
  if (capture == cudaStreamCaptureStatusNone) {
    time_ms = [&](const kernels::GateTile& tile) {
      return time_atomic_backward(args, tile, accumulator.data_ptr<float>(), stream);
    };
  }
  const TileSelection<kernels::GateTile> selection = select_pre_gdr_gate_tile(
      args.shape, dtype_key, a.get_device(), ordered, time_ms, static_cast<int>(a.element_size()));
  const kernels::GateBackwardLaunch launch =
      kernels::derive_gate_backward_launch(selection.config, args.shape);

  at::Tensor dA_log, ddt_bias;
  kernels::GateReduction reduction = kernels::GateReduction::kAtomic;
  if (ordered) {
    at::Tensor partials = at::empty({launch.scratch_floats}, a.options().dtype(at::kFloat));
    // One allocation for both per-head gradients (rows of a [2, Hv] tensor), as in the
    // atomic path: fewer allocator calls on a launch-bound path.
    at::Tensor param_grads = at::empty({2, heads}, A_log.options());
    dA_log = param_grads[0];
    ddt_bias = param_grads[1];
    const OrderedVariant variant = pre_gdr_gate_ordered_variant();
    unsigned int* ticket = nullptr;
    // Two pass by default: on the H200 the single pass's serial tail in one block cost
    // more than the second launch it saves (docs/benchmarks.md).
    if (variant == OrderedVariant::kSinglePass && heads <= kernels::kSinglePassMaxHeads) {
      ticket = ticket_counter_for(stream);
    }
    TORCH_CHECK(variant != OrderedVariant::kSinglePass || ticket != nullptr,
                "pre_gdr_gate: the single-pass ordered reduction was requested but needs Hv <= ",
                kernels::kSinglePassMaxHeads, " (got ", heads,
                ") and a ticket counter made outside graph capture");
    if (ticket != nullptr) {
      reduction = kernels::GateReduction::kOrderedSinglePass;
      args.dA_log = dA_log.data_ptr();
      args.ddt_bias = ddt_bias.data_ptr();
      args.ticket = ticket;
      check_launch(kernels::launch_pre_gdr_gate_backward(args, selection.config, reduction,
                                                         partials.data_ptr<float>(), stream),
                   "single-pass ordered backward");
    } else {
      reduction = kernels::GateReduction::kOrdered;
      check_launch(kernels::launch_pre_gdr_gate_backward(args, selection.config, reduction,
                                                         partials.data_ptr<float>(), stream),
                   "ordered backward");
      check_launch(kernels::launch_pre_gdr_gate_reduce_partials(
                       partials.data_ptr<float>(), launch.programs_t, heads, scalar_kind(A_log),
                       dA_log.data_ptr(), ddt_bias.data_ptr(), stream),
                   "ordered partial reduction");
    }
  } else {
    TORCH_CHECK(cudaMemsetAsync(accumulator.data_ptr(), 0, 2 * heads * sizeof(float), stream) ==
                    cudaSuccess,
                "pre_gdr_gate: zeroing the [2, Hv] accumulator failed");
    check_launch(kernels::launch_pre_gdr_gate_backward(args, selection.config,
                                                       kernels::GateReduction::kAtomic,
                                                       accumulator.data_ptr<float>(), stream),
                 "atomic backward");
    dA_log = accumulator[0].to(A_log.scalar_type());
    ddt_bias = accumulator[1].to(dt_bias.scalar_type());
  }
  PreGdrGateBackwardRecord record;
  record.ordered = ordered;
  record.reduction = reduction;
  record.tile = selection.config;
  record.source = selection.source;
  record.launch = launch;
  gate_internal::record_backward(record);
  return {da, db, dA_log, ddt_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("pre_gdr_gate", &pre_gdr_gate_forward_cuda);
  m.impl("pre_gdr_gate_backward", &pre_gdr_gate_backward_cuda);
}

}  // namespace gdr
