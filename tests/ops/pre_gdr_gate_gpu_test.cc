// GPU tests of the pre-GDR gate (tag gpu): agreement with the libtorch composite,
// dtypes, tails, strided inputs and gradients, the vectorised and scalar forward and
// backward giving the same bits, side streams, tile overrides, bit-exact
// replay of the deterministic backward under contention, runtime mode switching, and
// the real autograd dispatch taking the intended path.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "ops/autotune/autotune.h"
#include "ops/policy/determinism.h"
#include "ops/policy/execution_policy.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"
#include "tests/ops/bitwise_equal.h"
#include "tests/ops/gpu_contention.h"

namespace gdr {
namespace {

using kernels::GateTile;

struct Inputs {
  at::Tensor a, b, A_log, dt_bias, grad_g, grad_beta;
};

Inputs make_inputs(int64_t dim0, int64_t dim1, int64_t heads, at::ScalarType in,
                   at::ScalarType param, uint64_t seed = 7) {
  at::manual_seed(seed);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  Inputs x;
  x.a = (at::randn({dim0, dim1, heads}, cuda) * 3).to(in);
  x.a.view({-1})[0] = 23.0;  // one element above the softplus threshold
  x.b = (at::randn({dim0, dim1, heads}, cuda) * 3).to(in);
  x.A_log = at::log(at::rand({heads}, cuda) * 15.99 + 0.01).to(param);
  x.dt_bias = (at::randn({heads}, cuda) * 0.5 + 1).to(param);
  x.grad_g = at::randn({dim0, dim1, heads}, cuda);
  x.grad_beta = at::randn({dim0, dim1, heads}, cuda);
  return x;
}

using Outputs = std::vector<at::Tensor>;  // g, beta, da, db, dA_log, ddt_bias

Outputs run_fused(const Inputs& x) {
  auto [g, beta] = pre_gdr_gate(x.a, x.b, x.A_log, x.dt_bias);
  auto [da, db, dA, ddt] =
      pre_gdr_gate_backward(x.grad_g, x.grad_beta, x.a, x.b, x.A_log, x.dt_bias);
  return {g, beta, da, db, dA, ddt};
}

Outputs run_composite(const Inputs& x) {
  at::Tensor a = x.a.detach().requires_grad_(true), b = x.b.detach().requires_grad_(true);
  at::Tensor A = x.A_log.detach().requires_grad_(true),
             dt = x.dt_bias.detach().requires_grad_(true);
  auto [g, beta] = pre_gdr_gate_composite(a, b, A, dt);
  auto grads = torch::autograd::grad({g, beta}, {a, b, A, dt}, {x.grad_g, x.grad_beta});
  return {g.detach(), beta.detach(), grads[0], grads[1], grads[2], grads[3]};
}

using test_support::bitwise_equal;

void expect_bitwise_equal(const Outputs& x, const Outputs& y, const std::string& context) {
  const char* names[] = {"g", "beta", "da", "db", "dA_log", "ddt_bias"};
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(x[i], y[i])) << context << ": " << names[i] << " differs";
  }
}

void expect_close_to_composite(const Outputs& fused, const Outputs& ref, at::ScalarType in,
                               const std::string& context) {
  const char* names[] = {"g", "beta", "da", "db", "dA_log", "ddt_bias"};
  for (size_t i = 0; i < fused.size(); ++i) {
    ASSERT_EQ(fused[i].scalar_type(), ref[i].scalar_type()) << context << " " << names[i];
    ASSERT_EQ(fused[i].sizes(), ref[i].sizes()) << context << " " << names[i];
    const at::Tensor f = fused[i].to(at::kDouble), r = ref[i].to(at::kDouble);
    // Elementwise values: FP32 math both sides (a few ulps; one storage rounding when
    // the gradient dtype is 16-bit). Per-head sums: different summation orders over up
    // to 64k terms, relative to the largest magnitude.
    double rtol = i < 2 ? 1e-5 : (in == at::kFloat ? 1e-5 : 1e-2);
    if (i >= 4) rtol = (fused[i].scalar_type() == at::kFloat) ? 1e-4 : 1e-2;
    const double scale = r.abs().max().item<double>() + 1e-6;
    const double err = (f - r).abs().max().item<double>();
    const double bound = i >= 4 ? rtol * scale : 0.0;
    if (i < 4) {
      EXPECT_TRUE(at::allclose(f, r, rtol, 1e-6))
          << context << " " << names[i] << " max abs diff " << err;
    } else {
      EXPECT_LE(err, bound) << context << " " << names[i];
    }
  }
}

