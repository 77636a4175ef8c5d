// GPU tests of the chunk state pass (tag gpu): the CUDA op (scan kernel + batched
// products) against the CPU FP64 reference op, forward and backward; the whole
// gated_delta_rule_chunked with the kernel against the composite step 7 (outputs and
// gradients of q, k, v, g, beta, initial_state), T not a multiple of 64, two head dims;
// the fall-backs to the composite; side streams; 100 bit-exact replays under load. Both
// scan kernels, tensor cores (3xTF32, the default) and FP32 SIMT (GDR_CHUNK_SCAN_TC=0),
// against the same references, and each replayed bit-exactly under load. The backward's
// dQd / dP GEMMs beside the scan on a side stream (GDR_CHUNK_GEMM_OVERLAP) against the
// same GEMMs in line, eagerly, under load, and captured in a CUDA graph.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/gdr_core/chunk_state.h"
#include "ops/gdr_core/chunk_state_op.h"
#include "ops/gdr_core/gdr_core_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/gpu_contention.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

const auto kCuda = at::TensorOptions().device(at::kCUDA);

using test_support::bitwise_equal;

// The scan kernel (tensor cores or FP32 SIMT) and the backward's GEMMs beside the scan or in
// line, over the current execution policy, for a scope.
using ScopedScanKernel =
    test_support::ScopedPolicyChoice<&ExecutionPolicy::chunk_scan_tensor_cores>;
using ScopedGemmOverlap = test_support::ScopedPolicyChoice<&ExecutionPolicy::chunk_gemm_overlap>;

const char* scan_kernel_name(bool tensor_cores) {
  return tensor_cores ? "tensor-core scan" : "SIMT scan";
}

// max |x - ref| / max |ref| (ref in FP64 on the CPU).
double relative_error(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kCPU, at::kDouble);
  const at::Tensor d = x.to(at::kCPU, at::kDouble) - r;
  return d.abs().max().item<double>() / (r.abs().max().item<double>() + 1e-30);
}

// ---------------------------------------------------------------------------
// The op against the CPU FP64 reference op

struct OpCase {
  int64_t B, H, N, dk, dv;
  bool initial_state, grad_final_state;
};

struct OpInputs {
  at::Tensor u, w, qd, p, kend, g_last, initial_state, grad_o, grad_final_state;
};

OpInputs make_op_inputs(const OpCase& c, uint64_t seed) {
  at::manual_seed(seed);
  const int64_t C = kernels::kChunkStateChunk;
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const double row = 0.5 / std::sqrt(static_cast<double>(c.dk));
  OpInputs x;
  x.u = at::randn({c.B, c.H, c.N, C, c.dv}, f64);
  x.w = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
  x.qd = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
  x.p = at::randn({c.B, c.H, c.N, C, C}, f64).tril() * 0.1;
  x.kend = at::randn({c.B, c.H, c.N, C, c.dk}, f64) * row;
  x.g_last = -3.0 * at::rand({c.B, c.H, c.N}, f64);
  if (c.initial_state) x.initial_state = at::randn({c.B, c.H, c.dk, c.dv}, f64);
  x.grad_o = at::randn({c.B, c.H, c.N, C, c.dv}, f64);
  if (c.grad_final_state) x.grad_final_state = at::randn({c.B, c.H, c.dk, c.dv}, f64);
  return x;
}

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

using Results = std::vector<at::Tensor>;  // o, final, states, v_new, then the 7 gradients
const char* kResultNames[] = {"o",   "final_state", "states", "v_new",   "du",       "dw",
                              "dqd", "dp",          "dkend",  "dg_last", "d_initial"};

Results run_op(const OpInputs& x) {
  auto [o, s, states, v_new] =
      chunk_state_pass(x.u, x.w, x.qd, x.p, x.kend, x.g_last, opt(x.initial_state));
  auto [du, dw, dqd, dp, dkend, dg, d0] = chunk_state_pass_backward(
      opt(x.grad_o), opt(x.grad_final_state), x.w, x.qd, x.p, x.kend, x.g_last, states, v_new);
  return {o, s, states, v_new, du, dw, dqd, dp, dkend, dg, d0};
}

