// The chunk prep kernels run on the CPU: kernels/gdr_core/chunk_prep_kernel.cuh is compiled as
// host code with stand-ins for the CUDA built-ins (one std::thread per CUDA thread, a
// barrier for __syncthreads, a per-block buffer for the dynamic shared memory, one block
// at a time), driven by the CUDA op's own code (chunk_prep_internal::forward_via_kernel /
// backward_via_kernel), and checked against the CPU reference op in FP64: the three head dims
// the kernels support, dv != dk, T not a multiple of 64 (a padded tail chunk), FP32 and
// BF16 inputs, absent upstream gradients, inputs read in place as strided views (q, k, v
// slices of one wider projection; g, beta transposed). The fused q / k L2 norm and head
// groups (raw q, k with Hk = H, H/2, H/4 key heads; BF16, FP16 and FP32 q / k with FP32 or
// BF16 v; zero and tiny rows; tails; conv-row slices) against an FP64 autograd statement
// of the spec, forward outputs and every gradient. This proves the kernels' indexing,
// barriers and shared-memory carve-up and the op's layouts on machines without a GPU;
// speed, streams, the device's rsqrtf / expf and the real hardware are the GPU test's
// business.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <pthread.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "kernels/gdr_core/chunk_prep.h"
#include "ops/gdr_core/chunk_prep_op.h"
#include "ops/gdr_core/gdr_core_op.h"

// Host stand-ins for the CUDA built-ins the kernel bodies use (and nothing else; see the
// NOTE in the .cuh): threadIdx, blockIdx, __syncthreads and the per-warp barriers from
// tests/ops/emulated_cuda.h, the tensor-core primitives (cvt.rna.tf32, the warp-collective
// mma.sync m16n8k8, counted in g_mma_count) from tests/ops/emulated_mma_tf32.h.
#include "tests/ops/emulated_cp_async.h"
#include "tests/ops/emulated_cuda.h"
#include "tests/ops/emulated_mma_tf32.h"

float __uint_as_float(unsigned bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
unsigned __float_as_uint(float f) {
  unsigned bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}
// The device's rsqrtf is approximate (<= 2 ulp); the host's correctly rounded stand-in
// can differ from it in the last bits, which the tolerances below cover.
float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

#define __device__
#define __forceinline__ inline
#define GDR_MMA_TF32_HOST_HELPERS
#define GDR_CP_ASYNC_HOST_HELPERS
#include "kernels/gdr_core/chunk_prep_kernel.cuh"
#undef GDR_CP_ASYNC_HOST_HELPERS
#undef GDR_MMA_TF32_HOST_HELPERS
#undef __device__
#undef __forceinline__

namespace gdr::kernels {
namespace {

using chunk_prep_detail::Bf16;

// Every block of the grid in turn, each with `threads` host threads (the kernel's block
// size: kChunkPrepForwardThreads or kChunkPrepBackwardThreads) and a fresh shared-memory
// buffer filled with NaN (so a read of a slot nobody wrote shows).
// `grid`: the blocks launched, when not one per chunk (the wide-head backward's slots).
template <typename Args, typename Body>
void run_grid(const Args& args, int64_t smem_floats, int threads, const Body& body,
              int64_t grid = 0) {
  const int64_t blocks = grid > 0 ? grid : args.shape.batch * args.shape.heads * args.shape.chunks;
  std::vector<float> smem(smem_floats);
  // The bodies read some shared rows as 16-byte vectors (ld.shared.v4 on the GPU, whose
  // dynamic shared memory is at least 16-byte aligned); the host buffer must match.
  ASSERT_EQ(reinterpret_cast<uintptr_t>(smem.data()) % 16, 0u);
  ASSERT_TRUE(threads % 32 == 0 && threads / 32 <= kMaxWarps) << threads;
  pthread_barrier_init(&g_block_barrier, nullptr, threads);
  const int warps = threads / 32;  // one emulated warp barrier per warp
  for (int w = 0; w < warps; ++w) pthread_barrier_init(&g_warp_barrier[w], nullptr, 32);
  for (int64_t b = 0; b < blocks; ++b) {
    std::fill(smem.begin(), smem.end(), NAN);
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, b, t] {
        blockIdx.x = static_cast<unsigned>(b);
        threadIdx.x = static_cast<unsigned>(t);
        body(args, smem.data());
      });
    }
    for (std::thread& thread : pool) thread.join();
  }
  for (int w = 0; w < warps; ++w) pthread_barrier_destroy(&g_warp_barrier[w]);
  pthread_barrier_destroy(&g_block_barrier);
}

// The variant the emulated launches may use, as GDR_CHUNK_PREP_TC in the op layer: false
// runs the FP32 SIMT products whatever args.shape.allow_tensor_cores says.
bool g_allow_tensor_cores = true;

// Whether the backward launcher would run the tensor-core variant for these args (the op
// layer's switch applied first, as ops/gdr_core/gdr_core_op_cuda.cc does).
bool emulated_tc(const ChunkPrepShape& s) {
  return chunk_prep_uses_tensor_cores(s.dk, s.dv, s.allow_tensor_cores && g_allow_tensor_cores);
}

