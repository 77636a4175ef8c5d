// GPU tests of the chunk prep (tag gpu): the CUDA op (one kernel each way) against the CPU
// FP64 reference op, forward and backward, FP32 and BF16 inputs, dk in {64, 128, 256}, dv != dk,
// T not a multiple of 64; the whole gated_delta_rule_chunked with GDR_CORE_PREP=kernel
// against aten (outputs and gradients of q, k, v, g, beta, initial_state; FP32 tight
// against the FP64 CPU result, BF16 within a stated tolerance of the aten path); the
// switch's environment variable and fall-backs; inputs read in place as strided views
// (q, k, v slices of one projection row, g and beta transposed) giving the bits of
// contiguous inputs, with o handed over contiguous in v's dtype; side streams; 100
// bit-exact replays of the training shape (BF16 and FP32 q/k/v) while other streams load
// the GPU. The fused q / k L2 norm and head groups (raw BF16 / FP32 q, k with Hk key
// heads, H = Hk, 2 Hk, 4 Hk, read in place as slices of a conv-output row; FP32 or BF16
// v): the op against the CPU FP64 reference op, the core with GdrQkNorm::kL2 through the
// prep kernel against the ATen composite (normalise + repeat + steps 1-6) and FP64, and
// 100 bit-exact replays under load. Both prep variants, the backward's dM, dK and dQ
// products on tensor cores (3xTF32, the default) and FP32 SIMT (GDR_CHUNK_PREP_TC=0),
// against the same FP64 reference and each other, and each replayed bit-exactly under load.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels/gdr_core/chunk_prep.h"
#include "ops/gdr_core/chunk_prep_op.h"
#include "ops/gdr_core/gdr_core_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/gpu_contention.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

const auto kCuda = at::TensorOptions().device(at::kCUDA);

using test_support::bitwise_equal;

// max |x - ref| / max |ref| (ref in FP64 on the CPU).
double relative_error(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kCPU, at::kDouble);
  const at::Tensor d = x.to(at::kCPU, at::kDouble) - r;
  return d.abs().max().item<double>() / (r.abs().max().item<double>() + 1e-30);
}

struct Inputs {
  at::Tensor q, k, v, g, beta, initial_state;
};

// As the model feeds the core: unit-norm q and k, beta in (0, 1), g in (-2, 0).
Inputs make_inputs(int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, bool initial_state,
                   at::ScalarType dtype, uint64_t seed) {
  at::manual_seed(seed);
  const auto f32 = kCuda.dtype(at::kFloat);
  Inputs x;
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

at::Tensor cpu64(const at::Tensor& t) { return t.defined() ? t.to(at::kCPU, at::kDouble) : t; }

using Results = std::vector<at::Tensor>;

// ---------------------------------------------------------------------------
// The op against the CPU FP64 reference op

struct OpCase {
  int64_t B, T, H, dk, dv;
  at::ScalarType dtype;
};

const char* kOpNames[] = {"u", "w", "qd", "p", "kend", "g_last", "dq", "dk", "dv", "dg", "dbeta"};

// Forward outputs, then the gradients of sum_i <out_i, up_i> through the backward op.
Results run_op(const Inputs& x, double scale, const std::vector<at::Tensor>& up) {
  auto [u, w, qd, p, kend, g_last] = chunk_prep(x.q, x.k, x.v, x.g, x.beta, scale, 64);
  auto [dq, dk, dv, dg, dbeta] = chunk_prep_backward(up[0], up[1], up[2], up[3], up[4], up[5], x.q,
                                                     x.k, x.v, x.g, x.beta, u, w, scale, 64);
  return {u, w, qd, p, kend, g_last, dq, dk, dv, dg, dbeta};
}

std::vector<at::Tensor> make_upstream(const Inputs& x, const at::TensorOptions& options) {
  const int64_t B = x.q.size(0), T = x.q.size(1), H = x.q.size(2), dk = x.q.size(3),
                dv = x.v.size(3), N = (T + 63) / 64;
  return {at::randn({B, H, N, 64, dv}, options), at::randn({B, H, N, 64, dk}, options),
          at::randn({B, H, N, 64, dk}, options), at::randn({B, H, N, 64, 64}, options),
          at::randn({B, H, N, 64, dk}, options), at::randn({B, H, N}, options)};
}

TEST(ChunkPrepGpu, ForwardAndBackwardMatchTheFp64CpuReference) {
  const std::vector<OpCase> cases = {
      {1, 2048, 4, 128, 128, at::kFloat},
      {2, 200, 3, 64, 128, at::kFloat},
      {1, 130, 2, 128, 64, at::kFloat},
      {1, 100, 2, 64, 48, at::kFloat},
      {1, 2085, 2, 128, 128, at::kBFloat16},
      {2, 70, 3, 64, 96, at::kBFloat16},
      // dk = 256, the wide-head backward (Note [Chunk prep wide-head backward]): 260 chunks
      // walked by one block per SM (more chunks than SMs), a tail; BF16 with dv != dk.
      {2, 4160, 2, 256, 256, at::kFloat},
      {1, 200, 3, 256, 128, at::kBFloat16},
  };
  for (const OpCase& c : cases) {
    const bool bf16 = c.dtype == at::kBFloat16;
    const std::string context = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " H" +
                                std::to_string(c.H) + " dk" + std::to_string(c.dk) + " dv" +
                                std::to_string(c.dv) + (bf16 ? " bf16" : " fp32");
    const Inputs x = make_inputs(c.B, c.T, c.H, c.dk, c.dv, false, c.dtype, 21 + c.T);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
    const std::vector<at::Tensor> up = make_upstream(x, kCuda.dtype(at::kFloat));
    const Results got = run_op(x, scale, up);
    std::vector<at::Tensor> up64;
    for (const at::Tensor& t : up) up64.push_back(cpu64(t));
    const Results ref =
        run_op({cpu64(x.q), cpu64(x.k), cpu64(x.v), cpu64(x.g), cpu64(x.beta), {}}, scale, up64);
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i].is_cuda()) << context << " " << kOpNames[i];
      ASSERT_EQ(got[i].sizes(), ref[i].sizes()) << context << " " << kOpNames[i];
      // FP32 against FP64 on the same (rounded) inputs; BF16 gradients of q, k, v are
      // rounded to BF16 on the way out.
      const bool bf16_grad = bf16 && i >= 6 && i <= 8;
      EXPECT_LE(relative_error(got[i], ref[i]), bf16_grad ? 8e-3 : 1e-4)
          << context << " " << kOpNames[i];
    }
  }
}

