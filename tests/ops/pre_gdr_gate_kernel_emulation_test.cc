// The pre-GDR gate kernels run on the CPU: kernels/pre_gdr_gate_kernel.cuh is compiled as
// host code with stand-ins for the CUDA built-ins (one std::thread per CUDA thread, a
// barrier for __syncthreads, a NaN-filled buffer for the shared memory, one block at a
// time), launched with the plans of the real launchers (plan_gate_forward /
// plan_gate_backward), and checked
//   - against the CPU reference op (FP32 math, FP64 sums) within stated tolerances, for
//     FP32 / BF16 / FP16 inputs, Hv in {1, 12, 16, 20, 64}, token tails, and every kernel
//     path: vector loads, the strided fallback (stride_h != 1, misaligned rows) and the
//     token split (non-token-linear layouts);
//   - bit for bit across those paths (the layout never changes a result bit);
//   - bit for bit against the documented summation order of Note [Gate head vectors]
//     (per-row token order, then the fixed tree), recomputed here with the same scalar
//     functions, for the ordered partial rows, and for the ordered second pass;
//   - the fast softplus / sigmoid of Note [Gate fast math] against FP64 over the range.
// The atomics of the default mode and the single-pass ticket live in the .cu wrappers and
// are the GPU test's business, as are speed and streams.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/pre_gdr_gate.h"
#include "ops/pre_gdr_gate.h"

// Host stand-ins for the CUDA built-ins the kernel bodies use (and nothing else; see the
// NOTE in the .cuh).
struct EmulatedIndex {
  unsigned x = 0, y = 0, z = 0;
};
thread_local EmulatedIndex threadIdx, blockIdx;
pthread_barrier_t g_block_barrier;
void __syncthreads() { pthread_barrier_wait(&g_block_barrier); }
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
template <typename T>
T __ldg(const T* p) {
  return *p;
}
float __uint_as_float(unsigned bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
unsigned __umulhi(unsigned a, unsigned b) {
  return static_cast<unsigned>((static_cast<uint64_t>(a) * b) >> 32);
}

namespace gdr::kernels {
// The four primitives of the .cuh: exact reciprocal (the GPU's rcp.approx is within one
// ulp of it) and c10's round-to-nearest-even conversions (the GPU's cvt.rn).
float gate_fast_rcp(float x) { return 1.0f / x; }
unsigned gate_pack_bf16x2(float lo, float hi) {
  return static_cast<unsigned>(c10::BFloat16(lo).x) |
         (static_cast<unsigned>(c10::BFloat16(hi).x) << 16);
}
unsigned gate_pack_half2(float lo, float hi) {
  return static_cast<unsigned>(c10::Half(lo).x) | (static_cast<unsigned>(c10::Half(hi).x) << 16);
}
float gate_half_to_float(unsigned bits) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(bits), c10::Half::from_bits()));
}
}  // namespace gdr::kernels

#define __device__
#define __forceinline__ inline
#include "kernels/pre_gdr_gate_kernel.cuh"
#undef __device__
#undef __forceinline__

namespace gdr::kernels {
namespace {

using gate_detail::Bf16;
using gate_detail::Half;

// ---------------------------------------------------------------------------
// The emulated launch: every block of the grid in turn, `threads` host threads each.

template <typename Body>
void run_grid(int64_t grid_x, int64_t grid_y, int threads, int64_t smem_floats, const Body& body) {
  std::vector<float> smem(static_cast<size_t>(smem_floats));
  pthread_barrier_init(&g_block_barrier, nullptr, static_cast<unsigned>(threads));
  for (int64_t by = 0; by < grid_y; ++by) {
    for (int64_t bx = 0; bx < grid_x; ++bx) {
      std::fill(smem.begin(), smem.end(), NAN);
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, bx, by, t] {
          blockIdx.x = static_cast<unsigned>(bx);
          blockIdx.y = static_cast<unsigned>(by);
          threadIdx.x = static_cast<unsigned>(t);
          body(smem.data());
        });
      }
      for (std::thread& thread : pool) thread.join();
    }
  }
  pthread_barrier_destroy(&g_block_barrier);
}

