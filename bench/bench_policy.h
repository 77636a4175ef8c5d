// The execution policy a benchmark runs under: the defaults with the GDR_* environment
// variables applied (Note [Execution policy] in ops/policy/execution_policy.h), so
// `GDR_ATTENTION=aten <bench>` times what a training run with that variable would run.
#pragma once

#include <cstdio>
#include <optional>
#include <string>

#include "ops/policy/execution_policy.h"

namespace gdr::bench {

// nullopt (after one line on stderr naming the variable) when a variable is invalid.
inline std::optional<ExecutionPolicy> environment_policy(const char* program) {
  ExecutionPolicy policy;
  if (absl::Status s = apply_environment_overrides(policy); !s.ok()) {
    std::fprintf(stderr, "%s: %s\n", program, std::string(s.message()).c_str());
    return std::nullopt;
  }
  for (const std::string& name : unknown_gdr_environment_variables()) {
    std::fprintf(stderr, "%s: warning: %s is set but no part of gdr reads it (a typo?)\n", program,
                 name.c_str());
  }
  return policy;
}

}  // namespace gdr::bench