// The prep backward's products on tensor cores or FP32 SIMT, over the current execution
// policy, for a scope.
using ScopedPrepVariant =
    test_support::ScopedPolicyChoice<&ExecutionPolicy::chunk_prep_tensor_cores>;

const char* prep_variant_name(bool tensor_cores) {
  return tensor_cores ? "tensor-core prep" : "SIMT prep";
}

TEST(ChunkPrepGpu, TensorCoreAndSimtPrepBothMatchTheFp64CpuReference) {
  const std::vector<OpCase> cases = {
      {1, 2048, 4, 128, 128, at::kFloat},
      {2, 200, 3, 64, 128, at::kFloat},
      {1, 130, 2, 128, 64, at::kFloat},
      {1, 2085, 2, 128, 128, at::kBFloat16},
  };
  for (const OpCase& c : cases) {
    const bool bf16 = c.dtype == at::kBFloat16;
    const std::string context = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " H" +
                                std::to_string(c.H) + " dk" + std::to_string(c.dk) + " dv" +
                                std::to_string(c.dv) + (bf16 ? " bf16" : " fp32");
    const Inputs x = make_inputs(c.B, c.T, c.H, c.dk, c.dv, false, c.dtype, 31 + c.T);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
    const std::vector<at::Tensor> up = make_upstream(x, kCuda.dtype(at::kFloat));
    std::vector<at::Tensor> up64;
    for (const at::Tensor& t : up) up64.push_back(cpu64(t));
    const Results ref =
        run_op({cpu64(x.q), cpu64(x.k), cpu64(x.v), cpu64(x.g), cpu64(x.beta), {}}, scale, up64);
    Results got[2];
    for (const bool tc : {true, false}) {
      const ScopedPrepVariant variant(tc);
      got[tc] = run_op(x, scale, up);
      EXPECT_EQ(kernels::chunk_prep_last_used_tensor_cores(), tc)
          << context << " " << prep_variant_name(tc) << " did not run";
      for (size_t i = 0; i < ref.size(); ++i) {
        ASSERT_EQ(got[tc][i].sizes(), ref[i].sizes()) << context << " " << kOpNames[i];
        // Both FP32-level (3xTF32 or FP32 FMAs) against FP64: the bounds of the test above.
        const bool bf16_grad = bf16 && i >= 6 && i <= 8;
        const double err = relative_error(got[tc][i], ref[i]);
        std::printf("%s %s %s: %.2e\n", context.c_str(), prep_variant_name(tc), kOpNames[i], err);
        EXPECT_LE(err, bf16_grad ? 8e-3 : 1e-4)
            << context << " " << prep_variant_name(tc) << " " << kOpNames[i];
      }
    }
    for (size_t i = 0; i < ref.size(); ++i) {
      const bool bf16_grad = bf16 && i >= 6 && i <= 8;
      EXPECT_LE(relative_error(got[true][i], got[false][i]), bf16_grad ? 8e-3 : 1e-4)
          << context << " tensor-core vs SIMT prep " << kOpNames[i];
    }
  }
}

TEST(ChunkPrepGpu, EachPrepVariantReplaysBitwiseWhileAnotherStreamLoadsTheGpu) {
  // The training shape of one Qwen3.5-0.8B GDN layer (B=1, T=2048, H=16, dk = dv = 128), BF16.
  const Inputs x = make_inputs(1, 2048, 16, 128, 128, false, at::kBFloat16, 98);
  const std::vector<at::Tensor> up = make_upstream(x, kCuda.dtype(at::kFloat));
  for (const bool tc : {true, false}) {
    const ScopedPrepVariant variant(tc);
    const Results first = run_op(x, 0.088, up);
    EXPECT_EQ(kernels::chunk_prep_last_used_tensor_cores(), tc) << prep_variant_name(tc);
    std::optional<test_support::GpuContention> load(std::in_place);
    int mismatches = 0;
    c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
    for (int replay = 0; replay < 50; ++replay) {
      Results again;
      if (replay % 2 == 0) {
        again = run_op(x, 0.088, up);
      } else {  // every other replay on a side stream
        c10::cuda::getCurrentCUDAStream().synchronize();
        c10::cuda::CUDAStreamGuard guard(side);
        again = run_op(x, 0.088, up);
        side.synchronize();
      }
      for (size_t i = 0; i < again.size(); ++i) {
        mismatches += bitwise_equal(again[i], first[i]) ? 0 : 1;
      }
    }
    load.reset();
    EXPECT_EQ(mismatches, 0) << prep_variant_name(tc)
                             << ": the chunk prep op must give identical bits on every replay";
  }
}