class GateGpuTest : public testing::Test {
 protected:
  void SetUp() override { set_deterministic_mode_override(std::nullopt); }
  void TearDown() override { SetUp(); }

  // The gate backward's fixed tile and ordered reduction (the execution policy's gate_tile
  // and gate_ordered), current on this thread until changed or the test ends.
  void set_gate_tile(std::optional<GateTile> tile) {
    policy_.gate_tile = tile;
    apply_policy();
  }
  void set_gate_ordered(GateOrderedVariant variant) {
    policy_.gate_ordered = variant;
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

struct DtypeShape {
  at::ScalarType in, param;
  int64_t dim0, dim1, heads;
};

TEST_F(GateGpuTest, MatchesTheCompositeInBothModesAcrossDtypesAndTails) {
  const std::vector<DtypeShape> cases = {
      {at::kBFloat16, at::kFloat, 1, 8192, 16}, {at::kFloat, at::kFloat, 1, 8192, 16},
      {at::kBFloat16, at::kFloat, 3, 1001, 16}, {at::kFloat, at::kFloat, 2, 77, 5},
      {at::kHalf, at::kFloat, 1, 4099, 48},     {at::kBFloat16, at::kBFloat16, 2, 515, 33},
      {at::kFloat, at::kBFloat16, 1, 1, 1},     {at::kBFloat16, at::kFloat, 4, 16384, 64},
  };
  for (const DtypeShape& c : cases) {
    const Inputs x = make_inputs(c.dim0, c.dim1, c.heads, c.in, c.param);
    const Outputs ref = run_composite(x);
    for (bool deterministic : {false, true}) {
      DeterministicModeGuard mode(deterministic);
      const std::string context = std::string(c10::toString(c.in)) + "/" + c10::toString(c.param) +
                                  " [" + std::to_string(c.dim0) + "," + std::to_string(c.dim1) +
                                  "," + std::to_string(c.heads) + "] " +
                                  (deterministic ? "ordered" : "atomic");
      const Outputs fused = run_fused(x);
      expect_close_to_composite(fused, ref, c.in, context);
      EXPECT_EQ(pre_gdr_gate_last_backward().ordered, deterministic) << context;
    }
  }
}

TEST_F(GateGpuTest, StridedInputsAndGradientsGiveTheContiguousBits) {
  DeterministicModeGuard mode(true);
  const int64_t B = 2, S = 1000, H = 16;
  const Inputs x = make_inputs(B, S, H, at::kBFloat16, at::kFloat);
  const Outputs contiguous = run_fused(x);

  // a and b as slices of one wider projection output, as in the model.
  at::Tensor projection = at::randn({B, S, 3 * H}, x.a.options());
  projection.narrow(2, 0, H).copy_(x.a);
  projection.narrow(2, 2 * H, H).copy_(x.b);
  Inputs sliced = x;
  sliced.a = projection.narrow(2, 0, H);
  sliced.b = projection.narrow(2, 2 * H, H);
  ASSERT_FALSE(sliced.a.is_contiguous());
  // Upstream gradients with a transposed layout ([S, B, H] storage viewed as [B, S, H]).
  sliced.grad_g = x.grad_g.transpose(0, 1).contiguous().transpose(0, 1);
  sliced.grad_beta = x.grad_beta.transpose(0, 1).contiguous().transpose(0, 1);
  ASSERT_FALSE(sliced.grad_g.is_contiguous());
  expect_bitwise_equal(run_fused(sliced), contiguous, "sliced inputs, transposed grads");

  // [S, B, H] activations (sequence-major), 2-D [T, H] views.
  Inputs seq_major = x;
  seq_major.a = x.a.transpose(0, 1).contiguous().transpose(0, 1);
  seq_major.b = x.b.transpose(0, 1).contiguous().transpose(0, 1);
  expect_bitwise_equal(run_fused(seq_major), contiguous, "sequence-major inputs");
  Inputs flat = x;
  for (at::Tensor* t : {&flat.a, &flat.b, &flat.grad_g, &flat.grad_beta})
    *t = t->reshape({B * S, H});
  const Outputs flat_out = run_fused(flat);
  for (size_t i = 0; i < 4; ++i)
    EXPECT_TRUE(bitwise_equal(flat_out[i].reshape({B, S, H}), contiguous[i])) << i;
  EXPECT_TRUE(bitwise_equal(flat_out[4], contiguous[4]));
  EXPECT_TRUE(bitwise_equal(flat_out[5], contiguous[5]));
}

// The forward has a vectorised kernel (contiguous a and b aligned to 4 elements, heads a
// multiple of 4 and <= 1024) and a scalar one (anything else); both must give the same
// bits. Each case runs the same values once through the vectorised path (a fresh
// contiguous tensor) and once through the scalar path (the values copied into a buffer
// at an offset of one element, so misaligned, and into a strided slice), across head
// counts whose lanes do and do not divide the block (16, 48, 64, 200, 516), heads that
// are not a multiple of 4 or exceed the table (33, 1028), token tails, and both the
// small (1 row group) and large (2 row groups, > 2^21 elements) launch shapes.
TEST_F(GateGpuTest, VectorisedAndScalarForwardGiveTheSameBits) {
  struct Case {
    at::ScalarType in;
    int64_t tokens, heads;
  };
  const std::vector<Case> cases = {
      {at::kBFloat16, 8192, 16}, {at::kBFloat16, 1001, 48}, {at::kBFloat16, 65536, 64},
      {at::kFloat, 3001, 200},   {at::kHalf, 77, 516},      {at::kBFloat16, 5, 33},
      {at::kFloat, 65537, 64},   {at::kBFloat16, 3, 1028},  {at::kFloat, 1, 4},
  };
  for (const Case& c : cases) {
    const std::string context = std::string(c10::toString(c.in)) +
                                " T=" + std::to_string(c.tokens) + " Hv=" + std::to_string(c.heads);
    const Inputs x = make_inputs(1, c.tokens, c.heads, c.in, at::kFloat);
    auto [g, beta] = pre_gdr_gate(x.a, x.b, x.A_log, x.dt_bias);
    // One element of offset: a and b are no longer aligned to a 4-element vector.
    auto misaligned = [&](const at::Tensor& t) {
      at::Tensor buffer = at::empty({t.numel() + 1}, t.options());
      at::Tensor view = buffer.narrow(0, 1, t.numel()).view(t.sizes());
      view.copy_(t);
      return view;
    };
    const at::Tensor a_mis = misaligned(x.a), b_mis = misaligned(x.b);
    auto [g_mis, beta_mis] = pre_gdr_gate(a_mis, b_mis, x.A_log, x.dt_bias);
    EXPECT_TRUE(bitwise_equal(g_mis, g)) << context << " misaligned g";
    EXPECT_TRUE(bitwise_equal(beta_mis, beta)) << context << " misaligned beta";
    // A strided slice of a wider buffer (not flat).
    at::Tensor wide = at::zeros({1, c.tokens, 2 * c.heads}, x.a.options());
    wide.narrow(2, 0, c.heads).copy_(x.a);
    wide.narrow(2, c.heads, c.heads).copy_(x.b);
    auto [g_str, beta_str] = pre_gdr_gate(wide.narrow(2, 0, c.heads),
                                          wide.narrow(2, c.heads, c.heads), x.A_log, x.dt_bias);
    EXPECT_TRUE(bitwise_equal(g_str, g)) << context << " strided g";
    EXPECT_TRUE(bitwise_equal(beta_str, beta)) << context << " strided beta";
    // And the values themselves against the composite.
    at::Tensor a_ref = x.a.detach(), b_ref = x.b.detach();
    auto [g_ref, beta_ref] = pre_gdr_gate_composite(a_ref, b_ref, x.A_log, x.dt_bias);
    EXPECT_TRUE(at::allclose(g.to(at::kDouble), g_ref.to(at::kDouble), 1e-5, 1e-6)) << context;
    EXPECT_TRUE(at::allclose(beta.to(at::kDouble), beta_ref.to(at::kDouble), 1e-5, 1e-6))
        << context;
  }
}

// The backward has a vectorised element pass (a, b, grad_g, grad_beta contiguous and
// aligned, heads and block_h multiples of 4) and a scalar one (anything else); Note [Gate
// backward virtual rows] makes both sum in the same order for the same tile, and both
// compute each element with the same calls. So in deterministic mode every output (da,
// db and the per-head sums, through both ordered variants) must be the same bits
// whichever pass runs, and in the atomic mode da and db must. Each case runs the same
// values through the vectorised pass (fresh contiguous tensors), the flat scalar pass
// (a and b, or grad_g and grad_beta, copied to an offset of one element: misaligned)
// and the strided scalar pass (slices of a wider buffer), across dtypes, token tails,
// several programs along heads (Hv 200 with 64-head programs), tiles with fewer tokens
// than virtual rows (32x16x256: 64 virtual rows), and head counts that are not a
// multiple of 4 (scalar only: checked against the composite).
TEST_F(GateGpuTest, VectorisedAndScalarBackwardGiveTheSameBits) {
  struct Case {
    at::ScalarType in, param;
    int64_t dim0, dim1, heads;
    std::optional<GateTile> tile;  // nullopt: the op's own choice
  };
  const std::vector<Case> cases = {
      {at::kBFloat16, at::kFloat, 1, 8192, 16, std::nullopt},
      {at::kBFloat16, at::kFloat, 1, 65536, 64, std::nullopt},
      {at::kFloat, at::kFloat, 1, 65536, 64, std::nullopt},
      {at::kFloat, at::kFloat, 1, 16384, 32, std::nullopt},
      {at::kHalf, at::kFloat, 3, 1001, 48, std::nullopt},
      {at::kBFloat16, at::kBFloat16, 2, 3001, 200, GateTile{64, 64, 256}},
      {at::kBFloat16, at::kFloat, 1, 1000, 16, GateTile{32, 16, 256}},
      {at::kFloat, at::kFloat, 1, 777, 24, GateTile{100, 32, 128}},
      {at::kBFloat16, at::kFloat, 1, 5, 4, GateTile{32, 16, 128}},
      {at::kBFloat16, at::kFloat, 2, 515, 33, std::nullopt},
      {at::kFloat, at::kFloat, 1, 300, 6, GateTile{64, 16, 256}},
  };
  auto misaligned = [](const at::Tensor& t) {
    at::Tensor buffer = at::empty({t.numel() + 1}, t.options());
    at::Tensor view = buffer.narrow(0, 1, t.numel()).view(t.sizes());
    view.copy_(t);
    return view;
  };
  auto strided = [](const at::Tensor& t) {
    at::Tensor wide = at::zeros({t.size(0), t.size(1), 2 * t.size(2)}, t.options());
    wide.narrow(2, t.size(2), t.size(2)).copy_(t);
    return wide.narrow(2, t.size(2), t.size(2));
  };
  for (const Case& c : cases) {
    set_gate_tile(c.tile);
    const std::string context = std::string(c10::toString(c.in)) + "/" + c10::toString(c.param) +
                                " [" + std::to_string(c.dim0) + "," + std::to_string(c.dim1) + "," +
                                std::to_string(c.heads) + "] tile " +
                                (c.tile ? kernels::to_string(*c.tile) : std::string("auto"));
    const Inputs x = make_inputs(c.dim0, c.dim1, c.heads, c.in, c.param);
    Inputs mis_ab = x;
    mis_ab.a = misaligned(x.a);
    mis_ab.b = misaligned(x.b);
    Inputs mis_grads = x;
    mis_grads.grad_g = misaligned(x.grad_g);
    mis_grads.grad_beta = misaligned(x.grad_beta);
    Inputs sliced = x;
    for (at::Tensor* t : {&sliced.a, &sliced.b, &sliced.grad_g, &sliced.grad_beta})
      *t = strided(*t);
    ASSERT_FALSE(sliced.a.is_contiguous());
    const std::vector<std::pair<const char*, const Inputs*>> scalar_runs = {
        {"misaligned a, b", &mis_ab},
        {"misaligned grads", &mis_grads},
        {"strided", &sliced},
    };
    for (bool deterministic : {true, false}) {
      DeterministicModeGuard mode(deterministic);
      for (GateOrderedVariant variant :
           {GateOrderedVariant::kTwoPass, GateOrderedVariant::kSinglePass}) {
        if (!deterministic && variant == GateOrderedVariant::kSinglePass) continue;
        set_gate_ordered(variant);
        const std::string run_context =
            context + (deterministic ? (variant == GateOrderedVariant::kTwoPass ? " two-pass"
                                                                                : " single-pass")
                                     : " atomic");
        const bool single_pass_fits =
            !deterministic || variant == GateOrderedVariant::kTwoPass ||
            (c.tile ? c.tile->threads : 256) >= kernels::kSinglePassMinThreads;
        if (!single_pass_fits) continue;
        const Outputs vec = run_fused(x);
        const PreGdrGateBackwardRecord vec_record = pre_gdr_gate_last_backward();
        EXPECT_EQ(vec_record.vectorised, c.heads % 4 == 0 && vec_record.tile.block_h % 4 == 0)
            << run_context;
        if (deterministic && c.dim1 <= 8192) {
          expect_close_to_composite(vec, run_composite(x), c.in, run_context);
        }
        for (const auto& [name, inputs] : scalar_runs) {
          const Outputs scalar = run_fused(*inputs);
          const PreGdrGateBackwardRecord record = pre_gdr_gate_last_backward();
          EXPECT_FALSE(record.vectorised) << run_context << " " << name;
          if (deterministic) {
            EXPECT_EQ(record.tile, vec_record.tile) << run_context << " " << name;
            expect_bitwise_equal(scalar, vec, run_context + " " + name);
          } else {
            EXPECT_TRUE(bitwise_equal(scalar[2], vec[2])) << run_context << " " << name << " da";
            EXPECT_TRUE(bitwise_equal(scalar[3], vec[3])) << run_context << " " << name << " db";
          }
        }
      }
      set_gate_ordered(GateOrderedVariant::kAuto);
    }
  }
  set_gate_tile(std::nullopt);
}

TEST_F(GateGpuTest, OutputsCarvedFromOneAllocationBehaveAsSeparateTensors) {
  const Inputs x = make_inputs(2, 300, 16, at::kBFloat16, at::kBFloat16);
  for (bool deterministic : {false, true}) {
    DeterministicModeGuard mode(deterministic);
    auto [g, beta] = pre_gdr_gate(x.a, x.b, x.A_log, x.dt_bias);
    auto [da, db, dA, ddt] =
        pre_gdr_gate_backward(x.grad_g, x.grad_beta, x.a, x.b, x.A_log, x.dt_bias);
    for (const at::Tensor& t : {g, beta, da, db, dA, ddt}) {
      EXPECT_TRUE(t.is_contiguous());
      EXPECT_EQ(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16, 0u);
    }
    EXPECT_EQ(dA.scalar_type(), at::kBFloat16);
    EXPECT_EQ(dA.sizes(), x.A_log.sizes());
    // The per-head gradients do not share the large block (autograd may keep them as
    // .grad for the whole run).
    EXPECT_FALSE(dA.is_alias_of(da));
    const at::Tensor beta_before = beta.clone(), db_before = db.clone(), ddt_before = ddt.clone();
    g.add_(1.0);
    da.add_(1.0);
    dA.add_(1.0);
    EXPECT_TRUE(bitwise_equal(beta, beta_before));
    EXPECT_TRUE(bitwise_equal(db, db_before));
    EXPECT_TRUE(bitwise_equal(ddt, ddt_before));
  }
}

TEST_F(GateGpuTest, SideStreamWorkMatchesTheDefaultStreamBitForBit) {
  DeterministicModeGuard mode(true);
  const Inputs x = make_inputs(1, 8192, 16, at::kBFloat16, at::kFloat);
  const Outputs on_default = run_fused(x);
  c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
  Outputs on_side;
  {
    c10::cuda::CUDAStreamGuard guard(side);
    side.synchronize();
    on_side = run_fused(x);
  }
  side.synchronize();
  expect_bitwise_equal(on_side, on_default, "side stream");
  // The atomic path on a side stream agrees within tolerance.
  DeterministicModeGuard atomic(false);
  {
    c10::cuda::CUDAStreamGuard guard(side);
    on_side = run_fused(x);
  }
  side.synchronize();
  expect_close_to_composite(on_side, run_composite(x), at::kBFloat16, "atomic side stream");
}

TEST_F(GateGpuTest, OverriddenTilesAreUsedInBothModesAndStayCorrect) {
  const Inputs x = make_inputs(2, 3001, 24, at::kBFloat16, at::kFloat);
  const Outputs ref = run_composite(x);
  for (const GateTile& tile :
       {GateTile{32, 16, 128}, GateTile{256, 32, 256}, GateTile{100, 64, 64}}) {
    set_gate_tile(tile);
    for (bool deterministic : {false, true}) {
      DeterministicModeGuard mode(deterministic);
      const Outputs fused = run_fused(x);
      const PreGdrGateBackwardRecord record = pre_gdr_gate_last_backward();
      EXPECT_EQ(record.tile, tile);
      EXPECT_EQ(record.source, SelectionSource::kOverride);
      EXPECT_EQ(record.ordered, deterministic) << "pinning a tile must not switch arithmetic";
      EXPECT_EQ(record.launch.programs_t, (2 * 3001 + tile.block_t - 1) / tile.block_t);
      expect_close_to_composite(fused, ref, at::kBFloat16, "tile " + kernels::to_string(tile));
    }
  }
  set_gate_tile(std::nullopt);
  DeterministicModeGuard mode(false);
  clear_autotune_cache();
  run_fused(x);
  EXPECT_EQ(pre_gdr_gate_last_backward().source, SelectionSource::kAutotuneTimed);
  run_fused(x);
  EXPECT_EQ(pre_gdr_gate_last_backward().source, SelectionSource::kAutotuneCache);
}

void replay_under_contention(GateOrderedVariant variant, kernels::GateReduction expected) {
  ExecutionPolicy policy;
  policy.gate_ordered = variant;
  const ExecutionPolicyGuard ordered(policy);
  DeterministicModeGuard mode(true);
  const Inputs x = make_inputs(4, 2048, 16, at::kBFloat16, at::kFloat, 99);
  const Outputs first = run_fused(x);
  EXPECT_EQ(pre_gdr_gate_last_backward().reduction, expected);

  // Contention: another thread keeps two other streams busy with matmuls and reductions.
  std::optional<test_support::GpuContention> load(std::in_place);
  int mismatches = 0;
  for (int replay = 0; replay < 200; ++replay) {
    auto [da, db, dA, ddt] =
        pre_gdr_gate_backward(x.grad_g, x.grad_beta, x.a, x.b, x.A_log, x.dt_bias);
    auto [g, beta] = pre_gdr_gate(x.a, x.b, x.A_log, x.dt_bias);
    const Outputs now = {g, beta, da, db, dA, ddt};
    for (size_t i = 0; i < now.size(); ++i) mismatches += bitwise_equal(now[i], first[i]) ? 0 : 1;
  }
  load.reset();
  EXPECT_EQ(mismatches, 0) << "the ordered backward must give identical bits on every replay";
  EXPECT_EQ(pre_gdr_gate_last_backward().reduction, expected);
}

TEST_F(GateGpuTest, SinglePassOrderedBackwardReplays200TimesBitExactUnderContention) {
  replay_under_contention(GateOrderedVariant::kSinglePass,
                          kernels::GateReduction::kOrderedSinglePass);
}

TEST_F(GateGpuTest, TwoPassOrderedBackwardReplays200TimesBitExactUnderContention) {
  replay_under_contention(GateOrderedVariant::kTwoPass, kernels::GateReduction::kOrdered);
}

TEST_F(GateGpuTest, SinglePassAndTwoPassGiveTheSameBitsAndMatchTheComposite) {
  // See Note [Single-pass ordered reduction]: the last program sums in the second kernel's
  // order, so the variants must agree bit for bit, for any head count (several 32-slot
  // groups at Hv = 65, 96, 200) and for partial-row counts that are and are not
  // multiples of the 32 virtual rows.
  DeterministicModeGuard mode(true);
  for (int64_t heads : {16, 64, 65, 96, 200}) {
    for (int64_t tokens : {1500, 8192, 40000}) {
      const std::string context = "Hv=" + std::to_string(heads) + " T=" + std::to_string(tokens);
      const Inputs x = make_inputs(1, tokens, heads, at::kBFloat16, at::kFloat);
      run_fused(x);
      const PreGdrGateBackwardRecord auto_record = pre_gdr_gate_last_backward();
      EXPECT_EQ(auto_record.reduction,
                kernels::gate_single_pass_preferred(auto_record.tile, auto_record.launch,
                                                    kernels::GateShape{1, tokens, heads},
                                                    /*capturing=*/false)
                    ? kernels::GateReduction::kOrderedSinglePass
                    : kernels::GateReduction::kOrdered)
          << context << ": auto must follow gate_single_pass_preferred";
      set_gate_ordered(GateOrderedVariant::kTwoPass);
      const Outputs two_pass = run_fused(x);
      EXPECT_EQ(pre_gdr_gate_last_backward().reduction, kernels::GateReduction::kOrdered)
          << context;
      set_gate_ordered(GateOrderedVariant::kSinglePass);
      const Outputs single_pass = run_fused(x);
      EXPECT_EQ(pre_gdr_gate_last_backward().reduction, kernels::GateReduction::kOrderedSinglePass)
          << context;
      set_gate_ordered(GateOrderedVariant::kAuto);
      expect_bitwise_equal(single_pass, two_pass, "single vs two pass " + context);
      if (tokens == 1500) {
        expect_close_to_composite(single_pass, run_composite(x), at::kBFloat16, context);
      }
    }
  }
}

TEST_F(GateGpuTest, AutoTakesTheSinglePassEagerAndTheTwoPassInAGraphWithTheSameBits) {
  // kernels::gate_single_pass_preferred: at the 0.8B shape (256 programs) an eager call
  // takes the single pass and a captured one the two pass, whose reduce kernel is
  // launched early (programmatic dependent launch, Note [Gate reduce launched early]);
  // the graph's replays must give the eager call's bits.
  DeterministicModeGuard mode(true);
  const Inputs x = make_inputs(1, 8192, 16, at::kBFloat16, at::kFloat, 17);
  const Outputs eager = run_fused(x);
  EXPECT_EQ(pre_gdr_gate_last_backward().reduction, kernels::GateReduction::kOrderedSinglePass);
  c10::cuda::CUDAStream capture_stream = c10::cuda::getStreamFromPool();
  at::cuda::CUDAGraph graph;
  Outputs captured;
  {
    c10::cuda::CUDAStreamGuard guard(capture_stream);
    run_fused(x);
    capture_stream.synchronize();
    graph.capture_begin();
    captured = run_fused(x);
    graph.capture_end();
  }
  EXPECT_EQ(pre_gdr_gate_last_backward().reduction, kernels::GateReduction::kOrdered);
  for (int replay = 0; replay < 20; ++replay) {
    graph.replay();
    c10::cuda::getCurrentCUDAStream().synchronize();
    expect_bitwise_equal(captured, eager, "replay " + std::to_string(replay));
  }
}

TEST_F(GateGpuTest, SinglePassWithATileUnder256ThreadsIsRefused) {
  DeterministicModeGuard mode(true);
  const Inputs x = make_inputs(1, 1000, 16, at::kFloat, at::kFloat);
  set_gate_tile(GateTile{64, 16, 128});
  set_gate_ordered(GateOrderedVariant::kSinglePass);
  try {
    run_fused(x);
    ADD_FAILURE() << "single pass with a 128-thread tile must be refused";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "pre_gdr_gate: the single-pass ordered reduction was requested but it needs a "
              "tile of at least 256 threads (got 64x16x128)");
  }
}

// Note [Gate FP64 on the CPU]: the CPU op takes Double, the CUDA kernels do not.
TEST_F(GateGpuTest, DoubleOnCudaIsRefusedSayingTheKernelsHaveNoFp64Path) {
  const Inputs x = make_inputs(1, 10, 4, at::kDouble, at::kDouble);
  try {
    pre_gdr_gate(x.a, x.b, x.A_log, x.dt_bias);
    ADD_FAILURE() << "Double on CUDA must be refused";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "pre_gdr_gate: A_log is Double on cuda:0; the CUDA kernels take Float, Half or "
              "BFloat16 (Double runs on the CPU only)");
  }
}

