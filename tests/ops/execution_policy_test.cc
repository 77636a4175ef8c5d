// The execution policy (Note [Execution policy]): its defaults, every key's parser and its
// exact messages, the environment overrides, the rule between choices, the guard, and the
// forward's policy in an autograd backward.
#include "ops/policy/execution_policy.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/equal.h>
#include <ATen/ops/full.h>
#include <ATen/ops/ones.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "ops/policy/autograd_policy.h"
#include "ops/policy/determinism.h"

namespace gdr {
namespace {

using Environment = std::map<std::string, std::string>;

EnvironmentReader reader_of(const Environment& env) {
  return [&env](const char* name) -> const char* {
    auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  };
}

// The policy the environment `env` makes of the defaults, or the error message.
std::string apply(const Environment& env, ExecutionPolicy* policy) {
  const absl::Status status = apply_environment_overrides(*policy, reader_of(env));
  return status.ok() ? "" : std::string(status.message());
}

TEST(ExecutionPolicy, DefaultsAreTheFastPathsAndPrintInFull) {
  EXPECT_EQ(describe_execution_policy(ExecutionPolicy{}),
            "deterministic=false deterministic_fill_uninitialized_memory=false "
            "pre_gdr_fusion=gate pre_gdr_gate_tile=auto pre_gdr_gate_ordered=auto "
            "gdr_core_impl=kernel gdr_core_prep=kernel chunk_scan_tensor_cores=true "
            "chunk_prep_tensor_cores=true chunk_gemm_tensor_cores=true chunk_gemm_wgmma=true "
            "chunk_gemm_overlap=true gdr_core_v_fp32=false attention=cudnn rms_norm=fused "
            "rms_norm_kernel=resident add_rms_norm=fused causal_conv=kernel "
            "gated_activation=fused rope=fused cross_entropy=fused tied_embedding=fused "
            "linear_group=fused cuda_graphs=true recompute=none");
  EXPECT_EQ(&current_execution_policy(), &current_execution_policy());
  EXPECT_EQ(current_execution_policy(), ExecutionPolicy{});
}

TEST(ExecutionPolicy, EveryKeyHasAConfigKeyADefaultAndAtMostOneVariable) {
  std::set<std::string> variables;
  for (const ExecutionPolicyKey& key : execution_policy_keys()) {
    EXPECT_FALSE(key.values.empty()) << key.key;
    EXPECT_EQ(execution_policy_value(ExecutionPolicy{}, key.key), key.default_value) << key.key;
    EXPECT_TRUE(absl::StartsWith(key.config_key, "kernels.") ||
                key.config_key == "model.deterministic_mode" ||
                key.config_key == "model.pre_gdr_fusion" || key.config_key == "train.cuda_graphs" ||
                key.config_key == "train.recompute")
        << key.config_key;
    if (!key.variable.empty()) {
      EXPECT_TRUE(absl::StartsWith(key.variable, "GDR_")) << key.variable;
      EXPECT_TRUE(variables.insert(key.variable).second) << key.variable << " twice";
    }
  }
  EXPECT_EQ(variables.size(), 23u);
}

TEST(ExecutionPolicy, TheEnvironmentSetsEveryChoiceItNames) {
  const Environment env = {
      {"GDR_DETERMINISTIC", "1"},
      {"GDR_DETERMINISTIC_FILL_UNINITIALIZED_MEMORY", "true"},
      {"GDR_PRE_GDR_GATE_TILE", "128x16x256"},
      {"GDR_PRE_GDR_GATE_ORDERED", "two_pass"},
      {"GDR_CORE_IMPL", "composite"},
      {"GDR_CORE_PREP", "aten"},
      {"GDR_CHUNK_SCAN_TC", "0"},
      {"GDR_CHUNK_PREP_TC", "0"},
      {"GDR_CHUNK_GEMM_TC", "false"},
      {"GDR_CHUNK_GEMM_WGMMA", "0"},
      {"GDR_CHUNK_GEMM_OVERLAP", "0"},
      {"GDR_CORE_V_FP32", "1"},
      {"GDR_ATTENTION", "aten"},
      {"GDR_RMS_NORM", "composite"},
      {"GDR_RMS_NORM_KERNEL", "streaming"},
      {"GDR_ADD_RMS_NORM", "composite"},
      {"GDR_CAUSAL_CONV", "aten"},
      {"GDR_GATED_ACTIVATION", "composite"},
      {"GDR_ROPE", "composite"},
      {"GDR_CROSS_ENTROPY", "composite"},
      {"GDR_TIED_EMBEDDING", "composite"},
      {"GDR_LINEAR_GROUP", "composite"},
      {"GDR_RECOMPUTE", "full"},
  };
  ExecutionPolicy p;
  std::vector<std::string> changed;
  ASSERT_TRUE(apply_environment_overrides(p, reader_of(env), &changed).ok());
  EXPECT_EQ(changed.size(), env.size());
  EXPECT_EQ(describe_execution_policy(p),
            "deterministic=true deterministic_fill_uninitialized_memory=true "
            "pre_gdr_fusion=gate pre_gdr_gate_tile=128x16x256 pre_gdr_gate_ordered=two_pass "
            "gdr_core_impl=composite gdr_core_prep=aten chunk_scan_tensor_cores=false "
            "chunk_prep_tensor_cores=false chunk_gemm_tensor_cores=false chunk_gemm_wgmma=false "
            "chunk_gemm_overlap=false gdr_core_v_fp32=true attention=aten rms_norm=composite "
            "rms_norm_kernel=streaming add_rms_norm=composite causal_conv=aten "
            "gated_activation=composite rope=composite cross_entropy=composite "
            "tied_embedding=composite linear_group=composite cuda_graphs=true recompute=full");
  ASSERT_TRUE(p.gate_tile.has_value());
  EXPECT_EQ(*p.gate_tile, (kernels::GateTile{128, 16, 256}));
}

TEST(ExecutionPolicy, EveryValueOfEveryEnumChoiceParsesAndPrintsBack) {
  for (const ExecutionPolicyKey& key : execution_policy_keys()) {
    if (key.key == "pre_gdr_gate_tile") continue;  // a pattern, not a list
    for (const std::string& value : key.values) {
      ExecutionPolicy p;
      ASSERT_TRUE(set_execution_policy_value(p, key.key, value, key.config_key).ok())
          << key.key << "=" << value;
      EXPECT_EQ(execution_policy_value(p, key.key), value) << key.key;
    }
  }
  ExecutionPolicy p;
  ASSERT_TRUE(set_execution_policy_value(p, "pre_gdr_gate_ordered", "single_pass", "s").ok());
  EXPECT_EQ(p.gate_ordered, GateOrderedVariant::kSinglePass);
}

TEST(ExecutionPolicy, UnsetAndEmptyVariablesKeepTheChoice) {
  ExecutionPolicy p;
  p.rms_norm = RmsNormImpl::kComposite;
  EXPECT_EQ(apply({{"GDR_RMS_NORM", ""}}, &p), "");
  EXPECT_EQ(p.rms_norm, RmsNormImpl::kComposite);
  EXPECT_EQ(apply({}, &p), "");
  EXPECT_EQ(p.rms_norm, RmsNormImpl::kComposite);
  EXPECT_EQ(apply({{"GDR_RMS_NORM", "fused"}}, &p), "");
  EXPECT_EQ(p.rms_norm, RmsNormImpl::kFused);
}

TEST(ExecutionPolicy, AnInvalidValueNamesTheVariableAndWhatIsExpected) {
  const std::pair<Environment, std::string> cases[] = {
      {{{"GDR_RMS_NORM", "fast"}}, "GDR_RMS_NORM: expected fused or composite, but got 'fast'"},
      {{{"GDR_ADD_RMS_NORM", "yes"}},
       "GDR_ADD_RMS_NORM: expected fused or composite, but got 'yes'"},
      {{{"GDR_CAUSAL_CONV", "cudnn"}}, "GDR_CAUSAL_CONV: expected kernel or aten, but got 'cudnn'"},
      {{{"GDR_CROSS_ENTROPY", "fast"}},
       "GDR_CROSS_ENTROPY: expected fused or composite, but got 'fast'"},
      {{{"GDR_GATED_ACTIVATION", "fast"}},
       "GDR_GATED_ACTIVATION: expected fused or composite, but got 'fast'"},
      {{{"GDR_CORE_PREP", "fast"}}, "GDR_CORE_PREP: expected kernel or aten, but got 'fast'"},
      {{{"GDR_CORE_IMPL", "fast"}}, "GDR_CORE_IMPL: expected kernel or composite, but got 'fast'"},
      {{{"GDR_ATTENTION", "flash"}}, "GDR_ATTENTION: expected cudnn or aten, but got 'flash'"},
      {{{"GDR_RMS_NORM_KERNEL", "fast"}},
       "GDR_RMS_NORM_KERNEL: expected resident or streaming, but got 'fast'"},
      {{{"GDR_CHUNK_SCAN_TC", "2"}},
       "GDR_CHUNK_SCAN_TC: expected true, false, 1 or 0, but got '2'"},
      {{{"GDR_PRE_GDR_GATE_ORDERED", "three_pass"}},
       "GDR_PRE_GDR_GATE_ORDERED: expected auto, single_pass or two_pass, but got 'three_pass'"},
      {{{"GDR_PRE_GDR_GATE_TILE", "128x16"}},
       "GDR_PRE_GDR_GATE_TILE: expected auto or a tile BLOCK_TxBLOCK_HxTHREADS of positive "
       "integers (e.g. 128x16x256), but got '128x16'"},
      {{{"GDR_PRE_GDR_GATE_TILE", "128x0x256"}},
       "GDR_PRE_GDR_GATE_TILE: expected auto or a tile BLOCK_TxBLOCK_HxTHREADS of positive "
       "integers (e.g. 128x16x256), but got '128x0x256'"},
  };
  for (const auto& [env, message] : cases) {
    ExecutionPolicy p;
    EXPECT_EQ(apply(env, &p), message);
    EXPECT_EQ(p, ExecutionPolicy{}) << "a refused value changes nothing";
  }
}

TEST(ExecutionPolicy, ATileTheLaunchRulesRefuseSaysWhy) {
  const kernels::GateTile tile{128, 16, 100};
  const std::string problem = kernels::validate_gate_tile(tile);
  ASSERT_FALSE(problem.empty());
  ExecutionPolicy p;
  EXPECT_EQ(apply({{"GDR_PRE_GDR_GATE_TILE", "128x16x100"}}, &p),
            "GDR_PRE_GDR_GATE_TILE: tile 128x16x100 cannot be launched: " + problem);
  EXPECT_EQ(apply({{"GDR_PRE_GDR_GATE_TILE", "auto"}}, &p), "");
  EXPECT_FALSE(p.gate_tile.has_value());
}

TEST(ExecutionPolicy, ConfigKeysParseTheSameValuesAndNameTheirSource) {
  ExecutionPolicy p;
  ASSERT_TRUE(
      set_execution_policy_value(p, "rms_norm", "composite", "x.yaml: kernels.rms_norm").ok());
  EXPECT_EQ(p.rms_norm, RmsNormImpl::kComposite);
  ASSERT_TRUE(set_execution_policy_value(p, "chunk_gemm_wgmma", "false", "s").ok());
  EXPECT_FALSE(p.chunk_gemm_wgmma);
  EXPECT_EQ(execution_policy_value(p, "chunk_gemm_wgmma"), "false");
  EXPECT_EQ(
      set_execution_policy_value(p, "attention", "flash", "x.yaml: kernels.attention").message(),
      "x.yaml: kernels.attention: expected cudnn or aten, but got 'flash'");
  EXPECT_EQ(
      set_execution_policy_value(p, "rms_norms", "fused", "x.yaml: kernels.rms_norms").message(),
      "x.yaml: kernels.rms_norms: unknown key");
}

TEST(ExecutionPolicy, DeterministicModeRejectsFullFusion) {
  ExecutionPolicy p;
  p.pre_gdr_fusion = PreGdrFusion::kFull;
  EXPECT_TRUE(validate_execution_policy(p).ok());
  p.deterministic = true;
  const absl::Status status = validate_execution_policy(p);
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(status.message(),
            "deterministic_mode: true cannot be combined with pre_gdr_fusion: full (the fully "
            "fused pre-GDR path has no ordered, bit-reproducible backward); use pre_gdr_fusion: "
            "gate or none");
  p.pre_gdr_fusion = PreGdrFusion::kGate;
  EXPECT_TRUE(validate_execution_policy(p).ok());
}

TEST(ExecutionPolicy, DifferencesNameTheKeysThatDiffer) {
  ExecutionPolicy a, b;
  b.attention = AttentionBackend::kAten;
  b.gate_tile = kernels::GateTile{128, 16, 256};
  const std::string da = describe_execution_policy(a), db = describe_execution_policy(b);
  EXPECT_EQ(execution_policy_differences(da, db),
            (std::vector<std::string>{"attention", "pre_gdr_gate_tile"}));
  EXPECT_TRUE(execution_policy_differences(da, da).empty());
  EXPECT_EQ(execution_policy_differences("rope=fused", "rope=fused rms_norm=fused"),
            (std::vector<std::string>{"rms_norm"}));
}

TEST(ExecutionPolicy, AGuardIsCurrentOnItsThreadOnlyAndNests) {
  ExecutionPolicy outer, inner;
  outer.rope = RopeImpl::kComposite;
  inner.rope = RopeImpl::kComposite;
  inner.linear_group = LinearGroupImpl::kComposite;
  {
    const ExecutionPolicyGuard a(outer);
    EXPECT_EQ(current_execution_policy(), outer);
    {
      const ExecutionPolicyGuard b(inner);
      EXPECT_EQ(current_execution_policy(), inner);
      ExecutionPolicy seen_elsewhere = inner;
      std::thread([&] { seen_elsewhere = current_execution_policy(); }).join();
      EXPECT_EQ(seen_elsewhere, ExecutionPolicy{});
    }
    EXPECT_EQ(current_execution_policy(), outer);
  }
  EXPECT_EQ(current_execution_policy(), ExecutionPolicy{});
}

TEST(ExecutionPolicy, EqualPoliciesShareOneInternedId) {
  ExecutionPolicy p;
  p.cross_entropy = CrossEntropyImpl::kComposite;
  const int64_t id = intern_execution_policy(p);
  EXPECT_EQ(intern_execution_policy(p), id);
  EXPECT_EQ(intern_execution_policy(ExecutionPolicy{}), 0);
  EXPECT_NE(id, 0);
  {
    const ExecutionPolicyGuard guard(id);
    EXPECT_EQ(current_execution_policy_id(), id);
    EXPECT_EQ(current_execution_policy(), p);
  }
  EXPECT_EQ(current_execution_policy_id(), 0);
  try {
    const ExecutionPolicyGuard bad(int64_t{1} << 40);
    ADD_FAILURE() << "an id never interned must be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("ExecutionPolicyGuard: no execution policy was interned under id "
                        "1099511627776"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

// Records the policy its backward runs under.
struct PolicySeen : torch::autograd::Function<PolicySeen> {
  static ExecutionPolicy* seen;
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x) {
    save_execution_policy(ctx);
    return x * 2;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
    *seen = current_execution_policy();
    return {grads[0] * 2};
  }
};
ExecutionPolicy* PolicySeen::seen = nullptr;

TEST(ExecutionPolicy, ABackwardRunsUnderItsForwardsPolicy) {
  ExecutionPolicy forward_policy, backward_seen;
  forward_policy.rms_norm_kernel = RmsNormKernel::kStreaming;
  PolicySeen::seen = &backward_seen;
  const at::Tensor x = at::ones({3}).requires_grad_(true);
  at::Tensor y;
  {
    const ExecutionPolicyGuard guard(forward_policy);
    y = PolicySeen::apply(x).sum();
  }
  y.backward();  // outside the forward's guard
  EXPECT_EQ(backward_seen, forward_policy);
  EXPECT_EQ(current_execution_policy(), ExecutionPolicy{});
  EXPECT_TRUE(at::equal(x.grad(), at::full({3}, 2.0)));
}

TEST(ExecutionPolicy, MisspeltGdrVariablesAreFound) {
  setenv("GDR_RMSNORM", "composite", 1);
  setenv("GDR_RMS_NORM", "composite", 1);
  const std::vector<std::string> unknown = unknown_gdr_environment_variables();
  unsetenv("GDR_RMSNORM");
  unsetenv("GDR_RMS_NORM");
  EXPECT_EQ(unknown, std::vector<std::string>{"GDR_RMSNORM"});
}

TEST(ExecutionPolicy, DeterministicModeFromTheEnvironmentIsReadAtEveryCall) {
  const DeterministicModeGuard no_override(std::nullopt);
  setenv("GDR_DETERMINISTIC", "1", 1);
  EXPECT_TRUE(use_deterministic_mode());
  setenv("GDR_DETERMINISTIC", "off", 1);
  EXPECT_FALSE(use_deterministic_mode());
  setenv("GDR_DETERMINISTIC", "maybe", 1);
  try {
    use_deterministic_mode();
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_EQ(std::string(e.what_without_backtrace()),
              "environment variable GDR_DETERMINISTIC must be a boolean (1/true/on/yes or "
              "0/false/off/no), but got 'maybe'");
  }
  unsetenv("GDR_DETERMINISTIC");
}

}  // namespace
}  // namespace gdr