TEST(ChunkPrepGpu, SideStreamGivesTheDefaultStreamBits) {
  const Inputs x = make_inputs(1, 300, 4, 128, 128, false, at::kBFloat16, 5);
  const std::vector<at::Tensor> up = make_upstream(x, kCuda.dtype(at::kFloat));
  const Results on_default = run_op(x, 0.1, up);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  Results on_side;
  c10::cuda::getCurrentCUDAStream().synchronize();
  {
    c10::cuda::CUDAStreamGuard guard(side);
    on_side = run_op(x, 0.1, up);
  }
  side.synchronize();
  for (size_t i = 0; i < on_side.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(on_side[i], on_default[i])) << kOpNames[i];
  }
}

TEST(ChunkPrepGpu, UnsupportedShapesAreRefusedByTheCudaOpNamingThem) {
  const Inputs x = make_inputs(1, 100, 1, 32, 64, false, at::kFloat, 1);
  try {
    chunk_prep(x.q, x.k, x.v, x.g, x.beta, 1.0, 64);
    FAIL() << "dk = 32 must be refused";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "chunk_prep: the CUDA implementation expects dk in {64, 128, 256} and dv a multiple "
              "of 16 within the shared-memory limit (dv <= 400, 208, 624 at dk = 64, 128, 256) "
              "but got dk = 32, dv = 64");
  }
}

TEST(ChunkPrepGpu, AnUnknownPrepKernelSettingIsRefusedNamingTheVariable) {
  EXPECT_EQ(test_support::policy_error("GDR_CHUNK_PREP_TC", "tc"),
            "GDR_CHUNK_PREP_TC: expected true, false, 1 or 0, but got 'tc'");
}

// ---------------------------------------------------------------------------
// The whole core: prep kernel against the ATen steps 1-6

// o, final state, then the gradients of q, k, v, g, beta (and initial_state when given)
// of sum(o * w_o) + sum(state * w_s).
Results run_core(const Inputs& x, const at::Tensor& w_o, const at::Tensor& w_s) {
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

class GdrCorePrepGpu : public testing::Test {
 protected:
  // The GDR core's chunk preparation and state pass (the execution policy's gdr_core_prep
  // and gdr_core_impl) for the rest of the test.
  void set_core_prep(GdrCorePrep prep) {
    policy_.gdr_core_prep = prep;
    apply_policy();
  }
  void set_core_impl(GdrCoreImpl impl) {
    policy_.gdr_core_impl = impl;
    apply_policy();
  }

 private:
  void apply_policy() {
    guard_.reset();
    guard_.emplace(policy_);
  }

  ExecutionPolicy policy_;
  std::optional<ExecutionPolicyGuard> guard_;
};

struct CoreCase {
  int64_t B, T, H, dk, dv;
  bool initial_state;
  at::ScalarType dtype;
  GdrCoreImpl step7;
};

TEST_F(GdrCorePrepGpu, KernelPrepMatchesTheAtenPrepInOutputsAndGradients) {
  const std::vector<CoreCase> cases = {
      {1, 200, 4, 128, 128, false, at::kFloat, GdrCoreImpl::kKernel},
      {2, 2085, 2, 128, 128, true, at::kFloat, GdrCoreImpl::kKernel},
      {1, 130, 3, 64, 128, true, at::kFloat, GdrCoreImpl::kKernel},
      {1, 100, 2, 64, 48, false, at::kFloat, GdrCoreImpl::kComposite},
      {1, 2048, 16, 128, 128, false, at::kBFloat16, GdrCoreImpl::kKernel},
      {2, 300, 2, 64, 64, true, at::kBFloat16, GdrCoreImpl::kKernel},
      {1, 64, 2, 128, 128, true, at::kBFloat16, GdrCoreImpl::kKernel},
      {1, 130, 2, 128, 128, false, at::kBFloat16, GdrCoreImpl::kKernel},
  };
  const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  for (const CoreCase& c : cases) {
    const bool bf16 = c.dtype == at::kBFloat16;
    const std::string context = "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " H" +
                                std::to_string(c.H) + " dk" + std::to_string(c.dk) + " dv" +
                                std::to_string(c.dv) + (c.initial_state ? " S0" : "") +
                                (bf16 ? " bf16" : " fp32") + " step7 " +
                                (c.step7 == GdrCoreImpl::kKernel ? "kernel" : "composite");
    const Inputs x = make_inputs(c.B, c.T, c.H, c.dk, c.dv, c.initial_state, c.dtype, 11 + c.T);
    const at::Tensor w_o = at::randn({c.B, c.T, c.H, c.dv}, kCuda);
    const at::Tensor w_s = at::randn({c.B, c.H, c.dk, c.dv}, kCuda);
    set_core_impl(c.step7);

    set_core_prep(GdrCorePrep::kKernel);
    const Results kernel = run_core(x, w_o, w_s);
    EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel) << context;
    set_core_prep(GdrCorePrep::kAten);
    const Results aten = run_core(x, w_o, w_s);
    EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kAten) << context;
    const Inputs x64 = {cpu64(x.q), cpu64(x.k),    cpu64(x.v),
                        cpu64(x.g), cpu64(x.beta), cpu64(x.initial_state)};
    const Results exact = run_core(x64, cpu64(w_o), cpu64(w_s));
    ASSERT_EQ(kernel.size(), exact.size());
    for (size_t i = 0; i < kernel.size(); ++i) {
      ASSERT_EQ(kernel[i].sizes(), aten[i].sizes()) << context << " " << names[i];
      ASSERT_EQ(kernel[i].scalar_type(), aten[i].scalar_type()) << context << " " << names[i];
      const double err_kernel = relative_error(kernel[i], exact[i]);
      const double err_aten = relative_error(aten[i], exact[i]);
      const double err_between = relative_error(kernel[i], aten[i]);
      std::printf("%s %s: kernel %.2e, aten %.2e (vs FP64), kernel vs aten %.2e\n", context.c_str(),
                  names[i], err_kernel, err_aten, err_between);
      if (bf16) {
        // Both compute in FP32 from the same BF16 inputs; o and the gradients of q, k, v
        // are rounded to BF16 (2^-8 relative) on the way out, so a last-bit flip of one
        // rounding shows as ~4e-3 of an element; the stated tolerance is 1e-2 of max |x|.
        EXPECT_LE(err_between, 1e-2) << context << " " << names[i];
        EXPECT_LE(err_kernel, std::max(1e-2, 2.0 * err_aten)) << context << " " << names[i];
      } else {
        // Both FP32 with different summation orders: the kernel must be as accurate as
        // the ATen path (a factor 4 for rounding luck) and close to it.
        EXPECT_LE(err_kernel, std::max(1e-4, 4.0 * err_aten)) << context << " " << names[i];
        EXPECT_LE(err_between, 1e-3) << context << " " << names[i];
      }
    }
  }
}

