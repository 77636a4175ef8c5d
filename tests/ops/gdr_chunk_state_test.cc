// The chunk state pass op on CPU: its forward and hand-derived backward against libtorch
// autograd of the plain per-chunk loop (FP64, tight), through the op's own autograd and
// through the backward op called directly; argument checks; the GDR core implementation
// choice (the policy's gdr_core_impl: its values and error messages) and the CPU path
// staying composite.
#include "ops/gdr_core/chunk_state_op.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cstdlib>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/gdr_core/gdr_core_op.h"
#include "ops/policy/execution_policy.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

struct Case {
  int64_t B, H, N, C, dk, dv;
  bool initial_state;
  bool use_o;            // the loss reads o
  bool use_final_state;  // the loss reads the final state
};

std::string describe(const Case& c) {
  return "B" + std::to_string(c.B) + "_H" + std::to_string(c.H) + "_N" + std::to_string(c.N) +
         "_C" + std::to_string(c.C) + "_dk" + std::to_string(c.dk) + "_dv" + std::to_string(c.dv) +
         (c.initial_state ? "_S0" : "_noS0") + (c.use_o ? "_o" : "") +
         (c.use_final_state ? "_final" : "");
}

struct Inputs {
  at::Tensor u, w, qd, p, kend, g_last, initial_state;  // initial_state undefined if absent
};

// Magnitudes like the real ones: W and Kend rows of norm ~0.5 so the carried state stays
// bounded over many chunks, g_last in (-3, 0), P lower triangular.
Inputs make_inputs(const Case& c, uint64_t seed) {
  at::manual_seed(seed);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const double row = 0.5 / std::sqrt(static_cast<double>(c.dk));
  Inputs x;
  x.u = at::randn({c.B, c.H, c.N, c.C, c.dv}, f64);
  x.w = at::randn({c.B, c.H, c.N, c.C, c.dk}, f64) * row;
  x.qd = at::randn({c.B, c.H, c.N, c.C, c.dk}, f64) * row;
  x.p = at::randn({c.B, c.H, c.N, c.C, c.C}, f64).tril() * 0.3;
  x.kend = at::randn({c.B, c.H, c.N, c.C, c.dk}, f64) * row;
  x.g_last = -3.0 * at::rand({c.B, c.H, c.N}, f64);
  if (c.initial_state) x.initial_state = at::randn({c.B, c.H, c.dk, c.dv}, f64);
  return x;
}

// Independent check written from the spec (step 7 of the shared design note), not from
// the op's formulas: the plain loop, differentiated by libtorch autograd.
std::tuple<at::Tensor, at::Tensor> plain_loop(const at::Tensor& u, const at::Tensor& w,
                                              const at::Tensor& qd, const at::Tensor& p,
                                              const at::Tensor& kend, const at::Tensor& g_last,
                                              const at::Tensor& initial_state) {
  at::Tensor S = initial_state.defined()
                     ? initial_state
                     : at::zeros({u.size(0), u.size(1), w.size(4), u.size(4)}, u.options());
  std::vector<at::Tensor> outputs;
  for (int64_t n = 0; n < u.size(2); ++n) {
    const at::Tensor Vn = u.select(2, n) - w.select(2, n).matmul(S);
    outputs.push_back(qd.select(2, n).matmul(S) + p.select(2, n).matmul(Vn));
    S = S * g_last.select(2, n).exp().unsqueeze(-1).unsqueeze(-1) +
        kend.select(2, n).transpose(-1, -2).matmul(Vn);
  }
  return {at::stack(outputs, 2), S};
}

// An unused input has an undefined autograd gradient; the op returns zeros for it.
double max_abs_diff(const at::Tensor& a, const at::Tensor& b) {
  const at::Tensor bb = b.defined() ? b : at::zeros_like(a);
  return (a - bb).abs().max().item<double>();
}

class ChunkStatePassCpu : public ::testing::TestWithParam<Case> {};