// The launchers' dispatch (kernels/gdr_core/chunk_prep.cu) over the (q / k, v) type pairs and,
// for the backward, the two variants.
template <int Threads>
void emulate_forward_threads(const ChunkPrepForwardArgs& args) {
  const ChunkPrepShape& s = args.shape;
  ASSERT_TRUE(chunk_prep_supports_inputs(s.qk_input, s.v_input));
  const int64_t floats = chunk_prep_forward_smem_floats(s.dk, s.dv);
  using namespace chunk_prep_detail;
  if (s.qk_input == ChunkPrepInput::kFloat) {
    run_grid(args, floats, Threads, chunk_prep_forward_block<float, float, Threads>);
  } else if (s.v_input == ChunkPrepInput::kFloat) {
    run_grid(args, floats, Threads, chunk_prep_forward_block<Bf16, float, Threads>);
  } else {
    run_grid(args, floats, Threads, chunk_prep_forward_block<Bf16, Bf16, Threads>);
  }
}

// The launcher's choice of block size (kernels/gdr_core/chunk_prep.cu); the forward is SIMT in
// both variants.
void emulate_forward(const ChunkPrepForwardArgs& args) {
  if (chunk_prep_forward_threads(args.shape.dk, args.shape.dv) == kChunkPrepWideForwardThreads) {
    return emulate_forward_threads<kChunkPrepWideForwardThreads>(args);
  }
  emulate_forward_threads<kChunkPrepForwardThreads>(args);
}

// Scratch slots of the emulated wide-head backward (the CUDA op layer uses one per SM):
// two, so that with three or more chunks a block walks several and reuses its slot.
constexpr int64_t kEmulatedScratchSlots = 2;

template <int DK, bool TC>
void emulate_backward_dk(const ChunkPrepBackwardArgs& given) {
  const ChunkPrepShape& s = given.shape;
  const int64_t floats = chunk_prep_backward_smem_floats(s.dk, s.dv);
  using namespace chunk_prep_detail;
  ChunkPrepBackwardArgs args = given;
  // The wide-head backward's global scratch (Note [Chunk prep wide-head backward]), NaN
  // like the shared memory, as the CUDA op layer allocates it (ops/gdr_core/gdr_core_op_cuda.cc).
  std::vector<float> scratch;
  int64_t grid = 0;
  if (chunk_prep_backward_uses_scratch(s.dk)) {
    const int64_t chunks = s.batch * s.heads * s.chunks;
    args.scratch_slots = std::min(chunks, kEmulatedScratchSlots);
    scratch.assign(args.scratch_slots * chunk_prep_backward_scratch_floats(s.dk, s.dv) + 4, NAN);
    // 16-byte aligned, as the caching allocator's blocks are.
    float* base = scratch.data();
    while (reinterpret_cast<uintptr_t>(base) % 16 != 0) ++base;
    args.scratch = base;
    grid = args.scratch_slots;
  }
  if (s.qk_input == ChunkPrepInput::kFloat) {
    run_grid(args, floats, kChunkPrepBackwardThreads,
             chunk_prep_backward_grid<float, float, DK, TC>, grid);
  } else if (s.v_input == ChunkPrepInput::kFloat) {
    run_grid(args, floats, kChunkPrepBackwardThreads, chunk_prep_backward_grid<Bf16, float, DK, TC>,
             grid);
  } else {
    run_grid(args, floats, kChunkPrepBackwardThreads, chunk_prep_backward_grid<Bf16, Bf16, DK, TC>,
             grid);
  }
}

void emulate_backward(const ChunkPrepBackwardArgs& args) {
  ASSERT_TRUE(chunk_prep_supports(args.shape.dk, args.shape.dv));
  ASSERT_TRUE(chunk_prep_supports_inputs(args.shape.qk_input, args.shape.v_input));
  const bool tc = emulated_tc(args.shape);
  switch (args.shape.dk) {
    case 64: return tc ? emulate_backward_dk<64, true>(args) : emulate_backward_dk<64, false>(args);
    case 128:
      return tc ? emulate_backward_dk<128, true>(args) : emulate_backward_dk<128, false>(args);
    default:
      ASSERT_FALSE(tc) << "dk = 256 has no tensor-core variant";
      emulate_backward_dk<256, false>(args);
  }
}

struct Case {
  int64_t B, T, H, dk, dv;
  at::ScalarType dtype;
  bool all_grads;        // false: only dU, dP and dGlast given
  bool strided = false;  // q, k, v slices of one [B, T, H, 2 dk + dv + 8]; g, beta transposed
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_H" + std::to_string(c.H) +
         "_dk" + std::to_string(c.dk) + "_dv" + std::to_string(c.dv) + "_" +
         (c.dtype == at::kBFloat16 ? "bf16" : "fp32") + (c.all_grads ? "" : "_some_grads") +
         (c.strided ? "_strided" : "");
}

// max |x - ref| / max |ref|.
double relative_error(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kDouble);
  return (x.to(at::kDouble) - r).abs().max().item<double>() /
         (r.abs().max().item<double>() + 1e-30);
}

// Sets g_allow_tensor_cores for its lifetime.
class TensorCoresAllowed {
 public:
  explicit TensorCoresAllowed(bool allow) : previous_(g_allow_tensor_cores) {
    g_allow_tensor_cores = allow;
  }
  ~TensorCoresAllowed() { g_allow_tensor_cores = previous_; }

 private:
  bool previous_;
};

// Every case runs both variants (the second parameter: tensor cores allowed), against the
// same FP64 reference with the same bounds. The tensor-core variant's backward products
// (dM, dK, dQ) are 3xTF32 (Note [3xTF32 products] in kernels/common/mma_tf32.cuh): each product
// within ~2^-21 relative of the exact one per term, the level of the FP32 SIMT sums (2^-24 per
// fmaf, dv + dk terms), so the FP32-level bounds below hold for both; plain TF32 (~2^-11 = 5e-4
// relative per operand) is far outside them. g_mma_count proves which ran.
class ChunkPrepKernelEmulation : public ::testing::TestWithParam<std::tuple<Case, bool>> {};

