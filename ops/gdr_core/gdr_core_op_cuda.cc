// CUDA implementations of the chunk state pass op (ops/gdr_core/chunk_state_op.h) and of the
// chunk prep op (ops/gdr_core/chunk_prep_op.h, kernels/gdr_core/chunk_prep.cu, below).
// The chunk state pass op (ops/gdr_core/chunk_state_op.h): the
// scan-based implementation (chunk_state_internal::forward_via_scan / backward_via_scan
// in ops/gdr_core/chunk_state_op.cc) with the scan kernel (kernels/gdr_core/chunk_state.cu)
// launched on the current stream. The sequential chunk walk is one kernel launch each way;
// everything that does not depend on the carry (O, P^T dO, Qd^T dO, dW, dQd, dP, dKend)
// is a handful of batched GEMMs over all (batch, head, chunk), on the 3xTF32 tensor-core
// GEMM kernel (kernels/gdr_core/chunk_gemm.cu, on wgmma where the GPU code has it unless the
// policy's chunk_gemm_wgmma is false; chunk_gemm_tensor_cores false: cuBLAS FP32 through
// at::bmm), and dGlast one ATen sum of the backward scan's per-thread partials. No
// atomics anywhere: the kernels' sums are per-thread or per-warp in fixed order (Note
// [Chunk state scan determinism], Note [Chunk GEMM determinism]) and the cuBLAS products
// and the dGlast sum are ATen's deterministic ops. Registered for the CUDA dispatch key;
// linked into CUDA binaries only.
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string_view>

#include "kernels/gdr_core/chunk_gemm.h"
#include "kernels/gdr_core/chunk_layout.h"
#include "kernels/gdr_core/chunk_prep.h"
#include "kernels/gdr_core/chunk_state.h"
#include "ops/gdr_core/chunk_prep_op.h"
#include "ops/gdr_core/chunk_state_op.h"
#include "ops/gdr_core/gdr_core_op.h"
#include "ops/policy/execution_policy.h"