OpInputs to_cuda_fp32(const OpInputs& x) {
  auto cvt = [](const at::Tensor& t) { return t.defined() ? t.to(kCuda.dtype(at::kFloat)) : t; };
  OpInputs y;
  // u and w as slices of one [.., dv + dk] tensor, the layout of the solve's output.
  const at::Tensor uw = cvt(at::cat({x.u, x.w}, -1));
  y.u = uw.narrow(-1, 0, x.u.size(-1));
  y.w = uw.narrow(-1, x.u.size(-1), x.w.size(-1));
  y.qd = cvt(x.qd);
  y.p = cvt(x.p);
  y.kend = cvt(x.kend);
  y.g_last = cvt(x.g_last);
  y.initial_state = cvt(x.initial_state);
  // The upstream gradient with a transposed layout, as autograd may hand it over.
  y.grad_o = cvt(x.grad_o).transpose(0, 1).contiguous().transpose(0, 1);
  y.grad_final_state = cvt(x.grad_final_state);
  return y;
}

TEST(ChunkStatePassGpu, ForwardAndBackwardMatchTheFp64CpuReference) {
  const std::vector<OpCase> cases = {
      {1, 2, 3, 128, 128, true, true},  {2, 3, 5, 64, 128, false, false},
      {1, 2, 4, 256, 64, true, false},  {1, 1, 2, 128, 256, false, true},
      {1, 16, 1, 128, 128, true, true}, {2, 2, 9, 64, 64, true, true},
  };
  for (const OpCase& c : cases) {
    const std::string context = "B" + std::to_string(c.B) + " H" + std::to_string(c.H) + " N" +
                                std::to_string(c.N) + " dk" + std::to_string(c.dk) + " dv" +
                                std::to_string(c.dv) + (c.initial_state ? " S0" : "") +
                                (c.grad_final_state ? " dS_N" : "");
    const OpInputs ref_in = make_op_inputs(c, 40 + c.N);
    const Results ref = run_op(ref_in);
    const Results got = run_op(to_cuda_fp32(ref_in));
    ASSERT_EQ(got.size(), ref.size());
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i].is_cuda()) << context << " " << kResultNames[i];
      ASSERT_EQ(got[i].scalar_type(), at::kFloat) << context << " " << kResultNames[i];
      ASSERT_EQ(got[i].sizes(), ref[i].sizes()) << context << " " << kResultNames[i];
      // FP32 against FP64 over at most 9 chunks of 64 rows: state-sized relative error.
      EXPECT_LE(relative_error(got[i], ref[i]), 1e-4) << context << " " << kResultNames[i];
    }
  }
}