TEST_P(ChunkStatePassCpu, ForwardAndBackwardMatchAutogradOfThePlainLoopInFp64) {
  const Case c = GetParam();
  const Inputs x = make_inputs(c, 100 + c.N * 7 + c.dk);
  std::vector<at::Tensor> leaves = {x.u, x.w, x.qd, x.p, x.kend, x.g_last};
  if (c.initial_state) leaves.push_back(x.initial_state);
  for (at::Tensor& t : leaves) t = t.detach().requires_grad_(true);
  const at::Tensor initial = c.initial_state ? leaves[6] : at::Tensor();
  const at::Tensor w_o = at::randn({c.B, c.H, c.N, c.C, c.dv}, at::kDouble);
  const at::Tensor w_s = at::randn({c.B, c.H, c.dk, c.dv}, at::kDouble);
  auto loss_of = [&](const at::Tensor& o, const at::Tensor& s) {
    at::Tensor loss = at::zeros({}, at::kDouble);
    if (c.use_o) loss = loss + (o * w_o).sum();
    if (c.use_final_state) loss = loss + (s * w_s).sum();
    return loss;
  };

  const auto [o_ref, s_ref] =
      plain_loop(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], leaves[5], initial);
  const auto grads_ref = torch::autograd::grad({loss_of(o_ref, s_ref)}, leaves, {}, std::nullopt,
                                               false, /*allow_unused=*/true);

  std::optional<at::Tensor> initial_opt;
  if (c.initial_state) initial_opt = initial;
  const auto [o, s, states, v_new] = chunk_state_pass(leaves[0], leaves[1], leaves[2], leaves[3],
                                                      leaves[4], leaves[5], initial_opt);
  ASSERT_EQ(o.sizes(), x.u.sizes());
  ASSERT_EQ(s.sizes(), (std::vector<int64_t>{c.B, c.H, c.dk, c.dv}));
  ASSERT_EQ(states.sizes(), (std::vector<int64_t>{c.B, c.H, c.N, c.dk, c.dv}));
  EXPECT_FALSE(states.requires_grad());
  EXPECT_FALSE(v_new.requires_grad());
  EXPECT_LT(max_abs_diff(o, o_ref), 1e-12);
  EXPECT_LT(max_abs_diff(s, s_ref), 1e-12);
  // states[n] is the state entering chunk n: the first is the initial state.
  EXPECT_TRUE(at::equal(states.select(2, 0).detach(),
                        c.initial_state ? x.initial_state : at::zeros_like(s_ref).detach()));

  const char* names[] = {"u", "w", "qd", "p", "kend", "g_last", "initial_state"};
  const auto grads = torch::autograd::grad({loss_of(o, s)}, leaves, {}, std::nullopt, false,
                                           /*allow_unused=*/true);
  for (size_t i = 0; i < leaves.size(); ++i) {
    EXPECT_LT(max_abs_diff(grads[i], grads_ref[i]), 1e-11) << "autograd: gradient of " << names[i];
  }

  // The backward op called directly, with absent upstream gradients where the loss
  // does not read an output.
  std::optional<at::Tensor> grad_o, grad_s;
  if (c.use_o) grad_o = w_o;
  if (c.use_final_state) grad_s = w_s;
  const auto direct = chunk_state_pass_backward(grad_o, grad_s, x.w, x.qd, x.p, x.kend, x.g_last,
                                                states.detach(), v_new.detach());
  const std::vector<at::Tensor> direct_list = {
      std::get<0>(direct), std::get<1>(direct), std::get<2>(direct), std::get<3>(direct),
      std::get<4>(direct), std::get<5>(direct), std::get<6>(direct)};
  for (size_t i = 0; i < leaves.size(); ++i) {
    EXPECT_LT(max_abs_diff(direct_list[i], grads_ref[i]), 1e-11)
        << "direct: gradient of " << names[i];
  }
  if (!c.initial_state) {
    // d initial_state is still returned: the gradient the zeros would have had.
    const at::Tensor zeros = at::zeros({c.B, c.H, c.dk, c.dv}, at::kDouble).requires_grad_(true);
    const auto [o0, s0] = plain_loop(x.u, x.w, x.qd, x.p, x.kend, x.g_last, zeros);
    const auto g0 = torch::autograd::grad({loss_of(o0, s0)}, {zeros});
    EXPECT_LT(max_abs_diff(std::get<6>(direct), g0[0]), 1e-11);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, ChunkStatePassCpu,
                         ::testing::Values(Case{1, 1, 1, 4, 3, 5, true, true, true},
                                           Case{2, 3, 1, 8, 6, 4, false, true, true},
                                           Case{2, 3, 2, 4, 5, 3, true, true, false},
                                           Case{1, 2, 3, 8, 4, 7, false, true, false},
                                           Case{2, 2, 5, 4, 6, 6, true, false, true},
                                           Case{1, 3, 7, 8, 7, 5, true, true, true},
                                           Case{1, 2, 4, 64, 16, 32, true, true, true}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return describe(info.param);
                         });

