// CUDA implementation of the pre-GDR gate op: argument checks, stream, scratch from the
// caching allocator, tile selection and the two reduction modes (see
// Note [Tile selection] and kernels/pre_gdr_gate/pre_gdr_gate.cu). Registered for the CUDA dispatch
// key; linked into CUDA binaries only.
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <functional>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "kernels/pre_gdr_gate/pre_gdr_gate.h"
#include "ops/policy/determinism.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_internal.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"

namespace gdr {
namespace {

using gate_internal::gate_shape;
using gate_internal::scalar_kind;
using gate_internal::strided_operand;

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == cudaSuccess, "pre_gdr_gate: ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

// Note [Gate host path]: at the 0.8B shape the GPU work of a call is a few microseconds and
// the host work around it (dispatcher, allocations, views, launches) is several times more
// (measured: docs/benchmarks.md, Pre-GDR gate), which is what eager timings and the
// autograd engine see. So each call makes one allocation for its large outputs (plus
// scratch) and carves the tensors out of it without the dispatcher, returns per-head
// gradients written by a kernel in the parameter dtype (no select views, no casts), and
// takes its tile from a per-shape cache (Note [Gate per-shape tile cache]).
constexpr int64_t kCarveAlign = 256;  // bytes; keeps every carved tensor 16-byte aligned

int64_t align_up(int64_t bytes) { return (bytes + kCarveAlign - 1) / kCarveAlign * kCarveAlign; }

// One uninitialised byte buffer on a's device from the caching allocator.
at::Tensor allocate_bytes(int64_t bytes, const at::Tensor& like) {
  return at::detail::empty_cuda({bytes}, at::kByte, like.device(), std::nullopt);
}

// A contiguous tensor of `sizes` x `dtype` at `byte_offset` of `block`'s storage, made
// without the dispatcher (a TensorImpl on the shared storage, as at::from_blob would, but
// keeping the allocation alive). The tensors carved from one block do not overlap.
at::Tensor carve(const at::Tensor& block, int64_t byte_offset, at::IntArrayRef sizes,
                 at::ScalarType dtype) {
  const caffe2::TypeMeta meta = c10::scalarTypeToTypeMeta(dtype);
  auto impl =
      c10::make_intrusive<c10::TensorImpl>(c10::Storage(block.storage()), block.key_set(), meta);
  impl->set_storage_offset(byte_offset / static_cast<int64_t>(meta.itemsize()));
  impl->set_sizes_contiguous(sizes);
  return at::Tensor(std::move(impl));
}

std::tuple<at::Tensor, at::Tensor> pre_gdr_gate_forward_cuda(const at::Tensor& a,
                                                             const at::Tensor& b,
                                                             const at::Tensor& A_log,
                                                             const at::Tensor& dt_bias) {
  gate_internal::check_forward_inputs(a, b, A_log, dt_bias);
  const c10::cuda::CUDAGuard device_guard(a.device());
  const at::Tensor A_log_c = A_log.contiguous();
  const at::Tensor dt_bias_c = dt_bias.contiguous();
  // g and beta: one allocation (Note [Gate host path]).
  const int64_t out_bytes = align_up(a.numel() * int64_t{sizeof(float)});
  const at::Tensor block = allocate_bytes(2 * out_bytes, a);
  at::Tensor g = carve(block, 0, a.sizes(), at::kFloat);
  at::Tensor beta = carve(block, out_bytes, a.sizes(), at::kFloat);
  kernels::GateForwardArgs args;
  args.shape = gate_shape(a);
  args.input_kind = scalar_kind(a);
  args.param_kind = scalar_kind(A_log);
  args.a = strided_operand(a);
  args.b = strided_operand(b);
  args.A_log = A_log_c.data_ptr();
  args.dt_bias = dt_bias_c.data_ptr();
  args.g = static_cast<float*>(g.data_ptr());
  args.beta = static_cast<float*>(beta.data_ptr());
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

// Ticket counter slots of the single-pass ordered reduction (Note [Single-pass ordered
// reduction] in kernels/pre_gdr_gate/pre_gdr_gate.cu): one per (device, stream) for eager launches,
// which a stream runs one after another, and a fresh one for every launch captured into
// a graph, which keeps it for good: a graph may be replayed on any stream, concurrently
// with eager work on the stream it was captured from. -1 when the slots are used up; the
// caller then takes the two-pass variant, which gives the same bits.
int ticket_slot_for(cudaStream_t stream, int device, bool capturing) {
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, int> eager_slots;
  static int next_slot = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (!capturing) {
    auto it = eager_slots.find({device, stream});
    if (it != eager_slots.end()) return it->second;
  }
  if (next_slot >= kernels::kGateTicketSlots) return -1;
  const int slot = next_slot++;
  if (!capturing) eager_slots.emplace(std::make_pair(device, stream), slot);
  return slot;
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    (void)cudaGetLastError();  // do not let the query's error surface as a launch failure
    return false;
  }
  return capture != cudaStreamCaptureStatusNone;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pre_gdr_gate_backward_cuda(
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& A_log, const at::Tensor& dt_bias) {
  gate_internal::check_backward_inputs(grad_g, grad_beta, a, b, A_log, dt_bias);
  const c10::cuda::CUDAGuard device_guard(a.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const at::Tensor A_log_c = A_log.contiguous();
  const at::Tensor dt_bias_c = dt_bias.contiguous();

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
  const int64_t heads = args.shape.heads;

  // Read at every call: flipping the mode between calls switches paths.
  const bool ordered = use_deterministic_mode();
  GateSelectionKey key;
  key.shape = args.shape;
  key.input_dtype = static_cast<int>(a.scalar_type());
  key.param_dtype = static_cast<int>(A_log.scalar_type());
  key.contiguous = a.is_contiguous() && b.is_contiguous();
  key.device_index = a.get_device();
  key.input_element_bytes = static_cast<int>(a.element_size());
  // Only on a cache miss in default mode: the timing trials need a zeroed accumulator of
  // their own, and timing needs cudaEventSynchronize, which a capturing stream forbids
  // (then the static rule answers, uncached: Note [Tile selection]).
  at::Tensor trial_accumulator, trial_da, trial_db;
  auto make_timer = [&]() -> std::function<double(const kernels::GateTile&)> {
    if (stream_is_capturing(stream)) return nullptr;
    trial_accumulator = at::empty({2, heads}, a.options().dtype(at::kFloat));
    trial_da = at::empty(a.sizes(), a.options());
    trial_db = at::empty(b.sizes(), b.options());
    return [&](const kernels::GateTile& tile) {
      kernels::GateBackwardArgs trial = args;
      trial.da = trial_da.data_ptr();
      trial.db = trial_db.data_ptr();
      return time_atomic_backward(trial, tile, trial_accumulator.data_ptr<float>(), stream);
    };
  };
  auto dtype_key = [&] {
    return std::string("in=") + c10::toString(a.scalar_type()) +
           "|param=" + c10::toString(A_log.scalar_type()) +
           "|contiguous=" + (key.contiguous ? "1" : "0");
  };
  const TileSelection<kernels::GateTile> selection =
      select_pre_gdr_gate_tile_cached(key, ordered, dtype_key, make_timer);
  const kernels::GateBackwardLaunch launch =
      kernels::derive_gate_backward_launch(selection.config, args.shape);

  // One allocation for da, db and the FP32 scratch (partial rows, or the atomic
  // accumulator when it is not the output itself), one for the two per-head gradients
  // in the parameter dtype, which autograd may keep as .grad (so they must not hold the
  // large block alive). See Note [Gate host path].
  const bool fp32_params = A_log.scalar_type() == at::kFloat;
  const int64_t scratch_floats = ordered ? launch.scratch_floats : (fp32_params ? 0 : 2 * heads);
  const int64_t da_bytes = align_up(a.numel() * static_cast<int64_t>(a.element_size()));
  const int64_t db_bytes = align_up(b.numel() * static_cast<int64_t>(b.element_size()));
  const at::Tensor block =
      allocate_bytes(da_bytes + db_bytes + scratch_floats * int64_t{sizeof(float)}, a);
  at::Tensor da = carve(block, 0, a.sizes(), a.scalar_type());
  at::Tensor db = carve(block, da_bytes, b.sizes(), b.scalar_type());
  float* scratch =
      reinterpret_cast<float*>(static_cast<char*>(block.data_ptr()) + da_bytes + db_bytes);
  // [2, Hv] in the parameter dtype: dA_log then ddt_bias (the atomic kernel's accumulator
  // layout, so FP32 parameters take the atomics directly).
  const int64_t param_bytes = heads * static_cast<int64_t>(A_log.element_size());
  const at::Tensor param_block = allocate_bytes(2 * param_bytes, A_log);
  at::Tensor dA_log = carve(param_block, 0, {heads}, A_log.scalar_type());
  at::Tensor ddt_bias = carve(param_block, param_bytes, {heads}, A_log.scalar_type());
  args.da = da.data_ptr();
  args.db = db.data_ptr();

  kernels::GateReduction reduction = kernels::GateReduction::kAtomic;
  if (ordered) {
    // Both variants give the same bits (Note [Single-pass ordered reduction]); kAuto takes
    // the single pass for eager calls at small, launch-bound shapes and two pass elsewhere,
    // graph capture included (kernels::gate_single_pass_preferred).
    const GateOrderedVariant variant = current_execution_policy().gate_ordered;
    int ticket_slot = -1;
    // The capture query (a CUDA call) only where the answer matters.
    const bool eager_candidate =
        variant == GateOrderedVariant::kAuto &&
        kernels::gate_single_pass_preferred(selection.config, launch, args.shape,
                                            /*capturing=*/false);
    const bool capturing = (variant == GateOrderedVariant::kSinglePass || eager_candidate) &&
                           stream_is_capturing(stream);
    const bool wanted =
        variant == GateOrderedVariant::kSinglePass || (eager_candidate && !capturing);
    const std::string unsupported =
        wanted ? kernels::gate_single_pass_unsupported_reason(selection.config, launch) : "";
    TORCH_CHECK(variant != GateOrderedVariant::kSinglePass || unsupported.empty(),
                "pre_gdr_gate: the single-pass ordered reduction was requested but it ",
                unsupported);
    if (wanted && unsupported.empty()) {
      ticket_slot = ticket_slot_for(stream, a.get_device(), capturing);
    }
    TORCH_CHECK(
        variant != GateOrderedVariant::kSinglePass || ticket_slot >= 0,
        "pre_gdr_gate: the single-pass ordered reduction was requested but all ",
        kernels::kGateTicketSlots,
        " ticket slots of this process are taken (each CUDA graph capture of it keeps one)");
    if (ticket_slot >= 0) {
      reduction = kernels::GateReduction::kOrderedSinglePass;
      args.dA_log = dA_log.data_ptr();
      args.ddt_bias = ddt_bias.data_ptr();
      args.ticket_slot = ticket_slot;
      check_launch(
          kernels::launch_pre_gdr_gate_backward(args, selection.config, reduction, scratch, stream),
          "single-pass ordered backward");
    } else {
      reduction = kernels::GateReduction::kOrdered;
      check_launch(
          kernels::launch_pre_gdr_gate_backward(args, selection.config, reduction, scratch, stream),
          "ordered backward");
      check_launch(kernels::launch_pre_gdr_gate_reduce_partials(scratch, launch.programs_t, heads,
                                                                args.param_kind, dA_log.data_ptr(),
                                                                ddt_bias.data_ptr(), stream),
                   "ordered partial reduction");
    }
  } else {
    // FP32 parameters: the atomics add straight into the outputs; otherwise into the FP32
    // scratch, converted by the ordered pass over that one row (no cast ops).
    float* accumulator = fp32_params ? static_cast<float*>(param_block.data_ptr()) : scratch;
    TORCH_CHECK(cudaMemsetAsync(accumulator, 0, 2 * heads * sizeof(float), stream) == cudaSuccess,
                "pre_gdr_gate: zeroing the [2, Hv] accumulator failed");
    check_launch(kernels::launch_pre_gdr_gate_backward(
                     args, selection.config, kernels::GateReduction::kAtomic, accumulator, stream),
                 "atomic backward");
    if (!fp32_params) {
      check_launch(kernels::launch_pre_gdr_gate_reduce_partials(accumulator, 1, heads,
                                                                args.param_kind, dA_log.data_ptr(),
                                                                ddt_bias.data_ptr(), stream),
                   "accumulator conversion");
    }
  }
  PreGdrGateBackwardRecord record;
  record.ordered = ordered;
  record.reduction = reduction;
  record.tile = selection.config;
  record.source = selection.source;
  record.launch = launch;
  record.vectorised = kernels::pre_gdr_gate_backward_is_vectorised(args, selection.config);
  gate_internal::record_backward(record);
  return {da, db, dA_log, ddt_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("pre_gdr_gate", &pre_gdr_gate_forward_cuda);
  m.impl("pre_gdr_gate_backward", &pre_gdr_gate_backward_cuda);
}

}  // namespace gdr