TEST(ChunkStatePassGpu, TensorCoreAndSimtScansBothMatchTheFp64CpuReference) {
  const std::vector<OpCase> cases = {
      {1, 2, 3, 128, 128, true, true},  {2, 3, 5, 64, 128, false, false},
      {1, 2, 4, 256, 64, true, false},  {1, 1, 2, 128, 256, false, true},
      {1, 16, 1, 128, 128, true, true}, {2, 2, 9, 64, 64, true, true},
      {1, 4, 32, 128, 128, true, true},
  };
  for (const OpCase& c : cases) {
    const std::string context = "B" + std::to_string(c.B) + " H" + std::to_string(c.H) + " N" +
                                std::to_string(c.N) + " dk" + std::to_string(c.dk) + " dv" +
                                std::to_string(c.dv);
    const OpInputs ref_in = make_op_inputs(c, 70 + c.N);
    const Results ref = run_op(ref_in);
    const OpInputs x = to_cuda_fp32(ref_in);
    Results got[2];
    for (const bool tc : {true, false}) {
      const ScopedScanKernel kernel(tc);
      got[tc] = run_op(x);
      EXPECT_EQ(kernels::chunk_state_scan_last_used_tensor_cores(), tc)
          << context << " " << scan_kernel_name(tc) << " did not run";
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_EQ(got[tc][i].sizes(), ref[i].sizes()) << context << " " << kResultNames[i];
        // Both FP32-level (3xTF32 or FP32 FMAs) against FP64: the tolerance of the test
        // above.
        const double err = relative_error(got[tc][i], ref[i]);
        std::printf("%s %s %s: %.2e\n", context.c_str(), scan_kernel_name(tc), kResultNames[i],
                    err);
        EXPECT_LE(err, 1e-4) << context << " " << scan_kernel_name(tc) << " " << kResultNames[i];
      }
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      EXPECT_LE(relative_error(got[true][i], got[false][i]), 1e-4)
          << context << " tensor-core vs SIMT scan " << kResultNames[i];
    }
  }
}

TEST(ChunkStatePassGpu, EachScanKernelReplaysBitwiseWhileAnotherStreamLoadsTheGpu) {
  // The training shape (B=1, H=16, T=2048 -> 32 chunks, dk = dv = 128).
  const OpInputs x = to_cuda_fp32(make_op_inputs({1, 16, 32, 128, 128, true, true}, 97));
  for (const bool tc : {true, false}) {
    const ScopedScanKernel kernel(tc);
    const Results first = run_op(x);
    EXPECT_EQ(kernels::chunk_state_scan_last_used_tensor_cores(), tc) << scan_kernel_name(tc);
    std::optional<test_support::GpuContention> load(std::in_place);
    int mismatches = 0;
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    for (int replay = 0; replay < 50; ++replay) {
      Results again;
      if (replay % 2 == 0) {
        again = run_op(x);
      } else {  // every other replay on a side stream
        c10::cuda::getCurrentCUDAStream().synchronize();
        c10::cuda::CUDAStreamGuard guard(side);
        again = run_op(x);
        side.synchronize();
      }
      for (size_t i = 0; i < again.size(); ++i)
        mismatches += bitwise_equal(again[i], first[i]) ? 0 : 1;
    }
    load.reset();
    EXPECT_EQ(mismatches, 0) << scan_kernel_name(tc)
                             << ": the chunk state pass must give identical bits on every replay";
  }
}

TEST(ChunkStatePassGpu, UnsupportedShapesAreRefusedByTheCudaOpNamingThem) {
  OpCase c{1, 1, 2, 32, 64, false, false};
  const OpInputs x = to_cuda_fp32(make_op_inputs(c, 1));
  try {
    chunk_state_pass(x.u, x.w, x.qd, x.p, x.kend, x.g_last, std::nullopt);
    FAIL() << "dk = 32 must be refused";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "chunk_state_pass: the CUDA implementation expects dk in {64, 128, 256} and dv a "
              "multiple of 16 but got dk = 32, dv = 64");
  }
}

TEST(ChunkStatePassGpu, AnUnknownScanKernelSettingIsRefusedNamingTheVariable) {
  EXPECT_EQ(test_support::policy_error("GDR_CHUNK_SCAN_TC", "yes"),
            "GDR_CHUNK_SCAN_TC: expected true, false, 1 or 0, but got 'yes'");
}

TEST(ChunkStatePassGpu, SideStreamGivesTheDefaultStreamBits) {
  const OpInputs x = to_cuda_fp32(make_op_inputs({1, 4, 6, 128, 128, true, true}, 5));
  const Results on_default = run_op(x);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  Results on_side;
  c10::cuda::getCurrentCUDAStream().synchronize();
  {
    c10::cuda::CUDAStreamGuard guard(side);
    on_side = run_op(x);
  }
  side.synchronize();
  for (size_t i = 0; i < on_side.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(on_side[i], on_default[i])) << kResultNames[i];
  }
}