TEST(ChunkStatePassChecks, ReportsTheArgumentAndExpectedVersusActualShape) {
  const Inputs x = make_inputs(Case{1, 2, 3, 4, 5, 6, true, true, true}, 1);
  try {
    chunk_state_pass(x.u, x.w, x.qd, x.p.narrow(4, 0, 3), x.kend, x.g_last, x.initial_state);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "chunk_state_pass: expected p of shape [1, 2, 3, 4, 4] ([B, H, N, C, C]) but got "
              "[1, 2, 3, 4, 3]");
  }
  try {
    chunk_state_pass(x.u, x.w, x.qd, x.p, x.kend, x.g_last.to(at::kFloat), x.initial_state);
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "chunk_state_pass: expected g_last of dtype Double (one dtype for all inputs) but "
              "got Float");
  }
  try {
    chunk_state_pass(x.u, x.w, x.qd, x.p, x.kend, x.g_last, x.initial_state.transpose(2, 3));
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "chunk_state_pass: expected initial_state of shape [1, 2, 5, 6] ([B, H, dk, dv]) "
              "but got [1, 2, 6, 5]");
  }
}

// ---------------------------------------------------------------------------
// The implementation switch

class GdrCoreImplSwitch : public ::testing::Test {
 protected:
  void SetUp() override { set_gdr_core_op_on_cpu_for_testing(false); }
  void TearDown() override { SetUp(); }
};

using test_support::PolicyForTest;

// A policy that differs from the defaults in the GDR core's state pass only.
ExecutionPolicy with_core_impl(GdrCoreImpl impl) {
  ExecutionPolicy policy;
  policy.gdr_core_impl = impl;
  return policy;
}

TEST_F(GdrCoreImplSwitch, DefaultsToTheKernelAndParsesBothNames) {
  EXPECT_EQ(current_execution_policy().gdr_core_impl, GdrCoreImpl::kKernel);
  PolicyForTest policy("gdr_core_impl", "kernel");
  EXPECT_EQ(current_execution_policy().gdr_core_impl, GdrCoreImpl::kKernel);
  policy.set("gdr_core_impl", "composite");
  EXPECT_EQ(current_execution_policy().gdr_core_impl, GdrCoreImpl::kComposite);
  EXPECT_EQ(execution_policy_value(with_core_impl(GdrCoreImpl::kKernel), "gdr_core_impl"),
            "kernel");
  EXPECT_EQ(execution_policy_value(with_core_impl(GdrCoreImpl::kComposite), "gdr_core_impl"),
            "composite");
}

TEST_F(GdrCoreImplSwitch, InvalidValuesAreRefusedNamingTheSource) {
  ExecutionPolicy refused;
  EXPECT_EQ(
      set_execution_policy_value(refused, "gdr_core_impl", "fast", "--gdr_core_impl").message(),
      "--gdr_core_impl: expected kernel or composite, but got 'fast'");
  EXPECT_EQ(test_support::policy_error("GDR_CORE_IMPL", "Kernel"),
            "GDR_CORE_IMPL: expected kernel or composite, but got 'Kernel'");
  // A value set explicitly does not read the environment at all.
  const ExecutionPolicyGuard guard(with_core_impl(GdrCoreImpl::kKernel));
  EXPECT_EQ(current_execution_policy().gdr_core_impl, GdrCoreImpl::kKernel);
}