// The model's layouts: q, k, v slices of one projection row per token ([B, T, 2 H dk +
// H dv] viewed as heads), g and beta with a non-unit token stride. The kernels read them in
// place; the arithmetic is that of contiguous inputs, so every output and gradient must
// have the same bits.
TEST_F(GdrCorePrepGpu, StridedInputsGiveTheBitsOfContiguousInputs) {
  set_core_prep(GdrCorePrep::kKernel);
  set_core_impl(GdrCoreImpl::kKernel);
  const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta"};
  for (const int64_t T : {200, 2085, 130, 64}) {
    for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
      const int64_t B = 2, H = 3, dk = 128, dv = 64;
      const std::string context =
          "T" + std::to_string(T) + (dtype == at::kBFloat16 ? " bf16" : " fp32");
      const Inputs x = make_inputs(B, T, H, dk, dv, false, dtype, 5 + T);
      const at::Tensor w_o = at::randn({B, T, H, dv}, kCuda);
      const at::Tensor w_s = at::randn({B, H, dk, dv}, kCuda);
      const Results contiguous = run_core(x, w_o, w_s);

      // Rows 8 columns wider than q | k | v (strided reads), or exactly q | k | v: the
      // model's split, whose gradients the kernel writes as slices of one buffer (Note
      // [Gradients in the inputs' layout] in ops/gdr_core/chunk_prep_op.cc).
      for (const int64_t extra : {int64_t{8}, int64_t{0}}) {
        at::Tensor row = at::empty({B, T, H * (2 * dk + dv) + extra}, x.q.options());
        row.narrow(-1, 0, H * dk).copy_(x.q.reshape({B, T, H * dk}));
        row.narrow(-1, H * dk, H * dk).copy_(x.k.reshape({B, T, H * dk}));
        row.narrow(-1, 2 * H * dk, H * dv).copy_(x.v.reshape({B, T, H * dv}));
        Inputs strided;
        strided.q = row.narrow(-1, 0, H * dk).view({B, T, H, dk});
        strided.k = row.narrow(-1, H * dk, H * dk).view({B, T, H, dk});
        strided.v = row.narrow(-1, 2 * H * dk, H * dv).view({B, T, H, dv});
        strided.g = x.g.transpose(0, 1).contiguous().transpose(0, 1);
        strided.beta = x.beta.transpose(0, 1).contiguous().transpose(0, 1);
        ASSERT_FALSE(strided.q.is_contiguous() || strided.v.is_contiguous() ||
                     strided.g.is_contiguous());
        const Results got = run_core(strided, w_o, w_s);
        EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel) << context;
        EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kKernel) << context;
        EXPECT_TRUE(got[0].is_contiguous()) << context << " o";
        EXPECT_EQ(got[0].scalar_type(), dtype) << context << " o";
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_TRUE(bitwise_equal(got[i], contiguous[i]))
              << context << " extra " << extra << " " << names[i];
        }
      }
    }
  }
}