// See Note [State pass side stream]: the two GEMMs beside the scan give the bits of the same
// GEMMs run after it, at the training shape (B = 1, H = 16, 32 chunks, where the scan and
// the GEMMs share the SMs) and with several batches; 20 replays each way under load.
TEST(ChunkStatePassGpu, GemmOverlapGivesTheInLineBitsUnderLoad) {
  for (const OpCase& c :
       {OpCase{1, 16, 32, 128, 128, true, true}, OpCase{2, 3, 7, 64, 192, false, true}}) {
    const std::string context = "B" + std::to_string(c.B) + " H" + std::to_string(c.H) + " N" +
                                std::to_string(c.N) + " dk" + std::to_string(c.dk);
    const OpInputs x = to_cuda_fp32(make_op_inputs(c, 11 + c.N));
    Results in_line;
    {
      const ScopedGemmOverlap off(false);
      const int64_t before = chunk_state_internal::backward_side_stream_runs();
      in_line = run_op(x);
      EXPECT_EQ(chunk_state_internal::backward_side_stream_runs(), before)
          << context << ": GDR_CHUNK_GEMM_OVERLAP=0 must run the GEMMs in line";
    }
    std::optional<test_support::GpuContention> load(std::in_place);
    int mismatches = 0;
    for (int replay = 0; replay < 20; ++replay) {
      const int64_t before = chunk_state_internal::backward_side_stream_runs();
      const Results overlapped = run_op(x);
      EXPECT_EQ(chunk_state_internal::backward_side_stream_runs(), before + 1)
          << context << ": the default must take the side stream";
      for (size_t i = 0; i < overlapped.size(); ++i) {
        if (!bitwise_equal(overlapped[i], in_line[i])) {
          ++mismatches;
          ADD_FAILURE() << context << " replay " << replay << ": " << kResultNames[i]
                        << " differs from the in-line GEMMs";
        }
      }
    }
    load.reset();
    EXPECT_EQ(mismatches, 0) << context;
  }
}