TEST_P(ChunkPrepKernelEmulation, MatchesTheFp64ReferenceOpForwardAndBackward) {
  const Case c = std::get<0>(GetParam());
  const TensorCoresAllowed allowed(std::get<1>(GetParam()));
  // dk = 256 runs SIMT whatever the switch says (chunk_prep_uses_tensor_cores).
  const bool tc = chunk_prep_uses_tensor_cores(c.dk, c.dv, std::get<1>(GetParam()));
  g_mma_count = 0;
  at::manual_seed(c.T + c.dk + c.dv);
  at::Tensor q = at::randn({c.B, c.T, c.H, c.dk}), k = at::randn({c.B, c.T, c.H, c.dk});
  q = (q / q.norm(2, -1, true)).to(c.dtype);
  k = (k / k.norm(2, -1, true)).to(c.dtype);
  at::Tensor v = at::randn({c.B, c.T, c.H, c.dv}).to(c.dtype);
  at::Tensor g = -2.0 * at::rand({c.B, c.T, c.H});
  at::Tensor beta = at::sigmoid(at::randn({c.B, c.T, c.H}));
  if (c.strided) {
    // The same values as views the kernels must read in place: one wider row per token
    // and head holding q | k | v | 8 unused, and g, beta stored [T, B, H].
    at::Tensor wide = at::full({c.B, c.T, c.H, 2 * c.dk + c.dv + 8}, NAN, q.options());
    wide.narrow(-1, 0, c.dk).copy_(q);
    wide.narrow(-1, c.dk, c.dk).copy_(k);
    wide.narrow(-1, 2 * c.dk, c.dv).copy_(v);
    q = wide.narrow(-1, 0, c.dk);
    k = wide.narrow(-1, c.dk, c.dk);
    v = wide.narrow(-1, 2 * c.dk, c.dv);
    g = g.transpose(0, 1).contiguous().transpose(0, 1);
    beta = beta.transpose(0, 1).contiguous().transpose(0, 1);
    ASSERT_FALSE(q.is_contiguous() || v.is_contiguous() || (c.B > 1 && g.is_contiguous()));
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  const int64_t C = kChunkPrepChunk;

  // The reference sees the same (rounded) input values, in FP64.
  auto f64 = [](const at::Tensor& t) { return t.to(at::kDouble); };
  const auto ref = chunk_prep(f64(q), f64(k), f64(v), f64(g), f64(beta), scale, C);
  const auto got =
      chunk_prep_internal::forward_via_kernel(q, k, v, g, beta, scale, C, false, emulate_forward);
  const std::vector<at::Tensor> ref_out = {std::get<0>(ref), std::get<1>(ref), std::get<2>(ref),
                                           std::get<3>(ref), std::get<4>(ref), std::get<5>(ref)};
  const std::vector<at::Tensor> got_out = {std::get<0>(got), std::get<1>(got), std::get<2>(got),
                                           std::get<3>(got), std::get<4>(got), std::get<5>(got)};
  EXPECT_EQ(g_mma_count, 0) << "the forward is FP32 SIMT in both variants";
  const char* out_names[] = {"u", "w", "qd", "p", "kend", "g_last"};
  for (size_t i = 0; i < ref_out.size(); ++i) {
    ASSERT_EQ(got_out[i].sizes(), ref_out[i].sizes()) << out_names[i];
    EXPECT_EQ(got_out[i].scalar_type(), at::kFloat) << out_names[i];
    // FP32 sums of at most 128 terms and a 64-row substitution against FP64.
    EXPECT_LE(relative_error(got_out[i], ref_out[i]), 2e-5) << describe(c) << " " << out_names[i];
  }

  std::vector<std::optional<at::Tensor>> grads(6);
  for (size_t i = 0; i < 6; ++i) {
    if (c.all_grads || i == 0 || i == 3 || i == 5) grads[i] = at::randn(ref_out[i].sizes());
  }
  auto grad64 = [&](size_t i) -> std::optional<at::Tensor> {
    return grads[i] ? std::optional<at::Tensor>(f64(*grads[i])) : std::nullopt;
  };
  const auto ref_b =
      chunk_prep_backward(grad64(0), grad64(1), grad64(2), grad64(3), grad64(4), grad64(5), f64(q),
                          f64(k), f64(v), f64(g), f64(beta), ref_out[0], ref_out[1], scale, C);
  // The upstream dU with a transposed layout, as autograd may hand it over.
  std::optional<at::Tensor> du = grads[0];
  du = du->transpose(0, 1).contiguous().transpose(0, 1);
  const int64_t forward_mmas = g_mma_count;
  const auto got_b = chunk_prep_internal::backward_via_kernel(
      du, grads[1], grads[2], grads[3], grads[4], grads[5], q, k, v, g, beta, got_out[0],
      got_out[1], scale, C, false, emulate_backward);
  if (tc) {
    // Warp 0's mma count per block (the emulation counts warp 0's): phase 3 tiles 0, 16
    // over (dv + dk) / 8; phase 6 (Note [Chunk prep on tensor cores]) per 64-column pass 2
    // tiles of dK and of dQ over the C / 8 k-slices of K and 2 tiles of dK over those of Q;
    // three mma per 3xTF32 step. The Gram tiles (phase 1) are SIMT in both variants.
    const int64_t blocks = c.B * c.H * ((c.T + C - 1) / C);
    const int64_t per_block = 3 * (2 * (c.dv + c.dk) / 8 + (c.dk / 64) * (C / 8) * (2 * 2 + 2));
    EXPECT_EQ(g_mma_count - forward_mmas, blocks * per_block) << describe(c);
  }
  const std::vector<at::Tensor> rb = {std::get<0>(ref_b), std::get<1>(ref_b), std::get<2>(ref_b),
                                      std::get<3>(ref_b), std::get<4>(ref_b)};
  const std::vector<at::Tensor> gb = {std::get<0>(got_b), std::get<1>(got_b), std::get<2>(got_b),
                                      std::get<3>(got_b), std::get<4>(got_b)};
  const char* grad_names[] = {"dq", "dk", "dv", "dg", "dbeta"};
  const at::ScalarType grad_types[] = {c.dtype, c.dtype, c.dtype, at::kFloat, at::kFloat};
  for (size_t i = 0; i < rb.size(); ++i) {
    ASSERT_EQ(gb[i].sizes(), rb[i].sizes()) << grad_names[i];
    EXPECT_EQ(gb[i].scalar_type(), grad_types[i]) << grad_names[i];
    // BF16 gradients of q, k, v are rounded to 8 bits of mantissa on the way out.
    const double tol = grad_types[i] == at::kBFloat16 ? 8e-3 : 5e-5;
    EXPECT_LE(relative_error(gb[i], rb[i]), tol) << describe(c) << " " << grad_names[i];
  }
  if (c.dtype == at::kBFloat16) {
    // The same values as FP32 inputs run the same FP32 arithmetic; the kernel's own BF16
    // rounding of dq, dk, dv must then be bit for bit ATen's cast of the FP32 result.
    auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
    const auto fp32_b = chunk_prep_internal::backward_via_kernel(
        du, grads[1], grads[2], grads[3], grads[4], grads[5], f32(q), f32(k), f32(v), g, beta,
        got_out[0], got_out[1], scale, C, false, emulate_backward);
    const at::Tensor f[] = {std::get<0>(fp32_b), std::get<1>(fp32_b), std::get<2>(fp32_b)};
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::equal(f[i].to(at::kBFloat16), gb[i])) << describe(c) << " " << grad_names[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ChunkPrepKernelEmulation,
    ::testing::Combine(::testing::Values(Case{1, 100, 2, 64, 32, at::kFloat, true},
                                         Case{2, 64, 1, 64, 128, at::kFloat, false},
                                         Case{1, 70, 1, 128, 64, at::kFloat, true},
                                         Case{1, 130, 1, 128, 128, at::kBFloat16, true},
                                         Case{1, 30, 2, 64, 48, at::kBFloat16, false},
                                         Case{2, 70, 2, 64, 32, at::kFloat, true, true},
                                         Case{2, 130, 1, 128, 64, at::kBFloat16, true, true},
                                         // The model's head dims at the GPU test's T tails;
                                         // dv = 208 (dk 128) and 272 (dk 64) (the largest
                                         // supported at dk 128) take a second column per
                                         // thread in the forward's solve (dv + dk > 256
                                         // threads).
                                         Case{1, 200, 1, 128, 128, at::kFloat, true},
                                         Case{1, 2085, 1, 128, 128, at::kFloat, true},
                                         Case{1, 64, 2, 128, 128, at::kBFloat16, true},
                                         Case{2, 200, 1, 128, 128, at::kFloat, true, true},
                                         Case{2, 130, 1, 128, 128, at::kBFloat16, false, true},
                                         Case{1, 130, 1, 128, 208, at::kFloat, true},
                                         Case{1, 70, 1, 64, 272, at::kBFloat16, true},
                                         // The backward's extremes: dv + dk = 464 of its
                                         // 512 threads solving (dv = 400, the largest at
                                         // dk 64), and dv = 16, whose 4 groups of 4
                                         // columns leave half of phase 5's 8 parts of v
                                         // empty (400: 100 groups, parts of 12 and 13).
                                         Case{1, 30, 1, 64, 400, at::kFloat, true},
                                         Case{1, 70, 1, 64, 16, at::kFloat, true},
                                         // dk = 256, the wide-head backward (Note [Chunk
                                         // prep wide-head backward]): 2 slots walking 4
                                         // and 3 chunks (a tail), dv + dk = 512 and 576
                                         // (two solve columns for some threads), strided
                                         // BF16.
                                         Case{1, 200, 1, 256, 256, at::kFloat, true},
                                         Case{1, 130, 1, 256, 320, at::kFloat, false},
                                         Case{2, 70, 1, 256, 64, at::kBFloat16, true, true}),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<Case, bool>>& info) {
      return describe(std::get<0>(info.param)) + (std::get<1>(info.param) ? "_tc" : "_simt");
    });

// ---------------------------------------------------------------------------
// The fused q / k L2 norm and head groups (Note [Fused q/k L2 norm]): raw q, k with Hk
// key heads against an independent FP64 statement of the spec, autograd through the
// normalisation and the repeat.

struct FusedCase {
  int64_t B, T, Hk, group, dk, dv;
  at::ScalarType qk_dtype, v_dtype;
  bool l2 = true;
  bool strided = false;  // q, k slices of one conv-output row; v, g, beta non-contiguous
};

const char* dtype_name(at::ScalarType t) {
  return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : "fp32";
}

std::string describe(const FusedCase& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_Hk" + std::to_string(c.Hk) +
         "_H" + std::to_string(c.Hk * c.group) + "_dk" + std::to_string(c.dk) + "_dv" +
         std::to_string(c.dv) + "_qk_" + dtype_name(c.qk_dtype) + "_v_" + dtype_name(c.v_dtype) +
         (c.l2 ? "_l2" : "_no_l2") + (c.strided ? "_strided" : "");
}

// The spec, written out here rather than through gdr::chunk_prep_qk: each row of q and k
// scaled by (sum(x^2) + 1e-6)^-1/2, key head j repeated for value heads j G .. j G + G - 1,
// then steps 1-6 (chunk_prep_composite, the ATen reference of the op).
std::vector<at::Tensor> spec_outputs(const std::vector<at::Tensor>& x, int64_t group, bool l2,
                                     double scale) {
  auto rows = [&](const at::Tensor& t) {
    at::Tensor y = l2 ? t / (t.pow(2).sum(-1, true) + 1e-6).sqrt() : t;
    return y.repeat_interleave(group, 2);
  };
  const auto out =
      chunk_prep_composite(rows(x[0]), rows(x[1]), x[2], x[3], x[4], scale, kChunkPrepChunk);
  return {std::get<0>(out), std::get<1>(out), std::get<2>(out),
          std::get<3>(out), std::get<4>(out), std::get<5>(out)};
}

class ChunkPrepKernelEmulationFusedQk : public ::testing::TestWithParam<FusedCase> {};

TEST_P(ChunkPrepKernelEmulationFusedQk, MatchesTheFp64SpecWithAutogradThroughNormAndRepeat) {
  const FusedCase c = GetParam();
  const int64_t H = c.Hk * c.group;
  at::manual_seed(c.T + 7 * c.group + c.dk);
  // Raw rows as the causal conv hands them over: norms spread over ~0.1 .. 30; every 7th
  // token's rows are tiny (|x|^2 ~ 1e-6: the eps matters) and every 11th token's q row and
  // 13th token's k row are exactly zero (r = rsqrt(eps), xn = 0, no NaN). All rounded to
  // the input dtype first.
  auto raw_rows = [&](int64_t zero_every) {
    at::Tensor x = at::randn({c.B, c.T, c.Hk, c.dk}) * (0.01 + 3.0 * at::rand({c.B, c.T, c.Hk, 1}));
    x.slice(1, 3, c.T, 7).mul_(1e-4);
    x.slice(1, 5, c.T, zero_every).zero_();
    return x;
  };
  at::Tensor q = raw_rows(11), k = raw_rows(13);
  if (!c.l2) {  // without the fused norm the rows must already be unit vectors
    q = at::randn_like(q);
    k = at::randn_like(k);
    q = q / q.norm(2, -1, true);
    k = k / k.norm(2, -1, true);
  }
  q = q.to(c.qk_dtype);
  k = k.to(c.qk_dtype);
  at::Tensor v = at::randn({c.B, c.T, H, c.dv}).to(c.v_dtype);
  at::Tensor g = -2.0 * at::rand({c.B, c.T, H});
  at::Tensor beta = at::sigmoid(at::randn({c.B, c.T, H}));
  if (c.strided) {
    // The model's layout: q | k heads side by side in one conv-output row per token (NaN
    // in the unused tail), v a slice of its own wider row, g and beta stored [T, B, H].
    at::Tensor conv = at::full({c.B, c.T, 2 * c.Hk * c.dk + 24}, NAN, q.options());
    conv.narrow(-1, 0, c.Hk * c.dk).copy_(q.reshape({c.B, c.T, -1}));
    conv.narrow(-1, c.Hk * c.dk, c.Hk * c.dk).copy_(k.reshape({c.B, c.T, -1}));
    q = conv.narrow(-1, 0, c.Hk * c.dk).view({c.B, c.T, c.Hk, c.dk});
    k = conv.narrow(-1, c.Hk * c.dk, c.Hk * c.dk).view({c.B, c.T, c.Hk, c.dk});
    at::Tensor v_row = at::full({c.B, c.T, H, c.dv + 8}, NAN, v.options());
    v_row.narrow(-1, 0, c.dv).copy_(v);
    v = v_row.narrow(-1, 0, c.dv);
    g = g.transpose(0, 1).contiguous().transpose(0, 1);
    beta = beta.transpose(0, 1).contiguous().transpose(0, 1);
    ASSERT_FALSE(q.is_contiguous() || k.is_contiguous() || v.is_contiguous());
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  const int64_t C = kChunkPrepChunk;

  std::vector<at::Tensor> leaves = {q, k, v, g, beta};
  for (at::Tensor& t : leaves) t = t.detach().to(at::kDouble).requires_grad_(true);
  const std::vector<at::Tensor> ref = spec_outputs(leaves, c.group, c.l2, scale);
  const auto got =
      chunk_prep_internal::forward_via_kernel(q, k, v, g, beta, scale, C, c.l2, emulate_forward);
  const std::vector<at::Tensor> got_out = {std::get<0>(got), std::get<1>(got), std::get<2>(got),
                                           std::get<3>(got), std::get<4>(got), std::get<5>(got)};
  const char* out_names[] = {"u", "w", "qd", "p", "kend", "g_last"};
  for (size_t i = 0; i < ref.size(); ++i) {
    ASSERT_EQ(got_out[i].sizes(), ref[i].sizes()) << out_names[i];
    const double err = relative_error(got_out[i], ref[i]);
    std::printf("%s %s: %.2e\n", describe(c).c_str(), out_names[i], err);
    // FP32 sums of at most 128 terms, a 64-row substitution, and the norm's FP32 sum of
    // squares and reciprocal square root against FP64 (measured <= 2.7e-6 over the cases).
    EXPECT_LE(err, 1e-5) << describe(c) << " " << out_names[i];
  }

  std::vector<at::Tensor> up;
  for (const at::Tensor& t : ref) up.push_back(at::randn(t.sizes(), at::kDouble));
  at::Tensor loss = at::zeros({}, at::kDouble);
  for (size_t i = 0; i < ref.size(); ++i) loss = loss + (ref[i] * up[i]).sum();
  const auto ref_grads = torch::autograd::grad({loss}, leaves);
  auto f32 = [](const at::Tensor& t) { return std::optional<at::Tensor>(t.to(at::kFloat)); };
  auto backward = [&](const at::Tensor& qq, const at::Tensor& kk, const at::Tensor& vv) {
    const auto b = chunk_prep_internal::backward_via_kernel(
        f32(up[0]), f32(up[1]), f32(up[2]), f32(up[3]), f32(up[4]), f32(up[5]), qq, kk, vv, g, beta,
        got_out[0], got_out[1], scale, C, c.l2, emulate_backward);
    return std::vector<at::Tensor>{std::get<0>(b), std::get<1>(b), std::get<2>(b), std::get<3>(b),
                                   std::get<4>(b)};
  };
  const std::vector<at::Tensor> grads = backward(q, k, v);
  const char* grad_names[] = {"dq", "dk", "dv", "dg", "dbeta"};
  const at::ScalarType grad_types[] = {c.qk_dtype, c.qk_dtype, c.v_dtype, at::kFloat, at::kFloat};
  for (size_t i = 0; i < grads.size(); ++i) {
    ASSERT_EQ(grads[i].sizes(), leaves[i].sizes()) << grad_names[i];
    EXPECT_TRUE(grads[i].is_contiguous()) << grad_names[i];
    EXPECT_EQ(grads[i].scalar_type(), grad_types[i]) << grad_names[i];
    const double err = relative_error(grads[i], ref_grads[i]);
    std::printf("%s %s: %.2e\n", describe(c).c_str(), grad_names[i], err);
    // FP32: the steps' fixed-order sums, then the L2 backward's row dot (dk terms) and,
    // with head groups, the sum of G partials, a few ulps of max |dx| each (measured <=
    // 2.1e-6 over the cases). 16-bit gradients are rounded once on the way out (2^-9
    // relative to an element for BF16, 2^-12 for FP16, so ~4e-3 and ~5e-4 of max |dx|).
    const double tol = grad_types[i] == at::kBFloat16 ? 8e-3
                       : grad_types[i] == at::kHalf   ? 1e-3
                                                      : 1e-5;
    EXPECT_LE(err, tol) << describe(c) << " " << grad_names[i];
  }
  if (c.qk_dtype == at::kBFloat16) {
    // The same values as FP32 inputs run the same FP32 arithmetic; the 16-bit dq, dk must be
    // bit for bit ATen's cast of that FP32 result (written by the kernel itself when G = 1,
    // cast after the ordered partial sum when G > 1).
    auto to32 = [](const at::Tensor& t) { return t.to(at::kFloat); };
    const std::vector<at::Tensor> fp32 = backward(to32(q), to32(k), to32(v));
    for (int i = 0; i < 3; ++i) {
      EXPECT_TRUE(at::equal(fp32[i].to(grad_types[i]), grads[i]))
          << describe(c) << " " << grad_names[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, ChunkPrepKernelEmulationFusedQk,
    ::testing::Values(
        // The model's training combination: BF16 conv outputs read in place, FP32 v.
        FusedCase{1, 200, 2, 1, 128, 128, at::kBFloat16, at::kFloat, true, true},
        FusedCase{2, 130, 1, 2, 128, 64, at::kBFloat16, at::kFloat, true, true},
        FusedCase{1, 70, 1, 4, 128, 32, at::kBFloat16, at::kFloat, true, true},
        // FP32 (tight), both head dims, tails, G = 1, 2, 4.
        FusedCase{1, 100, 2, 1, 64, 32, at::kFloat, at::kFloat},
        FusedCase{1, 100, 1, 2, 64, 48, at::kFloat, at::kFloat},
        FusedCase{2, 64, 1, 4, 128, 128, at::kFloat, at::kFloat, true, true},
        FusedCase{1, 130, 2, 2, 128, 64, at::kFloat, at::kFloat},
        // BF16 q, k and v; FP16 q, k (through FP32); head groups without the norm.
        FusedCase{1, 30, 1, 4, 64, 48, at::kBFloat16, at::kBFloat16},
        FusedCase{1, 70, 1, 2, 64, 32, at::kHalf, at::kFloat, true, true},
        FusedCase{1, 100, 1, 2, 64, 32, at::kFloat, at::kFloat, false},
        FusedCase{1, 70, 2, 2, 128, 64, at::kBFloat16, at::kFloat, false, true},
        // dk = 256: the L2 norm's row dots over two column passes (raw rows parked in the
        // scratch slot), with and without head groups.
        FusedCase{1, 200, 1, 2, 256, 128, at::kBFloat16, at::kFloat, true, true},
        FusedCase{1, 130, 1, 1, 256, 256, at::kFloat, at::kFloat}),
    [](const ::testing::TestParamInfo<FusedCase>& info) { return describe(info.param); });

// Unit-norm q, k and v in `dtype`, decays g in (-2, 0], beta in (0, 1): the inputs of the
// layout and alignment tests below, from `seed`.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> random_inputs(
    uint64_t seed, int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, at::ScalarType dtype) {
  at::manual_seed(seed);
  at::Tensor q = at::randn({B, T, H, dk}), k = at::randn({B, T, H, dk});
  q = (q / q.norm(2, -1, true)).to(dtype);
  k = (k / k.norm(2, -1, true)).to(dtype);
  at::Tensor v = at::randn({B, T, H, dv}).to(dtype);
  at::Tensor g = -2.0 * at::rand({B, T, H});
  at::Tensor beta = at::sigmoid(at::randn({B, T, H}));
  return {q, k, v, g, beta};
}

// See Note [Gradients in the inputs' layout]: q, k, v as the consecutive column slices of one
// [B, T, 2 H dk + H dv] buffer (the model's split) get dq, dk, dv as the same slices of
// one new buffer, with the bits of the contiguous inputs' gradients; other layouts
// (contiguous inputs, or the slices in another order) keep separate contiguous gradients.
TEST(ChunkPrepKernelEmulation, SplitInputsGetTheirGradientsAsSlicesOfOneBuffer) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const int64_t B = 2, T = 70, H = 2, dk = 64, dv = 32, C = kChunkPrepChunk;
    const int64_t S = 2 * H * dk + H * dv;
    at::Tensor q, k, v, g, beta;  // (std::tie: lambdas below capture them)
    std::tie(q, k, v, g, beta) = random_inputs(11, B, T, H, dk, dv, dtype);
    const at::Tensor rows = at::cat(
        {q.reshape({B, T, H * dk}), k.reshape({B, T, H * dk}), v.reshape({B, T, H * dv})}, -1);
    const at::Tensor qs = rows.narrow(-1, 0, H * dk).view({B, T, H, dk});
    const at::Tensor ks = rows.narrow(-1, H * dk, H * dk).view({B, T, H, dk});
    const at::Tensor vs = rows.narrow(-1, 2 * H * dk, H * dv).view({B, T, H, dv});
    const double scale = 0.125;
    const auto fwd =
        chunk_prep_internal::forward_via_kernel(q, k, v, g, beta, scale, C, true, emulate_forward);
    const at::Tensor du = at::randn(std::get<0>(fwd).sizes());
    const at::Tensor dp = at::randn(std::get<3>(fwd).sizes());
    auto backward = [&](const at::Tensor& bq, const at::Tensor& bk, const at::Tensor& bv) {
      return chunk_prep_internal::backward_via_kernel(
          du, std::nullopt, std::nullopt, dp, std::nullopt, std::nullopt, bq, bk, bv, g, beta,
          std::get<0>(fwd), std::get<1>(fwd), scale, C, true, emulate_backward);
    };
    const auto want = backward(q, k, v);
    const auto got = backward(qs, ks, vs);
    const at::Tensor dq = std::get<0>(got), dk_ = std::get<1>(got), dv_ = std::get<2>(got);
    EXPECT_TRUE(at::equal(dq, std::get<0>(want))) << dtype;
    EXPECT_TRUE(at::equal(dk_, std::get<1>(want))) << dtype;
    EXPECT_TRUE(at::equal(dv_, std::get<2>(want))) << dtype;
    EXPECT_TRUE(at::equal(std::get<3>(got), std::get<3>(want))) << dtype;
    EXPECT_TRUE(at::equal(std::get<4>(got), std::get<4>(want))) << dtype;
    EXPECT_EQ(dq.stride(1), S) << "dq is a column slice of one [B, T, S] buffer";
    EXPECT_EQ(static_cast<const char*>(dk_.data_ptr()),
              static_cast<const char*>(dq.data_ptr()) + H * dk * dq.element_size());
    EXPECT_EQ(static_cast<const char*>(dv_.data_ptr()),
              static_cast<const char*>(dk_.data_ptr()) + H * dk * dk_.element_size());
    EXPECT_TRUE(std::get<0>(want).is_contiguous() && std::get<2>(want).is_contiguous());
    // k's slice passed as q and q's as k: not the split's order, so separate contiguous
    // gradients, with the bits of the same inputs passed contiguous.
    const auto swapped = backward(ks, qs, vs);
    const auto swapped_want = backward(k, q, v);
    EXPECT_TRUE(std::get<0>(swapped).is_contiguous()) << dtype;
    for (int i = 0; i < 3; ++i) {
      const at::Tensor a = i == 0   ? std::get<0>(swapped)
                           : i == 1 ? std::get<1>(swapped)
                                    : std::get<2>(swapped);
      const at::Tensor b = i == 0   ? std::get<0>(swapped_want)
                           : i == 1 ? std::get<1>(swapped_want)
                                    : std::get<2>(swapped_want);
      EXPECT_TRUE(at::equal(a, b)) << dtype << " gradient " << i;
    }
  }
}

// The backward's 16-byte paths (the [dU | dW] panel copied into shared memory with
// cp.async, phase 5's four-value loads of v, dQd and dKend) need 16-byte (BF16 v: 8-byte)
// aligned rows. Operands one element past such a boundary take the 4-byte copies and the
// one-value loads instead and must give the same bits (contiguous views pass through the
// op as they are, so the kernel sees the misaligned pointers).
TEST(ChunkPrepKernelEmulation, MisalignedOperandsGetTheBitsOfAlignedOnes) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    const int64_t B = 1, T = 100, H = 2, dk = 64, dv = 48, C = kChunkPrepChunk;
    at::Tensor q, k, v, g, beta;  // (std::tie: lambdas below capture them)
    std::tie(q, k, v, g, beta) = random_inputs(5, B, T, H, dk, dv, dtype);
    const double scale = 0.125;
    const auto fwd =
        chunk_prep_internal::forward_via_kernel(q, k, v, g, beta, scale, C, false, emulate_forward);
    std::vector<at::Tensor> grads;
    for (const at::Tensor& out : {std::get<0>(fwd), std::get<1>(fwd), std::get<2>(fwd),
                                  std::get<3>(fwd), std::get<4>(fwd), std::get<5>(fwd)}) {
      grads.push_back(at::randn(out.sizes()));
    }
    // The same values, contiguous, starting one element past an aligned address.
    auto shifted = [](const at::Tensor& t) {
      const at::Tensor view = at::empty({t.numel() + 1}, t.options()).narrow(0, 1, t.numel());
      return view.view(t.sizes()).copy_(t);
    };
    auto backward = [&](const at::Tensor& bv, const at::Tensor& du, const at::Tensor& dw,
                        const at::Tensor& dqd, const at::Tensor& dkend) {
      return chunk_prep_internal::backward_via_kernel(
          du, dw, dqd, grads[3], dkend, grads[5], q, k, bv, g, beta, std::get<0>(fwd),
          std::get<1>(fwd), scale, C, false, emulate_backward);
    };
    const auto want = backward(v, grads[0], grads[1], grads[2], grads[4]);
    const at::Tensor sv = shifted(v), sdu = shifted(grads[0]), sdw = shifted(grads[1]);
    const at::Tensor sdqd = shifted(grads[2]), sdkend = shifted(grads[4]);
    for (const at::Tensor& t : {sv, sdu, sdw, sdqd, sdkend}) {
      ASSERT_TRUE(t.is_contiguous());
      ASSERT_NE(reinterpret_cast<uintptr_t>(t.data_ptr()) % (4 * t.element_size()), 0u);
    }
    const auto got = backward(sv, sdu, sdw, sdqd, sdkend);
    EXPECT_TRUE(at::equal(std::get<0>(got), std::get<0>(want))) << dtype << " dq";
    EXPECT_TRUE(at::equal(std::get<1>(got), std::get<1>(want))) << dtype << " dk";
    EXPECT_TRUE(at::equal(std::get<2>(got), std::get<2>(want))) << dtype << " dv";
    EXPECT_TRUE(at::equal(std::get<3>(got), std::get<3>(want))) << dtype << " dg";
    EXPECT_TRUE(at::equal(std::get<4>(got), std::get<4>(want))) << dtype << " dbeta";
  }
}

// Note [Blocked back substitution]: the blocked solve on a column in place sums every row's
// terms in the register solve's order, so the two give the same bits (here on random unit
// upper triangular systems with terms of both signs, the column at a pitch of 7 floats).
TEST(ChunkPrepKernelEmulation, BlockedBackSubstitutionHasTheRegisterSolvesBits) {
  using namespace chunk_prep_detail;
  constexpr int C = kChunkPrepChunk, kPitch = 7;
  at::manual_seed(3);
  for (int trial = 0; trial < 20; ++trial) {
    // mt[i * C + j] = M_ji (the layout phase 2 reads), only j > i used.
    const at::Tensor mt = at::randn({C, C}) * 0.1;
    const at::Tensor rhs = at::randn({C}) * (trial + 1);
    std::vector<float> m_buffer(C * C);
    std::memcpy(m_buffer.data(), mt.data_ptr<float>(), sizeof(float) * C * C);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(m_buffer.data()) % 16, 0u);
    float x[C];
    std::vector<float> column(C * kPitch, NAN);
    for (int i = 0; i < C; ++i) x[i] = column[i * kPitch] = rhs[i].item<float>();
    back_substitute(m_buffer.data(), x);
    back_substitute_blocked(m_buffer.data(), column.data(), kPitch);
    for (int i = 0; i < C; ++i) {
      ASSERT_TRUE(std::isfinite(x[i])) << "trial " << trial << " row " << i;
      EXPECT_EQ(__float_as_uint(column[i * kPitch]), __float_as_uint(x[i]))
          << "trial " << trial << " row " << i << ": " << column[i * kPitch] << " vs " << x[i];
    }
  }
}