TEST_F(GdrCorePrepGpu, EnvironmentVariableAndFallBacks) {
  const Inputs ok = make_inputs(1, 100, 2, 64, 64, false, at::kFloat, 4);
  gated_delta_rule(ok.q, ok.k, ok.v, ok.g, ok.beta, 0.2);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel) << "default";
  const test_support::PolicyForTest policy("GDR_CORE_PREP", "kernel");
  gated_delta_rule(ok.q, ok.k, ok.v, ok.g, ok.beta, 0.2);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel) << "GDR_CORE_PREP=kernel";
  gated_delta_rule(ok.q.to(at::kBFloat16), ok.k.to(at::kBFloat16), ok.v.to(at::kBFloat16), ok.g,
                   ok.beta, 0.2);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel) << "BF16 inputs";
  gated_delta_rule(ok.q.to(at::kHalf), ok.k.to(at::kHalf), ok.v.to(at::kHalf), ok.g, ok.beta, 0.2);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel) << "FP16 inputs (cast to FP32)";
  const Inputs small_dk = make_inputs(1, 100, 2, 32, 64, false, at::kFloat, 3);
  gated_delta_rule_chunked(small_dk.q, small_dk.k, small_dk.v, small_dk.g, small_dk.beta, 0.2);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kAten) << "dk = 32";
  const Inputs wide = make_inputs(1, 100, 2, 256, 256, false, at::kFloat, 5);
  gated_delta_rule_chunked(wide.q, wide.k, wide.v, wide.g, wide.beta, 0.2);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel) << "dk = 256";
  const Inputs too_wide = make_inputs(1, 100, 1, 256, 640, false, at::kFloat, 6);
  gated_delta_rule_chunked(too_wide.q, too_wide.k, too_wide.v, too_wide.g, too_wide.beta, 0.2);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kAten) << "dk = 256, dv = 640";
  gated_delta_rule_chunked(ok.q, ok.k, ok.v, ok.g, ok.beta, 0.2, std::nullopt, false, 16);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kAten) << "chunk_size = 16";
  gated_delta_rule_chunked(ok.q.to(at::kDouble), ok.k.to(at::kDouble), ok.v.to(at::kDouble), ok.g,
                           ok.beta, 0.2);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kAten) << "FP64";
  EXPECT_EQ(test_support::policy_error("GDR_CORE_PREP", "fast"),
            "GDR_CORE_PREP: expected kernel or aten, but got 'fast'");
}

// ---------------------------------------------------------------------------
// The fused q / k L2 norm and head groups (Note [Fused q/k L2 norm])

struct FusedInputs {
  at::Tensor q, k, v, g, beta, initial_state;
  at::Tensor conv;  // the row q and k are slices of (kept alive)
};

// As the model hands them to the core: q, k raw (unnormalised) conv outputs, [B, T, Hk, dk]
// slices of one [B, T, 2 Hk dk + H dv] row per token (row norms ~0.1 .. 30, some tiny, one
// zero token), v [B, T, H, dv] (its own contiguous tensor, FP32 in the model), g, beta
// FP32.
FusedInputs make_fused_inputs(int64_t B, int64_t T, int64_t Hk, int64_t group, int64_t dk,
                              int64_t dv, at::ScalarType qk_dtype, at::ScalarType v_dtype,
                              bool initial_state, uint64_t seed) {
  at::manual_seed(seed);
  const auto f32 = kCuda.dtype(at::kFloat);
  const int64_t H = Hk * group;
  FusedInputs x;
  x.conv = at::randn({B, T, 2 * Hk * dk + H * dv}, f32).to(qk_dtype);
  at::Tensor qk = x.conv.narrow(-1, 0, 2 * Hk * dk).view({B, T, 2 * Hk, dk});
  qk.mul_((0.01 + 3.0 * at::rand({B, T, 2 * Hk, 1}, f32)).to(qk_dtype));
  qk.slice(1, 3, T, 7).mul_(1e-4);
  qk.select(1, T / 2).zero_();
  x.q = x.conv.narrow(-1, 0, Hk * dk).view({B, T, Hk, dk});
  x.k = x.conv.narrow(-1, Hk * dk, Hk * dk).view({B, T, Hk, dk});
  x.v = at::randn({B, T, H, dv}, f32).to(v_dtype);
  x.g = -2.0 * at::rand({B, T, H}, f32);
  x.beta = at::sigmoid(at::randn({B, T, H}, f32));
  if (initial_state) x.initial_state = 0.5 * at::randn({B, H, dk, dv}, f32);
  return x;
}

FusedInputs cpu64(const FusedInputs& x) {
  FusedInputs y;
  y.q = cpu64(x.q);
  y.k = cpu64(x.k);
  y.v = cpu64(x.v);
  y.g = cpu64(x.g);
  y.beta = cpu64(x.beta);
  y.initial_state = cpu64(x.initial_state);
  return y;
}

struct FusedCase {
  int64_t B, T, Hk, group, dk, dv;
  at::ScalarType qk_dtype, v_dtype;
  bool initial_state;
};