// The side stream inside stream capture, on a thread whose first use of it is the capture
// (the stream is created while the capturing stream is live): the graph's replays give
// the eager bits, and the side branch joined the capture (capture_end would fail on an
// unjoined stream).
TEST(ChunkStatePassGpu, GemmOverlapCapturedInACudaGraphOnAFreshThreadReplaysTheEagerBits) {
  const OpInputs x = to_cuda_fp32(make_op_inputs({1, 16, 32, 128, 128, true, true}, 23));
  const Results eager = run_op(x);
  auto [o, s, states, v_new] =
      chunk_state_pass(x.u, x.w, x.qd, x.p, x.kend, x.g_last, opt(x.initial_state));
  c10::cuda::getCurrentCUDAStream().synchronize();
  std::string failure;
  std::thread capture_thread([&] {
    try {
      const c10::cuda::CUDAStream capture_stream = c10::cuda::getStreamFromPool();
      const c10::cuda::CUDAStreamGuard guard(capture_stream);
      const int64_t before = chunk_state_internal::backward_side_stream_runs();
      at::cuda::CUDAGraph graph;
      graph.capture_begin();
      auto [du, dw, dqd, dp, dkend, dg, d0] = chunk_state_pass_backward(
          opt(x.grad_o), opt(x.grad_final_state), x.w, x.qd, x.p, x.kend, x.g_last, states, v_new);
      graph.capture_end();
      if (chunk_state_internal::backward_side_stream_runs() != before + 1) {
        failure = "the captured backward did not take the side stream";
        return;
      }
      const Results captured = {du, dw, dqd, dp, dkend, dg, d0};
      for (int replay = 0; replay < 3; ++replay) {
        for (const at::Tensor& t : captured) t.fill_(std::numeric_limits<float>::quiet_NaN());
        graph.replay();
        capture_stream.synchronize();
        for (size_t i = 0; i < captured.size(); ++i) {
          if (!bitwise_equal(captured[i], eager[4 + i])) {
            failure += std::string("replay ") + std::to_string(replay) + ": " +
                       kResultNames[4 + i] + " differs from the eager backward; ";
          }
        }
      }
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  capture_thread.join();
  EXPECT_EQ(failure, "");
}

TEST(ChunkStatePassGpu, AnUnknownGemmOverlapSettingIsRefusedNamingTheVariable) {
  EXPECT_EQ(test_support::policy_error("GDR_CHUNK_GEMM_OVERLAP", "on"),
            "GDR_CHUNK_GEMM_OVERLAP: expected true, false, 1 or 0, but got 'on'");
}

// ---------------------------------------------------------------------------
// The whole core: kernel step 7 against the composite step 7

struct CoreInputs {
  at::Tensor q, k, v, g, beta, initial_state;
};

// As the model feeds the core: unit-norm q and k, beta in (0, 1), g in (-2, 0).
CoreInputs make_core_inputs(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv,
                            bool initial_state, at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  const auto f32 = kCuda.dtype(at::kFloat);
  CoreInputs x;
  x.q = at::randn({B, T, H, dk}, f32);
  x.q = (x.q / x.q.norm(2, -1, true)).to(dtype);
  x.k = at::randn({B, T, H, dk}, f32);
  x.k = (x.k / x.k.norm(2, -1, true)).to(dtype);
  x.v = at::randn({B, T, H, dv}, f32).to(dtype);
  x.g = -2.0 * at::rand({B, T, H}, f32);
  x.beta = at::sigmoid(at::randn({B, T, H}, f32));
  if (initial_state) x.initial_state = 0.5 * at::randn({B, H, dk, dv}, f32);
  return x;
}

// o, final state, then the gradients of q, k, v, g, beta (and initial_state when given)
// of sum(o * w_o) + sum(state * w_s).
Results run_core(const CoreInputs& x, const at::Tensor& w_o, const at::Tensor& w_s) {
  std::vector<at::Tensor> leaves = {x.q, x.k, x.v, x.g, x.beta};
  if (x.initial_state.defined()) leaves.push_back(x.initial_state);
  for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
  std::optional<at::Tensor> initial;
  if (x.initial_state.defined()) initial = leaves[5];
  const double scale = 1.0 / std::sqrt(static_cast<double>(x.q.size(3)));
  auto [o, s] = gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                         scale, initial, true);
  const at::Tensor loss =
      (o.to(w_o.scalar_type()) * w_o).sum() + (s.to(w_s.scalar_type()) * w_s).sum();
  Results out = {o.detach(), s.detach()};
  for (const at::Tensor& grad : torch::autograd::grad({loss}, leaves)) out.push_back(grad);
  return out;
}

CoreInputs to_cpu_fp64(const CoreInputs& x) {
  auto cvt = [](const at::Tensor& t) { return t.defined() ? t.to(at::kCPU, at::kDouble) : t; };
  return {cvt(x.q), cvt(x.k), cvt(x.v), cvt(x.g), cvt(x.beta), cvt(x.initial_state)};
}

class GdrCoreKernelGpu : public testing::Test {
 protected:
  // The GDR core's state pass (the execution policy's gdr_core_impl) for the rest of the
  // test.
  void set_core_impl(GdrCoreImpl impl) {
    ExecutionPolicy policy;
    policy.gdr_core_impl = impl;
    guard_.reset();
    guard_.emplace(policy);
  }

 private:
  std::optional<ExecutionPolicyGuard> guard_;
};

struct CoreCase {
  int64_t B, T, H, dk, dv;
  bool initial_state;
};

TEST_F(GdrCoreKernelGpu, KernelStepMatchesTheCompositeStepInOutputsAndGradients) {
  const std::vector<CoreCase> cases = {
      {1, 200, 4, 128, 128, false},
      {2, 2085, 2, 128, 128, true},
      {1, 130, 3, 64, 128, true},
      {1, 64, 2, 64, 64, false},
  };
  const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  for (const CoreCase& c : cases) {
    const std::string context = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " H" +
                                std::to_string(c.H) + " dk" + std::to_string(c.dk) + " dv" +
                                std::to_string(c.dv) + (c.initial_state ? " S0" : "");
    const CoreInputs x =
        make_core_inputs(c.B, c.T, c.H, c.dk, c.dv, c.initial_state, at::kFloat, 11 + c.T);
    const at::Tensor w_o = at::randn({c.B, c.T, c.H, c.dv}, kCuda);
    const at::Tensor w_s = at::randn({c.B, c.H, c.dk, c.dv}, kCuda);

    set_core_impl(GdrCoreImpl::kKernel);
    const Results kernel = run_core(x, w_o, w_s);
    EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kKernel) << context;
    set_core_impl(GdrCoreImpl::kComposite);
    const Results composite = run_core(x, w_o, w_s);
    EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kComposite) << context;
    const Results exact =
        run_core(to_cpu_fp64(x), w_o.to(at::kCPU, at::kDouble), w_s.to(at::kCPU, at::kDouble));
    ASSERT_EQ(kernel.size(), exact.size());
    for (size_t i = 0; i < kernel.size(); ++i) {
      ASSERT_EQ(kernel[i].sizes(), composite[i].sizes()) << context << " " << names[i];
      ASSERT_EQ(kernel[i].scalar_type(), composite[i].scalar_type()) << context << " " << names[i];
      const double err_kernel = relative_error(kernel[i], exact[i]);
      const double err_composite = relative_error(composite[i], exact[i]);
      const double err_between = relative_error(kernel[i], composite[i]);
      std::printf("%s %s: kernel %.2e, composite %.2e (vs FP64), kernel vs composite %.2e\n",
                  context.c_str(), names[i], err_kernel, err_composite, err_between);
      // Both FP32 with different summation orders: the kernel must be as accurate as the
      // composite (a factor 4 for rounding luck) and close to it.
      EXPECT_LE(err_kernel, std::max(1e-4, 4.0 * err_composite)) << context << " " << names[i];
      EXPECT_LE(err_between, 1e-3) << context << " " << names[i];
    }
  }
}