TEST_F(GateGpuTest, CapturedSinglePassReplaysOnAnotherStreamBesideEagerCalls) {
  // A captured launch owns its ticket counter: replaying the graph on a second stream
  // while eager calls run on the capture stream must not mix their tickets.
  DeterministicModeGuard mode(true);
  set_gate_ordered(GateOrderedVariant::kSinglePass);
  const Inputs x = make_inputs(2, 4096, 32, at::kBFloat16, at::kFloat, 5);
  const Outputs eager = run_fused(x);
  c10::cuda::CUDAStream capture_stream = c10::cuda::getStreamFromPool();
  c10::cuda::CUDAStream replay_stream = c10::cuda::getStreamFromPool();
  at::cuda::CUDAGraph graph;
  Outputs captured;
  {
    c10::cuda::CUDAStreamGuard guard(capture_stream);
    run_fused(x);  // warm-up outside capture (tile cache)
    capture_stream.synchronize();
    graph.capture_begin();
    captured = run_fused(x);
    graph.capture_end();
  }
  EXPECT_EQ(pre_gdr_gate_last_backward().reduction, kernels::GateReduction::kOrderedSinglePass);
  int mismatches = 0;
  for (int round = 0; round < 50; ++round) {
    {
      c10::cuda::CUDAStreamGuard guard(replay_stream);
      graph.replay();
    }
    Outputs side;
    {
      c10::cuda::CUDAStreamGuard guard(capture_stream);
      side = run_fused(x);
    }
    replay_stream.synchronize();
    capture_stream.synchronize();
    for (size_t i = 0; i < eager.size(); ++i) {
      mismatches += bitwise_equal(captured[i], eager[i]) ? 0 : 1;
      mismatches += bitwise_equal(side[i], eager[i]) ? 0 : 1;
    }
  }
  EXPECT_EQ(mismatches, 0);
}