std::string describe(const FusedCase& c) {
  auto name = [](at::ScalarType t) { return t == at::kBFloat16 ? "bf16" : "fp32"; };
  return "B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " Hk" + std::to_string(c.Hk) +
         " H" + std::to_string(c.Hk * c.group) + " dk" + std::to_string(c.dk) + " dv" +
         std::to_string(c.dv) + " qk " + name(c.qk_dtype) + " v " + name(c.v_dtype) +
         (c.initial_state ? " S0" : "");
}

Results run_fused_op(const FusedInputs& x, double scale, const std::vector<at::Tensor>& up) {
  auto [u, w, qd, p, kend, g_last] = chunk_prep(x.q, x.k, x.v, x.g, x.beta, scale, 64, true);
  auto [dq, dk, dv, dg, dbeta] = chunk_prep_backward(up[0], up[1], up[2], up[3], up[4], up[5], x.q,
                                                     x.k, x.v, x.g, x.beta, u, w, scale, 64, true);
  return {u, w, qd, p, kend, g_last, dq, dk, dv, dg, dbeta};
}

std::vector<at::Tensor> make_fused_upstream(const FusedInputs& x) {
  const int64_t B = x.v.size(0), T = x.v.size(1), H = x.v.size(2), dk = x.q.size(3),
                dv = x.v.size(3), N = (T + 63) / 64;
  const auto f32 = kCuda.dtype(at::kFloat);
  return {at::randn({B, H, N, 64, dv}, f32), at::randn({B, H, N, 64, dk}, f32),
          at::randn({B, H, N, 64, dk}, f32), at::randn({B, H, N, 64, 64}, f32),
          at::randn({B, H, N, 64, dk}, f32), at::randn({B, H, N}, f32)};
}

TEST(ChunkPrepGpu, FusedNormAndHeadGroupsMatchTheFp64CpuReference) {
  const std::vector<FusedCase> cases = {
      {1, 2048, 8, 2, 128, 128, at::kBFloat16, at::kFloat, false},
      {1, 2085, 16, 1, 128, 128, at::kBFloat16, at::kFloat, false},
      {2, 200, 2, 4, 64, 128, at::kFloat, at::kFloat, false},
      {1, 130, 4, 1, 128, 64, at::kFloat, at::kFloat, false},
      {2, 70, 1, 4, 128, 96, at::kBFloat16, at::kBFloat16, false},
      // dk = 256: the norm's row dots over two column passes, with and without head groups.
      {1, 2085, 4, 2, 256, 256, at::kBFloat16, at::kFloat, false},
      {1, 130, 2, 1, 256, 128, at::kFloat, at::kFloat, false},
  };
  for (const FusedCase& c : cases) {
    const FusedInputs x = make_fused_inputs(c.B, c.T, c.Hk, c.group, c.dk, c.dv, c.qk_dtype,
                                            c.v_dtype, false, 31 + c.T + c.group);
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
    const std::vector<at::Tensor> up = make_fused_upstream(x);
    const Results got = run_fused_op(x, scale, up);
    std::vector<at::Tensor> up64;
    for (const at::Tensor& t : up) up64.push_back(cpu64(t));
    const Results ref = run_fused_op(cpu64(x), scale, up64);
    const at::ScalarType grad_types[] = {c.qk_dtype, c.qk_dtype, c.v_dtype};
    for (size_t i = 0; i < got.size(); ++i) {
      ASSERT_TRUE(got[i].is_cuda()) << describe(c) << " " << kOpNames[i];
      ASSERT_EQ(got[i].sizes(), ref[i].sizes()) << describe(c) << " " << kOpNames[i];
      const bool bf16_grad = i >= 6 && i <= 8 && grad_types[i - 6] == at::kBFloat16;
      if (i >= 6 && i <= 8) {
        EXPECT_EQ(got[i].scalar_type(), grad_types[i - 6]) << describe(c) << " " << kOpNames[i];
      }
      const double err = relative_error(got[i], ref[i]);
      std::printf("fused op %s %s: %.2e\n", describe(c).c_str(), kOpNames[i], err);
      // As the unfused op: FP32 against FP64 on the same (rounded) raw inputs (the norm's
      // FP32 sum of squares and rsqrtf add a few ulps); BF16 gradients rounded on the way out.
      EXPECT_LE(err, bf16_grad ? 8e-3 : 1e-4) << describe(c) << " " << kOpNames[i];
    }
  }
}

// The core with GdrQkNorm::kL2 through the prep kernel against the ATen prep (chunk_prep_qk
// + the ATen steps 1-6), both against FP64 on the CPU: outputs and the gradients of the raw
// q, k (in their dtype and [B, T, Hk, dk] shape), v, g, beta, initial_state.
Results run_fused_core(const FusedInputs& x, const at::Tensor& w_o, const at::Tensor& w_s) {
  std::vector<at::Tensor> leaves = {x.q, x.k, x.v, x.g, x.beta};
  if (x.initial_state.defined()) leaves.push_back(x.initial_state);
  for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
  std::optional<at::Tensor> initial;
  if (x.initial_state.defined()) initial = leaves[5];
  const double scale = 1.0 / std::sqrt(static_cast<double>(x.q.size(3)));
  auto [o, s] = gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                         scale, initial, true, kGdrChunkSize, GdrQkNorm::kL2);
  const at::Tensor loss =
      (o.to(w_o.scalar_type()) * w_o).sum() + (s.to(w_s.scalar_type()) * w_s).sum();
  Results out = {o.detach(), s.detach()};
  for (const at::Tensor& grad : torch::autograd::grad({loss}, leaves)) out.push_back(grad);
  return out;
}

