// PolicyForTest: a test's execution policy (ops/policy/execution_policy.h), changed one
// choice at a time the way a run config or the environment changes it, and current on this
// thread for the object's lifetime. set() takes a GDR_* variable name (parsed as the
// environment override would parse it) or a policy key (as kernels.<key> in a run config);
// unset() puts that choice back to its default. An invalid value is a test failure; the
// messages of invalid values are checked through policy_error(). ScopedPolicyChoice changes
// one field of the current policy (keeping the rest) for a nested scope.
#pragma once

#include <gtest/gtest.h>

#include <map>
#include <optional>
#include <string>

#include "ops/policy/execution_policy.h"

namespace gdr::test_support {

class PolicyForTest {
 public:
  PolicyForTest() { apply(); }
  PolicyForTest(const char* name, const char* value) { set(name, value); }
  PolicyForTest(const PolicyForTest&) = delete;
  PolicyForTest& operator=(const PolicyForTest&) = delete;

  void set(const std::string& name, const std::string& value) {
    values_[name] = value;
    apply();
  }
  void unset(const std::string& name) {
    values_.erase(name);
    apply();
  }
  const ExecutionPolicy& policy() const { return policy_; }

 private:
  void apply() {
    guard_.reset();
    ExecutionPolicy policy;
    for (const auto& [name, value] : values_) {
      const absl::Status status =
          name.rfind("GDR_", 0) == 0
              ? apply_environment_overrides(policy,
                                            [&](const char* variable) -> const char* {
                                              return name == variable ? value.c_str() : nullptr;
                                            })
              : set_execution_policy_value(policy, name, value, name);
      EXPECT_TRUE(status.ok()) << status;
    }
    policy_ = policy;
    guard_.emplace(policy_);
  }

  std::map<std::string, std::string> values_;
  ExecutionPolicy policy_;
  std::optional<ExecutionPolicyGuard> guard_;
};

// The current policy with one field changed, current on this thread for the object's
// lifetime, e.g. ScopedPolicyChoice<&ExecutionPolicy::chunk_scan_tensor_cores> simt(false);
template <auto kChoice>
class ScopedPolicyChoice {
 public:
  template <typename Value>
  explicit ScopedPolicyChoice(Value value) : guard_(changed(value)) {}
  ScopedPolicyChoice(const ScopedPolicyChoice&) = delete;
  ScopedPolicyChoice& operator=(const ScopedPolicyChoice&) = delete;

 private:
  template <typename Value>
  static ExecutionPolicy changed(Value value) {
    ExecutionPolicy policy = current_execution_policy();
    policy.*kChoice = value;
    return policy;
  }

  ExecutionPolicyGuard guard_;
};

// The error the environment override gives for `variable` set to `value` ("" when valid).
inline std::string policy_error(const char* variable, const char* value) {
  ExecutionPolicy policy;
  const absl::Status status =
      apply_environment_overrides(policy, [&](const char* name) -> const char* {
        return std::string(name) == variable ? value : nullptr;
      });
  return status.ok() ? "" : std::string(status.message());
}

}  // namespace gdr::test_support