TEST(ChunkPrepKernelEmulation, UnsupportedShapesAreRefusedNamingThem) {
  const at::Tensor q = at::randn({1, 10, 1, 32}), v = at::randn({1, 10, 1, 64});
  const at::Tensor g = at::zeros({1, 10, 1});
  try {
    chunk_prep_internal::forward_via_kernel(q, q, v, g, g, 1.0, 64, false, emulate_forward);
    FAIL() << "dk = 32 must be refused";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "chunk_prep: the CUDA implementation expects dk in {64, 128, 256} and dv a multiple "
              "of 16 within the shared-memory limit (dv <= 400, 208, 624 at dk = 64, 128, 256) "
              "but got dk = 32, dv = 64");
  }
  // The limits the message states, at their edges.
  EXPECT_TRUE(chunk_prep_supports(64, 400));
  EXPECT_FALSE(chunk_prep_supports(64, 416));
  EXPECT_TRUE(chunk_prep_supports(128, 208));
  EXPECT_FALSE(chunk_prep_supports(128, 224));
  EXPECT_TRUE(chunk_prep_supports(256, 624));
  EXPECT_FALSE(chunk_prep_supports(256, 640));
  EXPECT_FALSE(chunk_prep_supports(256, 120));  // dv a multiple of 16
  // The forward runs 512 threads where two blocks would not fit an SM: dk = 256 only.
  EXPECT_EQ(chunk_prep_forward_threads(64, 400), kChunkPrepForwardThreads);
  EXPECT_EQ(chunk_prep_forward_threads(128, 208), kChunkPrepForwardThreads);
  EXPECT_EQ(chunk_prep_forward_threads(256, 16), kChunkPrepWideForwardThreads);
}

}  // namespace
}  // namespace gdr::kernels