TEST_F(GateGpuTest, FlippingTheModeBetweenCallsSwitchesPaths) {
  const Inputs x = make_inputs(1, 4096, 16, at::kBFloat16, at::kFloat);
  const Outputs ref = run_composite(x);
  Outputs ordered_first;
  for (int i = 0; i < 6; ++i) {
    const bool deterministic = i % 2 == 0;
    set_deterministic_mode_override(deterministic);
    const int64_t calls_before = pre_gdr_gate_last_backward().calls;
    const Outputs out = run_fused(x);
    const PreGdrGateBackwardRecord record = pre_gdr_gate_last_backward();
    EXPECT_EQ(record.calls, calls_before + 1);
    EXPECT_EQ(record.ordered, deterministic) << "call " << i;
    EXPECT_EQ(record.source == SelectionSource::kStaticCost, deterministic) << "call " << i;
    expect_close_to_composite(out, ref, at::kBFloat16, "flip " + std::to_string(i));
    if (i == 0) ordered_first = out;
    if (deterministic && i > 0) expect_bitwise_equal(out, ordered_first, "ordered after a flip");
  }
}

TEST_F(GateGpuTest, AutogradBackwardThroughDefaultDispatchTakesTheIntendedPath) {
  // No gdr override: the path must follow PyTorch's global switch, through the real
  // autograd engine (which runs CUDA backward on its own device thread).
  const Inputs x = make_inputs(2, 2048, 16, at::kBFloat16, at::kFloat);
  for (bool torch_deterministic : {true, false, true}) {
    at::globalContext().setDeterministicAlgorithms(torch_deterministic, false);
    at::Tensor a = x.a.detach().requires_grad_(true), b = x.b.detach().requires_grad_(true);
    at::Tensor A = x.A_log.detach().requires_grad_(true),
               dt = x.dt_bias.detach().requires_grad_(true);
    const int64_t calls_before = pre_gdr_gate_last_backward().calls;
    auto [g, beta] = pre_gdr_gate(a, b, A, dt);
    at::Tensor loss = (g * x.grad_g).sum() + (beta * x.grad_beta).sum();
    loss.backward();
    const PreGdrGateBackwardRecord record = pre_gdr_gate_last_backward();
    EXPECT_EQ(record.calls, calls_before + 1) << "backward must run the fused CUDA kernel";
    EXPECT_EQ(record.ordered, torch_deterministic);
    ASSERT_TRUE(A.grad().defined());
    const Outputs ref = run_composite(x);
    expect_close_to_composite({g.detach(), beta.detach(), a.grad(), b.grad(), A.grad(), dt.grad()},
                              ref, at::kBFloat16, "autograd");
  }
  at::globalContext().setDeterministicAlgorithms(false, false);
}

}  // namespace
}  // namespace gdr