namespace gdr {
namespace {

void check_launch(int error, const char* what) {
  TORCH_CHECK(error == cudaSuccess, "chunk_state_pass: ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

// The kernel variants are the execution policy's choices (ops/policy/execution_policy.h),
// read when an op call starts; a captured CUDA graph keeps the kernels it captured.
bool scan_tensor_cores_allowed() { return current_execution_policy().chunk_scan_tensor_cores; }

// The scan on the current stream of the inputs' device, launch errors raised here.
void launch_on_current_stream(const kernels::ChunkStateScanArgs& args, const char* what) {
  kernels::ChunkStateScanArgs chosen = args;
  chosen.allow_tensor_cores = args.allow_tensor_cores && scan_tensor_cores_allowed();
  check_launch(kernels::launch_chunk_state_scan(chosen, c10::cuda::getCurrentCUDAStream().stream()),
               what);
}

// The GEMM launcher for the state pass (empty: at::bmm), launching on the current stream
// and raising launch errors. Shapes kernels::chunk_gemm_supports refuses (none that the
// scan accepts, short of a batch over 2^31 - 1 blocks) stay on at::bmm
// (chunk_state_internal::gemm_product in ops/gdr_core/chunk_state_op.cc).
// The policy's chunk_gemm_tensor_cores picks the 3xTF32 GEMM kernel (kernels/gdr_core/chunk_gemm.h)
// or at::bmm (cuBLAS FP32: an empty launcher); chunk_gemm_wgmma lets that kernel run on
// wgmma where the GPU code has it (sm_90a: H100 / H200; Note [Chunk GEMM on wgmma] in
// kernels/gdr_core/chunk_gemm_kernel.cuh), or keeps it on mma.sync (the path of the other
// targets: other bits, same accuracy).
chunk_state_internal::ChunkGemmLauncher gemm_launcher(const char* what) {
  const ExecutionPolicy& policy = current_execution_policy();
  if (!policy.chunk_gemm_tensor_cores) return {};
  const bool wgmma = policy.chunk_gemm_wgmma;
  return [what, wgmma](const kernels::ChunkGemmArgs& args) {
    kernels::ChunkGemmArgs chosen = args;
    chosen.allow_wgmma = args.allow_wgmma && wgmma;
    check_launch(kernels::launch_chunk_gemm(chosen, c10::cuda::getCurrentCUDAStream().stream()),
                 what);
  };
}

// The policy's chunk_gemm_overlap runs the backward's dQd and dP GEMMs on a side stream
// beside the reverse scan (Note [State pass side stream] in ops/gdr_core/chunk_state_op.h), or
// after it on the current stream. Only with the tensor-core GEMM: the cuBLAS fallback always runs
// in line.
bool gemm_overlap_allowed() { return current_execution_policy().chunk_gemm_overlap; }

// The side stream of this host thread on `device`: created on first use (non-blocking, so
// it never waits for the legacy default stream) and kept for the thread's life, then
// left to the driver (destroying it at thread exit could race the CUDA context's
// teardown). Not a pool stream: c10's pool hands the same 32 streams round-robin to every
// caller, so a pool stream could be the stream the caller is launching on, or capturing
// on, or one another thread is capturing on.
c10::cuda::CUDAStream side_stream_of_thread(c10::DeviceIndex device) {
  constexpr int kMaxDevices = 64;
  thread_local std::array<cudaStream_t, kMaxDevices> streams{};
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "chunk_state_pass: side stream for device ",
              static_cast<int>(device), " requested; expected a device index in [0, ", kMaxDevices,
              ")");
  cudaStream_t& stream = streams[device];
  if (stream == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    check_launch(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "side stream");
  }
  return c10::cuda::getStreamFromExternal(stream, device);
}

// Note [State pass side stream] on CUDA: fork records an event on the current stream that
// the side stream waits for, run launches with the side stream current, join records an
// event on the side stream that the current stream waits for. Event records and waits
// are legal during stream capture, where they make the side stream part of the capture
// (fork) and bring it back before the capture ends (join): a captured backward is a
// graph with the two GEMMs on a parallel branch.
class CudaSideStream final : public chunk_state_internal::SideStream {
 public:
  explicit CudaSideStream(c10::DeviceIndex device)
      : main_(c10::cuda::getCurrentCUDAStream(device)), side_(side_stream_of_thread(device)) {}
  void fork() override {
    forked_.record(main_);
    forked_.block(side_);
  }
  void run(const std::function<void()>& work) override {
    const c10::cuda::CUDAStreamGuard guard(side_);
    work();
  }
  void join() override {
    done_.record(side_);
    done_.block(main_);
  }

 private:
  c10::cuda::CUDAStream main_;
  c10::cuda::CUDAStream side_;
  at::cuda::CUDAEvent forked_;
  at::cuda::CUDAEvent done_;
};

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_state_forward_cuda(
    const at::Tensor& u, const at::Tensor& w, const at::Tensor& qd, const at::Tensor& p,
    const at::Tensor& kend, const at::Tensor& g_last,
    const std::optional<at::Tensor>& initial_state) {
  const c10::cuda::CUDAGuard device_guard(u.device());
  return chunk_state_internal::forward_via_scan(
      u, w, qd, p, kend, g_last, initial_state,
      [](const kernels::ChunkStateScanArgs& args) {
        launch_on_current_stream(args, "forward scan");
      },
      gemm_launcher("forward GEMM"));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_state_backward_cuda(const std::optional<at::Tensor>& grad_o,
                          const std::optional<at::Tensor>& grad_final_state, const at::Tensor& w,
                          const at::Tensor& qd, const at::Tensor& p, const at::Tensor& kend,
                          const at::Tensor& g_last, const at::Tensor& states,
                          const at::Tensor& v_new) {
  const c10::cuda::CUDAGuard device_guard(w.device());
  const chunk_state_internal::ChunkGemmLauncher gemm = gemm_launcher("backward GEMM");
  std::optional<CudaSideStream> side;
  if (gemm && gemm_overlap_allowed()) side.emplace(w.device().index());
  return chunk_state_internal::backward_via_scan(
      grad_o, grad_final_state, w, qd, p, kend, g_last, states, v_new,
      [](const kernels::ChunkStateScanArgs& args) {
        launch_on_current_stream(args, "backward scan");
      },
      gemm, side.has_value() ? &*side : nullptr);
}

// The chunk prep (steps 1-6): one kernel each way on the current stream; everything else
// in chunk_prep_internal::forward_via_kernel / backward_via_kernel is allocation and
// layout checks (plus casts for Half inputs only: BF16 is read and written in-kernel),
// and, when several value heads share a key head, the ordered sum of the dq / dk partials
// (Note [Head group gradient sum] in ops/gdr_core/chunk_prep_op.cc).
void check_prep_launch(int error, const char* what) {
  TORCH_CHECK(error == cudaSuccess, "chunk_prep: ", what,
              " launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

// The policy's chunk_prep_tensor_cores: the chunk prep backward's dM and dK / dQ products
// on tensor cores (chunk_prep_uses_tensor_cores in kernels/gdr_core/chunk_prep.h; Note [Chunk prep
// on tensor cores]), the default as the faster variant (docs/benchmarks.md), or FP32 SIMT.
bool prep_tensor_cores_allowed() { return current_execution_policy().chunk_prep_tensor_cores; }

template <typename Args>
Args with_prep_variant(const Args& args) {
  Args chosen = args;
  chosen.shape.allow_tensor_cores = args.shape.allow_tensor_cores && prep_tensor_cores_allowed();
  return chosen;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
chunk_prep_forward_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& g, const at::Tensor& beta, double scale,
                        int64_t chunk_size, bool l2_normalize_qk) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  return chunk_prep_internal::forward_via_kernel(
      q, k, v, g, beta, scale, chunk_size, l2_normalize_qk,
      [](const kernels::ChunkPrepForwardArgs& args) {
        check_prep_launch(kernels::launch_chunk_prep_forward(
                              with_prep_variant(args), c10::cuda::getCurrentCUDAStream().stream()),
                          "forward kernel");
      });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> chunk_prep_backward_cuda(
    const std::optional<at::Tensor>& grad_u, const std::optional<at::Tensor>& grad_w,
    const std::optional<at::Tensor>& grad_qd, const std::optional<at::Tensor>& grad_p,
    const std::optional<at::Tensor>& grad_kend, const std::optional<at::Tensor>& grad_g_last,
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
    const at::Tensor& beta, const at::Tensor& u, const at::Tensor& w, double scale,
    int64_t chunk_size, bool l2_normalize_qk) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  return chunk_prep_internal::backward_via_kernel(
      grad_u, grad_w, grad_qd, grad_p, grad_kend, grad_g_last, q, k, v, g, beta, u, w, scale,
      chunk_size, l2_normalize_qk, [&q](const kernels::ChunkPrepBackwardArgs& args) {
        kernels::ChunkPrepBackwardArgs chosen = with_prep_variant(args);
        // The wide-head backward's scratch (Note [Chunk prep wide-head backward]): one slot
        // per SM (one block fits an SM), fewer for fewer chunks; from the caching allocator,
        // freed in stream order after the launch.
        at::Tensor scratch;
        const int64_t slot_floats =
            kernels::chunk_prep_backward_scratch_floats(args.shape.dk, args.shape.dv);
        if (slot_floats > 0) {
          const int64_t chunks = args.shape.batch * args.shape.heads * args.shape.chunks;
          const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
          chosen.scratch_slots = std::max<int64_t>(1, std::min(chunks, sms));
          scratch = at::empty({chosen.scratch_slots * slot_floats}, q.options().dtype(at::kFloat));
          chosen.scratch = scratch.data_ptr<float>();
        }
        check_prep_launch(
            kernels::launch_chunk_prep_backward(chosen, c10::cuda::getCurrentCUDAStream().stream()),
            "backward kernel");
      });
}

// Note [Chunk output layout] (ops/gdr_core/gdr_core_op.cc) on CUDA: one kernel each way
// (kernels/gdr_core/chunk_layout.h) for contiguous FP32 chunks and contiguous token-layout tensors
// of one of the three floating dtypes; anything else (FP64, strided gradients) takes the
// ATen copies, which give the same values.
std::optional<kernels::LayoutDtype> layout_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kernels::LayoutDtype::kFloat32;
    case at::kHalf: return kernels::LayoutDtype::kFloat16;
    case at::kBFloat16: return kernels::LayoutDtype::kBFloat16;
    default: return std::nullopt;
  }
}

kernels::ChunkLayoutShape layout_shape(int64_t B, int64_t H, int64_t T, int64_t rows, int64_t dv) {
  kernels::ChunkLayoutShape shape;
  shape.batch = B;
  shape.heads = H;
  shape.tokens = T;
  shape.chunk_rows = rows;
  shape.dv = dv;
  return shape;
}

void check_layout_launch(int error, const char* op) {
  TORCH_CHECK(error == cudaSuccess, op,
              ": kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

at::Tensor chunks_to_tokens_cuda(const at::Tensor& o_chunks, int64_t tokens, at::ScalarType dtype) {
  chunk_layout_internal::check_chunks_to_tokens(o_chunks, tokens);
  const c10::cuda::CUDAGuard device_guard(o_chunks.device());
  const int64_t B = o_chunks.size(0), H = o_chunks.size(1), N = o_chunks.size(2),
                C = o_chunks.size(3), dv = o_chunks.size(4);
  const std::optional<kernels::LayoutDtype> out_kind = layout_dtype(dtype);
  if (o_chunks.scalar_type() == at::kFloat && o_chunks.is_contiguous() && out_kind.has_value()) {
    at::Tensor o = at::empty({B, tokens, H, dv}, o_chunks.options().dtype(dtype));
    const kernels::ChunkLayoutShape shape = layout_shape(B, H, tokens, N * C, dv);
    if (kernels::chunk_layout_supports(shape, o_chunks.data_ptr(), o.data_ptr())) {
      check_layout_launch(
          kernels::launch_chunks_to_tokens(shape, o_chunks.data_ptr<float>(), o.data_ptr(),
                                           *out_kind, c10::cuda::getCurrentCUDAStream().stream()),
          "chunks_to_tokens");
      return o;
    }
  }
  return chunk_layout_internal::chunks_to_tokens_aten(o_chunks, tokens, dtype);
}

at::Tensor tokens_to_chunks_cuda(const at::Tensor& grad_o, int64_t chunks, int64_t chunk,
                                 at::ScalarType dtype) {
  chunk_layout_internal::check_tokens_to_chunks(grad_o, chunks, chunk);
  const c10::cuda::CUDAGuard device_guard(grad_o.device());
  const int64_t B = grad_o.size(0), T = grad_o.size(1), H = grad_o.size(2), dv = grad_o.size(3);
  const std::optional<kernels::LayoutDtype> in_kind = layout_dtype(grad_o.scalar_type());
  if (dtype == at::kFloat && grad_o.is_contiguous() && in_kind.has_value()) {
    at::Tensor d = at::empty({B, H, chunks, chunk, dv}, grad_o.options().dtype(at::kFloat));
    const kernels::ChunkLayoutShape shape = layout_shape(B, H, T, chunks * chunk, dv);
    if (kernels::chunk_layout_supports(shape, d.data_ptr(), grad_o.data_ptr())) {
      check_layout_launch(
          kernels::launch_tokens_to_chunks(shape, grad_o.data_ptr(), *in_kind, d.data_ptr<float>(),
                                           c10::cuda::getCurrentCUDAStream().stream()),
          "tokens_to_chunks");
      return d;
    }
  }
  return chunk_layout_internal::tokens_to_chunks_aten(grad_o, chunks, chunk, dtype);
}

}  // namespace

TORCH_LIBRARY_IMPL(gdr, CUDA, m) {
  m.impl("chunks_to_tokens", &chunks_to_tokens_cuda);
  m.impl("tokens_to_chunks", &tokens_to_chunks_cuda);
  m.impl("chunk_state_pass", &chunk_state_forward_cuda);
  m.impl("chunk_state_pass_backward", &chunk_state_backward_cuda);
  m.impl("chunk_prep", &chunk_prep_forward_cuda);
  m.impl("chunk_prep_backward", &chunk_prep_backward_cuda);
}

}  // namespace gdr