TEST_F(GdrCoreKernelGpu, KernelStepOnTheSimtScanAlsoMatchesTheComposite) {
  // The test above runs the default scan kernel (tensor cores); this one the SIMT kernel
  // (GDR_CHUNK_SCAN_TC=0) on one shape, with the same bounds.
  const CoreCase c{1, 200, 4, 128, 128, true};
  const CoreInputs x =
      make_core_inputs(c.B, c.T, c.H, c.dk, c.dv, c.initial_state, at::kFloat, 21 + c.T);
  const at::Tensor w_o = at::randn({c.B, c.T, c.H, c.dv}, kCuda);
  const at::Tensor w_s = at::randn({c.B, c.H, c.dk, c.dv}, kCuda);
  set_core_impl(GdrCoreImpl::kComposite);
  const Results composite = run_core(x, w_o, w_s);
  const Results exact =
      run_core(to_cpu_fp64(x), w_o.to(at::kCPU, at::kDouble), w_s.to(at::kCPU, at::kDouble));
  set_core_impl(GdrCoreImpl::kKernel);
  for (const bool tc : {true, false}) {
    const ScopedScanKernel kernel(tc);
    const Results got = run_core(x, w_o, w_s);
    EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kKernel);
    EXPECT_EQ(kernels::chunk_state_scan_last_used_tensor_cores(), tc) << scan_kernel_name(tc);
    for (size_t i = 0; i < got.size(); ++i) {
      const double err_kernel = relative_error(got[i], exact[i]);
      const double err_composite = relative_error(composite[i], exact[i]);
      std::printf("%s output %zu: kernel %.2e, composite %.2e (vs FP64)\n", scan_kernel_name(tc), i,
                  err_kernel, err_composite);
      EXPECT_LE(err_kernel, std::max(1e-4, 4.0 * err_composite))
          << scan_kernel_name(tc) << " " << i;
      EXPECT_LE(relative_error(got[i], composite[i]), 1e-3) << scan_kernel_name(tc) << " " << i;
    }
  }
}