TEST_F(GdrCoreImplSwitch, CpuKeepsTheCompositeStepWhateverTheSwitchSays) {
  at::manual_seed(3);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor q = at::randn({1, 70, 2, 64}, f32), k = at::randn({1, 70, 2, 64}, f32);
  q = q / q.norm(2, -1, true);
  k = k / k.norm(2, -1, true);
  const at::Tensor v = at::randn({1, 70, 2, 64}, f32);
  const at::Tensor g = -at::rand({1, 70, 2}, f32), beta = at::rand({1, 70, 2}, f32);
  std::vector<std::tuple<at::Tensor, at::Tensor>> results;
  for (GdrCoreImpl impl : {GdrCoreImpl::kKernel, GdrCoreImpl::kComposite}) {
    const ExecutionPolicyGuard guard(with_core_impl(impl));
    results.push_back(gated_delta_rule_chunked(q, k, v, g, beta, 0.125, std::nullopt, true));
    EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kComposite)
        << execution_policy_value(current_execution_policy(), "gdr_core_impl");
  }
  EXPECT_TRUE(at::equal(std::get<0>(results[0]), std::get<0>(results[1])));
  EXPECT_TRUE(at::equal(std::get<1>(results[0]), std::get<1>(results[1])));
}

TEST_F(GdrCoreImplSwitch, TheOpWiredIntoTheCoreMatchesTheCompositeStepWithGradientsInFp64) {
  at::manual_seed(4);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const int64_t B = 2, T = 45, H = 3, dk = 5, dv = 4;  // chunk 8: 6 chunks, the last padded
  at::Tensor q = at::randn({B, T, H, dk}, f64), k = at::randn({B, T, H, dk}, f64);
  std::vector<at::Tensor> inputs = {q / q.norm(2, -1, true),
                                    k / k.norm(2, -1, true),
                                    at::randn({B, T, H, dv}, f64),
                                    -2.0 * at::rand({B, T, H}, f64),
                                    at::sigmoid(at::randn({B, T, H}, f64)),
                                    at::randn({B, H, dk, dv}, f64)};
  const at::Tensor w_o = at::randn({B, T, H, dv}, f64), w_s = at::randn({B, H, dk, dv}, f64);
  auto run = [&](bool through_op) {
    set_gdr_core_op_on_cpu_for_testing(through_op);
    std::vector<at::Tensor> leaves;
    for (const at::Tensor& t : inputs) leaves.push_back(t.detach().requires_grad_(true));
    auto [o, s] = gated_delta_rule_chunked(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4],
                                           0.4, leaves[5], true, 8);
    EXPECT_EQ(gdr_core_last_step7(), through_op ? GdrCoreImpl::kKernel : GdrCoreImpl::kComposite);
    // The op path hands o over contiguous (Note [Chunk output layout] in
    // ops/gdr_core/gdr_core_op.cc).
    if (through_op) {
      EXPECT_TRUE(o.is_contiguous());
    }
    std::vector<at::Tensor> out = {o.detach(), s.detach()};
    for (const at::Tensor& g : torch::autograd::grad({(o * w_o).sum() + (s * w_s).sum()}, leaves))
      out.push_back(g);
    set_gdr_core_op_on_cpu_for_testing(false);
    return out;
  };
  const std::vector<at::Tensor> composite = run(false), op = run(true);
  const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  for (size_t i = 0; i < op.size(); ++i) {
    EXPECT_LT(max_abs_diff(op[i], composite[i]), 1e-11) << names[i];
  }
  // The hook leaves the CPU path alone when the switch says composite.
  set_gdr_core_op_on_cpu_for_testing(true);
  const ExecutionPolicyGuard composite_step(with_core_impl(GdrCoreImpl::kComposite));
  gated_delta_rule_chunked(inputs[0], inputs[1], inputs[2], inputs[3], inputs[4], 0.4);
  EXPECT_EQ(gdr_core_last_step7(), GdrCoreImpl::kComposite);
  set_gdr_core_op_on_cpu_for_testing(false);
}

}  // namespace
}  // namespace gdr