template <typename Fn>
void dispatch(ScalarKind kind, int vec, bool split, Fn&& fn) {
  auto with_vec = [&](auto in_tag) {
    auto with_split = [&](auto vec_tag) {
      if (split) {
        fn(in_tag, vec_tag, std::true_type{});
      } else {
        fn(in_tag, vec_tag, std::false_type{});
      }
    };
    if (vec == 8) return with_split(std::integral_constant<int, 8>{});
    if (vec == 4) return with_split(std::integral_constant<int, 4>{});
    with_split(std::integral_constant<int, 1>{});
  };
  if (kind == ScalarKind::kFloat32) return with_vec(float{});
  if (kind == ScalarKind::kFloat16) return with_vec(Half{});
  with_vec(Bf16{});
}

void emulate_forward(const GateForwardPlan& plan) {
  dispatch(plan.input_kind, plan.vec, plan.split, [&](auto in_tag, auto vec_tag, auto split_tag) {
    using In = decltype(in_tag);
    constexpr int V = decltype(vec_tag)::value;
    constexpr bool kSplit = decltype(split_tag)::value;
    run_grid(plan.grid, 1, plan.block_x * plan.block_y, 2 * kForwardTableHeads,
             [&](float* smem) { gate_detail::gate_forward_block<In, V, kSplit>(plan, smem); });
  });
}

// The ordered mode's first pass: one partial row per token-program.
void emulate_backward(const GateBackwardPlan& plan, float* partials) {
  const GateBackwardLaunch& launch = plan.launch;
  dispatch(plan.input_kind, launch.vec, plan.split, [&](auto in_tag, auto vec_tag, auto split_tag) {
    using In = decltype(in_tag);
    constexpr int V = decltype(vec_tag)::value;
    constexpr bool kSplit = decltype(split_tag)::value;
    run_grid(launch.num_programs(), 1, launch.threads, launch.shared_bytes / 4, [&](float* smem) {
      float total_A_log[V], total_dt_bias[V];
      int h0 = 0;
      if (gate_detail::gate_backward_program<In, V, kSplit>(plan, smem, total_A_log, total_dt_bias,
                                                            h0)) {
        gate_detail::gate_write_partial_row<V>(partials, plan, h0, total_A_log, total_dt_bias);
      }
    });
  });
}

void emulate_reduce(const float* partials, int64_t programs_t, int64_t heads, ScalarKind kind,
                    void* dA_log, void* ddt_bias) {
  const int64_t blocks = (2 * heads + kReduceSlotsPerBlock - 1) / kReduceSlotsPerBlock;
  run_grid(blocks, 1, kReduceSlotsPerBlock * kReduceRows, kReduceRows * kReduceSlotsPerBlock,
           [&](float* smem) {
             gate_detail::gate_reduce_partials_block(partials, programs_t, heads, kind, dA_log,
                                                     ddt_bias, smem);
           });
}

// ---------------------------------------------------------------------------
// Operands and layouts

ScalarKind kind_of(at::ScalarType t) {
  return t == at::kFloat  ? ScalarKind::kFloat32
         : t == at::kHalf ? ScalarKind::kFloat16
                          : ScalarKind::kBFloat16;
}