TEST_F(GdrCoreKernelGpu, ShapesAndDtypesTheKernelDoesNotCoverFallBackToTheComposite) {
  set_core_impl(GdrCoreImpl::kKernel);
  const CoreInputs small_dk = make_core_inputs(1, 100, 2, 32, 64, false, at::kFloat, 3);
  gated_delta_rule_chunked(small_dk.q, small_dk.k, small_dk.v, small_dk.g, small_dk.beta, 0.2);
  EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kComposite) << "dk = 32";
  const CoreInputs ok = make_core_inputs(1, 100, 2, 64, 64, false, at::kFloat, 4);
  gated_delta_rule_chunked(ok.q, ok.k, ok.v, ok.g, ok.beta, 0.2, std::nullopt, false, 16);
  EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kComposite) << "chunk_size = 16";
  gated_delta_rule_chunked(ok.q.to(at::kDouble), ok.k.to(at::kDouble), ok.v.to(at::kDouble), ok.g,
                           ok.beta, 0.2);
  EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kComposite) << "FP64";
  gated_delta_rule(ok.q.to(at::kBFloat16), ok.k.to(at::kBFloat16), ok.v.to(at::kBFloat16), ok.g,
                   ok.beta, 0.2);
  EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kKernel) << "BF16 inputs compute in FP32";
  const test_support::PolicyForTest composite("GDR_CORE_IMPL", "composite");
  gated_delta_rule(ok.q, ok.k, ok.v, ok.g, ok.beta, 0.2);
  EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kComposite) << "GDR_CORE_IMPL=composite";
}

// ---------------------------------------------------------------------------
// Replays under load

TEST_F(GdrCoreKernelGpu, HundredReplaysAreBitwiseIdenticalWhileAnotherStreamLoadsTheGpu) {
  set_core_impl(GdrCoreImpl::kKernel);
  // The training shape of one Qwen3.5-0.8B GDN layer, BF16 activations as in the model.
  const CoreInputs x = make_core_inputs(1, 2048, 16, 128, 128, false, at::kBFloat16, 99);
  const at::Tensor w_o = at::randn({1, 2048, 16, 128}, kCuda);
  const at::Tensor w_s = at::randn({1, 16, 128, 128}, kCuda);
  const Results first_core = run_core(x, w_o, w_s);
  EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kKernel);
  const OpInputs op_in = to_cuda_fp32(make_op_inputs({1, 16, 32, 128, 128, true, true}, 98));
  const Results first_op = run_op(op_in);

  std::optional<test_support::GpuContention> load(std::in_place);
  int core_mismatches = 0, op_mismatches = 0;
  for (int replay = 0; replay < 100; ++replay) {
    const Results core = run_core(x, w_o, w_s);
    for (size_t i = 0; i < core.size(); ++i)
      core_mismatches += bitwise_equal(core[i], first_core[i]) ? 0 : 1;
    const Results op = run_op(op_in);
    for (size_t i = 0; i < op.size(); ++i)
      op_mismatches += bitwise_equal(op[i], first_op[i]) ? 0 : 1;
  }
  load.reset();
  EXPECT_EQ(op_mismatches, 0) << "the chunk state pass must give identical bits on every replay";
  EXPECT_EQ(core_mismatches, 0)
      << "gated_delta_rule_chunked (kernel step 7) forward and gradients must give identical "
         "bits on every replay";
}

}  // namespace
}  // namespace gdr
