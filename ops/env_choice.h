// Two-way switches read from the environment at every call (GDR_RMS_NORM=fused|composite,
// GDR_CAUSAL_CONV=kernel|aten, ...): one parser, so every switch treats unset and empty
// alike and refuses anything else with the same message naming the variable.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string_view>

namespace gdr {

// False when `variable` is unset, empty or `first`; true when it is `second`; otherwise
// an error "<variable>: expected <first> or <second>, but got '<value>'".
inline bool env_picks_second(const char* variable, const char* first, const char* second) {
  const char* env = std::getenv(variable);
  if (env == nullptr || env[0] == '\0') return false;
  const std::string_view value(env);
  if (value == first) return false;
  if (value == second) return true;
  TORCH_CHECK(false, variable, ": expected ", first, " or ", second, ", but got '", value, "'");
}

}  // namespace gdr