TEST_F(GdrCorePrepGpu, FusedNormKernelPrepMatchesTheCompositeInOutputsAndGradients) {
  const std::vector<FusedCase> cases = {
      // The model's training combination (0.8B: Hk = H = 16), and H = 2 Hk, 4 Hk.
      {1, 2048, 16, 1, 128, 128, at::kBFloat16, at::kFloat, false},
      {1, 2048, 8, 2, 128, 128, at::kBFloat16, at::kFloat, false},
      {2, 300, 2, 4, 128, 128, at::kBFloat16, at::kFloat, true},
      {1, 130, 2, 2, 64, 64, at::kBFloat16, at::kFloat, true},
      {2, 2085, 2, 2, 128, 128, at::kFloat, at::kFloat, true},
      {1, 200, 1, 4, 64, 128, at::kFloat, at::kFloat, false},
      {1, 100, 2, 2, 128, 64, at::kBFloat16, at::kBFloat16, true},
      // dk = dv = 256: the whole core on the wide-head prep and the dk = 256 scan.
      {1, 2048, 4, 2, 256, 256, at::kBFloat16, at::kFloat, true},
  };
  const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  set_core_impl(GdrCoreImpl::kKernel);
  for (const FusedCase& c : cases) {
    const std::string context = describe(c);
    const FusedInputs x = make_fused_inputs(c.B, c.T, c.Hk, c.group, c.dk, c.dv, c.qk_dtype,
                                            c.v_dtype, c.initial_state, 13 + c.T + c.group);
    const int64_t H = c.Hk * c.group;
    const at::Tensor w_o = at::randn({c.B, c.T, H, c.dv}, kCuda);
    const at::Tensor w_s = at::randn({c.B, H, c.dk, c.dv}, kCuda);
    set_core_prep(GdrCorePrep::kKernel);
    const Results kernel = run_fused_core(x, w_o, w_s);
    EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel) << context;
    set_core_prep(GdrCorePrep::kAten);
    const Results aten = run_fused_core(x, w_o, w_s);
    EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kAten) << context;
    const Results exact = run_fused_core(cpu64(x), cpu64(w_o), cpu64(w_s));
    ASSERT_EQ(kernel.size(), exact.size());
    EXPECT_EQ(kernel[2].sizes(), x.q.sizes()) << context;
    EXPECT_EQ(kernel[2].scalar_type(), c.qk_dtype) << context;
    EXPECT_EQ(kernel[3].scalar_type(), c.qk_dtype) << context;
    EXPECT_EQ(kernel[0].scalar_type(), c.v_dtype) << context;
    for (size_t i = 0; i < kernel.size(); ++i) {
      ASSERT_EQ(kernel[i].sizes(), aten[i].sizes()) << context << " " << names[i];
      ASSERT_EQ(kernel[i].scalar_type(), aten[i].scalar_type()) << context << " " << names[i];
      const double err_kernel = relative_error(kernel[i], exact[i]);
      const double err_aten = relative_error(aten[i], exact[i]);
      const double err_between = relative_error(kernel[i], aten[i]);
      std::printf("fused %s %s: kernel %.2e, aten %.2e (vs FP64), kernel vs aten %.2e\n",
                  context.c_str(), names[i], err_kernel, err_aten, err_between);
      const bool rounded = (i == 0 && c.v_dtype == at::kBFloat16) ||
                           ((i == 2 || i == 3) && c.qk_dtype == at::kBFloat16) ||
                           (i == 4 && c.v_dtype == at::kBFloat16);
      if (rounded) {
        // Both compute in FP32 from the same inputs and round the result to BF16 once:
        // a last-bit flip of one rounding is ~4e-3 of an element; 1e-2 of max |x| stated.
        EXPECT_LE(err_between, 1e-2) << context << " " << names[i];
        EXPECT_LE(err_kernel, std::max(1e-2, 2.0 * err_aten)) << context << " " << names[i];
      } else {
        // FP32 with different summation orders (and rsqrtf against ATen's rsqrt): as
        // accurate as the composite (a factor 4 for rounding luck) and close to it.
        EXPECT_LE(err_kernel, std::max(1e-4, 4.0 * err_aten)) << context << " " << names[i];
        EXPECT_LE(err_between, 1e-3) << context << " " << names[i];
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Replays under load

// Runs `core` and `op` 100 times each, alternating, while another stream loads the GPU;
// counts the outputs of each that differ bitwise from `first_core` / `first_op`.
using ReplayMismatches = std::pair<int, int>;
ReplayMismatches replay_under_contention(const std::function<Results()>& core,
                                         const Results& first_core,
                                         const std::function<Results()>& op,
                                         const Results& first_op) {
  test_support::GpuContention load;
  ReplayMismatches mismatches{0, 0};
  for (int replay = 0; replay < 100; ++replay) {
    const Results c = core();
    for (size_t i = 0; i < c.size(); ++i)
      mismatches.first += bitwise_equal(c[i], first_core[i]) ? 0 : 1;
    const Results o = op();
    for (size_t i = 0; i < o.size(); ++i)
      mismatches.second += bitwise_equal(o[i], first_op[i]) ? 0 : 1;
  }
  return mismatches;
}

class GdrCorePrepReplays : public GdrCorePrepGpu,
                           public testing::WithParamInterface<at::ScalarType> {};

TEST_P(GdrCorePrepReplays, HundredReplaysAreBitwiseIdenticalWhileAnotherStreamLoadsTheGpu) {
  set_core_prep(GdrCorePrep::kKernel);
  set_core_impl(GdrCoreImpl::kKernel);
  // The training shape of one Qwen3.5-0.8B GDN layer: BF16 q/k/v (the benchmark's) and
  // FP32 (what the model hands the core after its FP32 L2 norm).
  const Inputs x = make_inputs(1, 2048, 16, 128, 128, false, GetParam(), 99);
  const at::Tensor w_o = at::randn({1, 2048, 16, 128}, kCuda);
  const at::Tensor w_s = at::randn({1, 16, 128, 128}, kCuda);
  const Results first_core = run_core(x, w_o, w_s);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel);
  const std::vector<at::Tensor> up = make_upstream(x, kCuda.dtype(at::kFloat));
  const Results first_op = run_op(x, 0.088, up);

  const ReplayMismatches mismatches =
      replay_under_contention([&] { return run_core(x, w_o, w_s); }, first_core,
                              [&] { return run_op(x, 0.088, up); }, first_op);
  const int core_mismatches = mismatches.first, op_mismatches = mismatches.second;
  EXPECT_EQ(op_mismatches, 0) << "the chunk prep op must give identical bits on every replay";
  EXPECT_EQ(core_mismatches, 0)
      << "gated_delta_rule_chunked (prep kernel, step 7 kernel) forward and gradients must give "
         "identical bits on every replay";
}

// The model's call on its training shapes: raw BF16 q, k read in place from the conv row,
// FP32 v, the L2 norm fused, H = Hk (0.8B) and H = 2 Hk (the per-value-head dq / dk
// partials and their ordered sum); the core forward and gradients and the op each way.
// And dk = dv = 256 (Note [Chunk prep wide-head backward]): 2 x 8 x 33 = 528 chunks, four
// per SM slot on an H200, walked through the per-block scratch slots, with the fused
// norm's two-pass row dots, head groups and an initial state.
struct FusedReplayCase {
  const char* name;
  int64_t B, T, Hk, group, d;
  bool initial_state;
  uint64_t seed;
};

class GdrCoreFusedNormReplays : public GdrCorePrepGpu,
                                public testing::WithParamInterface<FusedReplayCase> {};

TEST_P(GdrCoreFusedNormReplays, HundredReplaysAreBitwiseIdenticalWhileAnotherStreamLoadsTheGpu) {
  set_core_prep(GdrCorePrep::kKernel);
  set_core_impl(GdrCoreImpl::kKernel);
  const FusedReplayCase& c = GetParam();
  const int64_t H = c.Hk * c.group;
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.d));
  const FusedInputs x = make_fused_inputs(c.B, c.T, c.Hk, c.group, c.d, c.d, at::kBFloat16,
                                          at::kFloat, c.initial_state, c.seed);
  const at::Tensor w_o = at::randn({c.B, c.T, H, c.d}, kCuda);
  const at::Tensor w_s = at::randn({c.B, H, c.d, c.d}, kCuda);
  const Results first_core = run_fused_core(x, w_o, w_s);
  EXPECT_EQ(gdr_core_last_prep(), GdrCorePrep::kKernel);
  const std::vector<at::Tensor> up = make_fused_upstream(x);
  const Results first_op = run_fused_op(x, scale, up);

  const ReplayMismatches mismatches =
      replay_under_contention([&] { return run_fused_core(x, w_o, w_s); }, first_core,
                              [&] { return run_fused_op(x, scale, up); }, first_op);
  const int core_mismatches = mismatches.first, op_mismatches = mismatches.second;
  EXPECT_EQ(op_mismatches, 0) << "the fused chunk prep op must give identical bits on every replay";
  EXPECT_EQ(core_mismatches, 0)
      << "gated_delta_rule_chunked with GdrQkNorm::kL2 (prep kernel, step 7 kernel) forward "
         "and gradients must give identical bits on every replay";
}

INSTANTIATE_TEST_SUITE_P(Shapes, GdrCoreFusedNormReplays,
                         testing::Values(FusedReplayCase{"Group1", 1, 2048, 16, 1, 128, false, 77},
                                         FusedReplayCase{"Group2", 1, 2048, 8, 2, 128, false, 77},
                                         FusedReplayCase{"Dk256Group2", 2, 2085, 4, 2, 256, true,
                                                         79}),
                         [](const testing::TestParamInfo<FusedReplayCase>& info) {
                           return std::string(info.param.name);
                         });

INSTANTIATE_TEST_SUITE_P(Dtypes, GdrCorePrepReplays, testing::Values(at::kBFloat16, at::kFloat),
                         [](const testing::TestParamInfo<at::ScalarType>& info) {
                           return std::string(info.param == at::kFloat ? "Fp32" : "Bf16");
                         });

}  // namespace
}  // namespace gdr