StridedOperand operand_of(const at::Tensor& t) {
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

// The same values in another memory layout: the paths the planner can choose.
enum class Layout { kContiguous, kSliced, kMisaligned, kSequenceMajor, kHeadStrided };
const char* name_of(Layout layout) {
  switch (layout) {
    case Layout::kContiguous: return "contiguous";
    case Layout::kSliced: return "sliced";
    case Layout::kMisaligned: return "misaligned";
    case Layout::kSequenceMajor: return "sequence_major";
    case Layout::kHeadStrided: return "head_strided";
  }
  return "?";
}

at::Tensor relayout(const at::Tensor& x, Layout layout) {
  const int64_t B = x.size(0), S = x.size(1), H = x.size(2);
  switch (layout) {
    case Layout::kContiguous: return x.contiguous();
    case Layout::kSliced: {  // a slice of a wider projection, as in the model
      at::Tensor wide = at::zeros({B, S, 3 * H}, x.options());
      wide.narrow(2, H, H).copy_(x);
      return wide.narrow(2, H, H);
    }
    case Layout::kMisaligned: {  // rows one element off any vector boundary
      at::Tensor wide = at::zeros({B, S, H + 1}, x.options());
      wide.narrow(2, 1, H).copy_(x);
      return wide.narrow(2, 1, H);
    }
    case Layout::kSequenceMajor: return x.transpose(0, 1).contiguous().transpose(0, 1);
    case Layout::kHeadStrided: {  // every other column
      at::Tensor wide = at::zeros({B, S, 2 * H}, x.options());
      wide.slice(2, 0, 2 * H, 2).copy_(x);
      return wide.slice(2, 0, 2 * H, 2);
    }
  }
  return x;
}

const std::vector<Layout>& all_layouts() {
  static const std::vector<Layout> layouts = {Layout::kContiguous, Layout::kSliced,
                                              Layout::kMisaligned, Layout::kSequenceMajor,
                                              Layout::kHeadStrided};
  return layouts;
}

bool same_bits(const at::Tensor& x, const at::Tensor& y) {
  if (x.sizes() != y.sizes() || x.scalar_type() != y.scalar_type()) return false;
  return std::memcmp(x.contiguous().data_ptr(), y.contiguous().data_ptr(), x.nbytes()) == 0;
}

// max |x - ref| - rtol |ref| over the elements; <= atol passes.
double excess_error(const at::Tensor& x, const at::Tensor& ref, double rtol) {
  const at::Tensor r = ref.to(at::kDouble);
  return ((x.to(at::kDouble) - r).abs() - rtol * r.abs()).max().item<double>();
}

struct Inputs {
  at::Tensor a, b, A_log, dt_bias, grad_g, grad_beta;
};

Inputs make_inputs(int64_t B, int64_t S, int64_t H, at::ScalarType in, at::ScalarType param) {
  at::manual_seed(B * 1000 + S * 10 + H);
  Inputs x;
  at::Tensor a = at::randn({B, S, H}) * 4;
  // Every softplus regime: far below, around and above the threshold of 20.
  const float specials[] = {23.0f, -45.0f, 19.5f, 20.5f, 0.0f, -18.0f, 60.0f, -90.0f};
  for (int64_t i = 0; i < std::min<int64_t>(8, a.numel()); ++i) {
    a.view({-1})[i * 7 % a.numel()] = specials[i];
  }
  x.a = a.to(in);
  at::Tensor b = at::randn({B, S, H}) * 4;
  if (b.numel() > 3) {
    b.view({-1})[1] = 30.0f;
    b.view({-1})[2] = -95.0f;
  }
  x.b = b.to(in);
  x.A_log = at::log(at::rand({H}) * 15.99 + 0.01).to(param);
  x.dt_bias = (at::randn({H}) * 0.5 + 1).to(param);
  x.grad_g = at::randn({B, S, H});
  x.grad_beta = at::randn({B, S, H});
  return x;
}

std::string describe(int64_t B, int64_t S, int64_t H, at::ScalarType in) {
  return std::string(c10::toString(in)) + " [" + std::to_string(B) + "," + std::to_string(S) + "," +
         std::to_string(H) + "]";
}

// ---------------------------------------------------------------------------
// Note [Gate fast math] against FP64.

TEST(GateFastMath, SoftplusItsDerivativeAndSigmoidStayWithin1e6OfFp64) {
  double worst_sp = 0, worst_grad = 0, worst_sig = 0;
  for (int i = -2000000; i <= 2000000; ++i) {
    const float pre = static_cast<float>(i) * 5e-5f;  // [-100, 100]
    float sp = 0, grad = 0;
    gate_detail::gate_softplus_and_grad_fast(pre, sp, grad);
    ASSERT_EQ(sp, gate_detail::gate_softplus_fast(pre)) << pre;
    const double p = pre;
    const double ref_sp = p > 20 ? p : std::log1p(std::exp(p));
    const double ref_grad = p > 20 ? 1.0 : 1.0 / (1.0 + std::exp(-p));
    const double ref_sig = 1.0 / (1.0 + std::exp(-p));
    // Relative error; values below 1e-30 (FP32 denormal range of exp) are skipped.
    if (ref_sp > 1e-30) worst_sp = std::max(worst_sp, std::abs(sp - ref_sp) / ref_sp);
    if (ref_grad > 1e-30) worst_grad = std::max(worst_grad, std::abs(grad - ref_grad) / ref_grad);
    const float sig = gate_detail::gate_sigmoid_fast(pre);
    if (ref_sig > 1e-30) worst_sig = std::max(worst_sig, std::abs(sig - ref_sig) / ref_sig);
  }
  // On the GPU, expf (2 ulp) and rcp.approx (1 ulp) add at most ~3e-7 to these.
  EXPECT_LT(worst_sp, 7e-7);
  EXPECT_LT(worst_grad, 7e-7);
  EXPECT_LT(worst_sig, 7e-7);
  std::printf(
      "fast math, max relative error vs FP64: softplus %.3g, softplus' %.3g, sigmoid %.3g\n",
      worst_sp, worst_grad, worst_sig);
  // The threshold and the special values follow PyTorch exactly.
  float sp = 0, grad = 0;
  gate_detail::gate_softplus_and_grad_fast(20.5f, sp, grad);
  EXPECT_EQ(sp, 20.5f);
  EXPECT_EQ(grad, 1.0f);
  gate_detail::gate_softplus_and_grad_fast(-INFINITY, sp, grad);
  EXPECT_EQ(sp, 0.0f);
  EXPECT_EQ(grad, 0.0f);
  gate_detail::gate_softplus_and_grad_fast(NAN, sp, grad);
  EXPECT_TRUE(std::isnan(sp));
  EXPECT_TRUE(std::isnan(grad));
  EXPECT_EQ(gate_detail::gate_sigmoid_fast(-INFINITY), 0.0f);
  EXPECT_EQ(gate_detail::gate_sigmoid_fast(INFINITY), 1.0f);
}

// ---------------------------------------------------------------------------
// Forward

struct ForwardCase {
  int64_t B, S, H;
  at::ScalarType in, param;
};

class GateForwardEmulation : public testing::TestWithParam<ForwardCase> {};

TEST_P(GateForwardEmulation, MatchesTheCpuOpOnEveryPathAndEveryPathGivesTheSameBits) {
  const ForwardCase& c = GetParam();
  const Inputs x = make_inputs(c.B, c.S, c.H, c.in, c.param);
  const auto [ref_g, ref_beta] = pre_gdr_gate(x.a, x.b, x.A_log, x.dt_bias);
  at::Tensor first_g, first_beta;
  bool saw_vector = false, saw_scalar = false, saw_split = false;
  for (Layout layout : all_layouts()) {
    const at::Tensor a = relayout(x.a, layout), b = relayout(x.b, layout);
    at::Tensor g = at::empty({c.B, c.S, c.H}), beta = at::empty({c.B, c.S, c.H});
    GateForwardArgs args;
    args.shape = {c.B, c.S, c.H};
    args.input_kind = kind_of(c.in);
    args.param_kind = kind_of(c.param);
    args.a = operand_of(a);
    args.b = operand_of(b);
    args.A_log = x.A_log.data_ptr();
    args.dt_bias = x.dt_bias.data_ptr();
    args.g = g.data_ptr<float>();
    args.beta = beta.data_ptr<float>();
    const GateForwardPlan plan = plan_gate_forward(args);
    saw_vector |= plan.a.vector;
    saw_scalar |= !plan.a.vector;
    saw_split |= plan.split;
    emulate_forward(plan);
    const std::string context = describe(c.B, c.S, c.H, c.in) + " " + name_of(layout);
    // FP32 math on both sides; ours within 1e-6 of FP64 (GateFastMath), the reference's
    // expf / log1pf within a few ulps.
    EXPECT_LE(excess_error(g, ref_g, 2e-6), 1e-30) << context << " g";
    EXPECT_LE(excess_error(beta, ref_beta, 2e-6), 1e-30) << context << " beta";
    if (!first_g.defined()) {
      first_g = g;
      first_beta = beta;
    } else {
      EXPECT_TRUE(same_bits(g, first_g)) << context << ": g differs from the contiguous layout";
      EXPECT_TRUE(same_bits(beta, first_beta)) << context << ": beta differs";
    }
  }
  EXPECT_TRUE(saw_scalar);
  EXPECT_EQ(saw_vector, c.H % 4 == 0) << "vector loads whenever Hv allows them";
  EXPECT_EQ(saw_split, c.B > 1);
}

INSTANTIATE_TEST_SUITE_P(Cases, GateForwardEmulation,
                         testing::Values(ForwardCase{2, 37, 1, at::kFloat, at::kFloat},
                                         ForwardCase{2, 45, 12, at::kBFloat16, at::kFloat},
                                         ForwardCase{1, 300, 16, at::kBFloat16, at::kFloat},
                                         ForwardCase{3, 33, 20, at::kHalf, at::kBFloat16},
                                         ForwardCase{2, 70, 64, at::kFloat, at::kFloat},
                                         ForwardCase{1, 9, 64, at::kBFloat16, at::kBFloat16},
                                         // More heads than the shared table (per-thread constants)
                                         // and than one block's lanes (head-vector loop).
                                         ForwardCase{1, 3, 2056, at::kBFloat16, at::kFloat}),
                         [](const testing::TestParamInfo<ForwardCase>& info) {
                           const ForwardCase& c = info.param;
                           return std::string(c10::toString(c.in)) + "_B" + std::to_string(c.B) +
                                  "_S" + std::to_string(c.S) + "_H" + std::to_string(c.H);
                         });

// ---------------------------------------------------------------------------
// Backward

struct BackwardCase {
  int64_t B, S, H;
  at::ScalarType in, param;
  GateTile tile;
};

// The documented order (Note [Gate head vectors]), recomputed with the same scalar
// functions: per program and head, row r sums its tokens r, r + rows, ... in order, then
// the fixed tree over the rows.
std::vector<float> expected_partials(const Inputs& x, const GateBackwardLaunch& launch,
                                     const GateTile& tile) {
  const int64_t H = x.A_log.size(0);
  const at::Tensor a = x.a.to(at::kFloat).reshape({-1, H}).contiguous();
  const at::Tensor dg = x.grad_g.reshape({-1, H}).contiguous();
  const at::Tensor A = x.A_log.to(at::kFloat), dt = x.dt_bias.to(at::kFloat);
  const int64_t tokens = a.size(0);
  const float* ap = a.data_ptr<float>();
  const float* dgp = dg.data_ptr<float>();
  std::vector<float> partials(static_cast<size_t>(launch.programs_t * 2 * H), NAN);
  const int rows = launch.rows;
  for (int64_t pt = 0; pt < launch.programs_t; ++pt) {
    const int64_t t_begin = pt * tile.block_t;
    const int64_t t_end = std::min(t_begin + tile.block_t, tokens);
    for (int64_t h = 0; h < H; ++h) {
      const float neg_exp_A = -expf(A[h].item<float>());
      const float dt_h = dt[h].item<float>();
      std::vector<float> row_A(rows, 0.0f), row_dt(rows, 0.0f);
      for (int r = 0; r < rows; ++r) {
        for (int64_t t = t_begin + r; t < t_end; t += rows) {
          float softplus, softplus_grad;
          gate_detail::gate_softplus_and_grad_fast(ap[t * H + h] + dt_h, softplus, softplus_grad);
          const float g = neg_exp_A * softplus;
          const float da = dgp[t * H + h] * (neg_exp_A * softplus_grad);
          row_A[r] = fmaf(dgp[t * H + h], g, row_A[r]);
          row_dt[r] = row_dt[r] + da;
        }
      }
      int span = 1;
      while (span < rows) span <<= 1;
      for (int stride = span >> 1; stride > 0; stride >>= 1) {
        for (int r = 0; r < stride && r + stride < rows; ++r) {
          row_A[r] += row_A[r + stride];
          row_dt[r] += row_dt[r + stride];
        }
      }
      partials[pt * 2 * H + h] = row_A[0];
      partials[pt * 2 * H + H + h] = row_dt[0];
    }
  }
  return partials;
}

class GateBackwardEmulation : public testing::TestWithParam<BackwardCase> {};

TEST_P(GateBackwardEmulation, MatchesTheCpuOpAndTheDocumentedOrderBitForBitOnEveryPath) {
  const BackwardCase& c = GetParam();
  const Inputs x = make_inputs(c.B, c.S, c.H, c.in, c.param);
  const auto [ref_da, ref_db, ref_dA, ref_ddt] =
      pre_gdr_gate_backward(x.grad_g, x.grad_beta, x.a, x.b, x.A_log, x.dt_bias);
  const GateShape shape{c.B, c.S, c.H};
  const GateBackwardLaunch launch = derive_gate_backward_launch(c.tile, shape);
  const std::vector<float> expected = expected_partials(x, launch, c.tile);
  const std::string base = describe(c.B, c.S, c.H, c.in) + " tile " + to_string(c.tile) + " vec " +
                           std::to_string(launch.vec) + " rows " + std::to_string(launch.rows);
  at::Tensor first_da, first_db;
  for (Layout layout : all_layouts()) {
    // Gradients in the transposed layout too whenever the activations are split.
    const Layout grad_layout = layout == Layout::kSequenceMajor ? Layout::kSequenceMajor
                               : layout == Layout::kHeadStrided ? Layout::kHeadStrided
                                                                : Layout::kContiguous;
    const at::Tensor a = relayout(x.a, layout), b = relayout(x.b, layout);
    const at::Tensor dg = relayout(x.grad_g, grad_layout), dbeta = relayout(x.grad_beta, layout);
    at::Tensor da = at::empty({c.B, c.S, c.H}, at::TensorOptions().dtype(c.in));
    at::Tensor db = at::empty({c.B, c.S, c.H}, at::TensorOptions().dtype(c.in));
    GateBackwardArgs args;
    args.shape = shape;
    args.input_kind = kind_of(c.in);
    args.param_kind = kind_of(c.param);
    args.a = operand_of(a);
    args.b = operand_of(b);
    args.grad_g = operand_of(dg);
    args.grad_beta = operand_of(dbeta);
    args.A_log = x.A_log.data_ptr();
    args.dt_bias = x.dt_bias.data_ptr();
    args.da = da.data_ptr();
    args.db = db.data_ptr();
    const GateBackwardPlan plan = plan_gate_backward(args, c.tile);
    ASSERT_EQ(plan.launch.threads, launch.threads);
    std::vector<float> partials(static_cast<size_t>(launch.scratch_floats), NAN);
    emulate_backward(plan, partials.data());
    const std::string context = base + " " + name_of(layout) + (plan.split ? " split" : "") +
                                (plan.a.vector ? " vector" : " scalar");

    const double elem_rtol = c.in == at::kFloat ? 3e-6 : 1e-2;
    EXPECT_LE(excess_error(da, ref_da, elem_rtol), 1e-6) << context << " da";
    EXPECT_LE(excess_error(db, ref_db, elem_rtol), 1e-6) << context << " db";
    for (size_t i = 0; i < partials.size(); ++i) {
      ASSERT_EQ(std::memcmp(&partials[i], &expected[i], sizeof(float)), 0)
          << context << ": partial slot " << i << " is " << partials[i] << ", the documented "
          << "order gives " << expected[i];
    }

    if (first_da.defined()) {  // every path gives the first path's bits (checked below)
      EXPECT_TRUE(same_bits(da, first_da)) << context << ": da differs from the contiguous run";
      EXPECT_TRUE(same_bits(db, first_db)) << context << ": db differs";
      continue;
    }
    first_da = da;
    first_db = db;

    // The ordered second pass, into the parameter dtype (once: its input is `expected`).
    at::Tensor dA = at::empty({c.H}, at::TensorOptions().dtype(c.param));
    at::Tensor ddt = at::empty({c.H}, at::TensorOptions().dtype(c.param));
    emulate_reduce(partials.data(), launch.programs_t, c.H, kind_of(c.param), dA.data_ptr(),
                   ddt.data_ptr());
    // The reduce order (rows r, r + 32, ... then the 32 row sums in order), recomputed.
    for (int64_t slot = 0; slot < 2 * c.H; ++slot) {
      float row_sums[kReduceRows] = {};
      for (int r = 0; r < kReduceRows; ++r) {
        for (int64_t p = r; p < launch.programs_t; p += kReduceRows) {
          row_sums[r] += partials[p * 2 * c.H + slot];
        }
      }
      float total = 0.0f;
      for (float s : row_sums) total += s;
      const at::Tensor& got = slot < c.H ? dA : ddt;
      const float expect =
          at::scalar_tensor(total).to(c.param).to(at::kFloat).item<float>();  // one rounding
      EXPECT_EQ(got[slot % c.H].to(at::kFloat).item<float>(), expect)
          << context << " slot " << slot;
    }
    // Against the FP64-accumulated reference: FP32 sums of up to a few hundred terms.
    const double sum_rtol = c.param == at::kFloat ? 1e-5 : 1e-2;
    for (const auto& [got, ref, name] :
         {std::tuple<at::Tensor, at::Tensor, const char*>{dA, ref_dA, "dA_log"},
          std::tuple<at::Tensor, at::Tensor, const char*>{ddt, ref_ddt, "ddt_bias"}}) {
      const at::Tensor r = ref.to(at::kDouble);
      const double scale = r.abs().max().item<double>() + 1e-6;
      EXPECT_LE((got.to(at::kDouble) - r).abs().max().item<double>(), sum_rtol * scale)
          << context << " " << name;
    }
  }
}

std::vector<BackwardCase> backward_cases() {
  std::vector<BackwardCase> cases;
  const GateTile tiles[] = {{32, 16, 256}, {64, 16, 128}, {100, 32, 256},
                            {40, 48, 96},  {16, 1, 32},   {64, 64, 64}};
  const BackwardCase shapes[] = {
      {2, 37, 1, at::kFloat, at::kFloat, {}},      {2, 45, 12, at::kBFloat16, at::kFloat, {}},
      {1, 200, 16, at::kBFloat16, at::kFloat, {}}, {3, 33, 20, at::kHalf, at::kBFloat16, {}},
      {2, 70, 64, at::kFloat, at::kFloat, {}},     {1, 130, 64, at::kBFloat16, at::kBFloat16, {}},
  };
  for (const BackwardCase& shape : shapes) {
    for (const GateTile& tile : tiles) {
      BackwardCase c = shape;
      c.tile = tile;
      cases.push_back(c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Cases, GateBackwardEmulation, testing::ValuesIn(backward_cases()),
                         [](const testing::TestParamInfo<BackwardCase>& info) {
                           const BackwardCase& c = info.param;
                           return std::string(c10::toString(c.in)) + "_B" + std::to_string(c.B) +
                                  "_S" + std::to_string(c.S) + "_H" + std::to_string(c.H) +
                                  "_tile_" + std::to_string(c.tile.block_t) + "x" +
                                  std::to_string(c.tile.block_h) + "x" +
                                  std::to_string(c.tile.threads);
                         });

TEST(GateBackwardPlan, VectorWidthIsAFunctionOfShapeAndTileOnly) {
  // Note [Gate head vectors]: never of strides or alignment.
  EXPECT_EQ(derive_gate_backward_launch({128, 16, 256}, {1, 1000, 48}).vec, 8);
  EXPECT_EQ(derive_gate_backward_launch({128, 16, 256}, {1, 1000, 12}).vec, 4);
  EXPECT_EQ(derive_gate_backward_launch({128, 16, 256}, {1, 1000, 33}).vec, 1);
  EXPECT_EQ(derive_gate_backward_launch({128, 48, 96}, {1, 1000, 48}).vec, 8);
  // The tree buffer stays within 32 KB: 1024 threads take vec 4.
  EXPECT_EQ(derive_gate_backward_launch({1024, 64, 1024}, {1, 1000, 64}).vec, 4);
  const GateBackwardLaunch small = derive_gate_backward_launch({32, 16, 256}, {1, 8192, 16});
  EXPECT_EQ(small.lanes, 2);
  EXPECT_EQ(small.rows, 32);
  EXPECT_EQ(small.threads, 64);
  EXPECT_LE(small.shared_bytes, 48 * 1024);
}

}  // namespace
}  // namespace gdr::kernels
