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
  TORCH_CHECK(error == cudaSuccess, "pre_gdr_gate: ", what, " launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(error)));
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
  check_launch(kernels::launch_pre_gdr_gate_forward(args, c10::cuda::getCurrentCUDAStream().stream()),
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

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pre_gdr_gate_backward_cuda(
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& a,
    const at::Tensor& b, const at::Tensor& A_log, const at::Tensor& dt_bias) {
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
                                "|param=" + c10::toString(A_log.scalar_type()) +
                                "|contiguous=" + (a.is_contiguous() && b.is_contiguous() ? "1" : "0");
  at::Tensor accumulator;  // atomic mode only: FP32 [2, Hv]
  if (!ordered) accumulator = at::empty({2, heads}, a.options().dtype(at::kFloat));
  const TileSelection<kernels::GateTile> selection = select_pre_gdr_gate_tile(
      args.shape, dtype_key, a.get_device(), ordered, [&](const kernels::GateTile& tile) {
        return time_atomic_backward(args, tile, accumulator.data_ptr<float>(), stream);
      });
  const kernels::GateBackwardLaunch launch =
      kernels::derive_gate_backward_launch(selection.config, args.shape);

  at::Tensor dA_log, ddt_bias;
  if (ordered) {
    at::Tensor partials = at::empty({launch.scratch_floats}, a.options().dtype(at::kFloat));
    check_launch(kernels::launch_pre_gdr_gate_backward(args, selection.config,
                                                       kernels::GateReduction::kOrdered,
                                                       partials.data_ptr<float>(), stream),
                 "ordered backward");
    dA_log = at::empty({heads}, A_log.options());
    ddt_bias = at::empty({heads}, dt_bias.options());
    check_launch(kernels::launch_pre_gdr_gate_reduce_partials(
                     partials.data_ptr<float>(), launch.programs_t, heads, scalar_kind(A_log),
                     dA_log.data_ptr(), ddt_bias.data_ptr(), stream),
                 "ordered partial reduction");
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
