// Two-way switches read from the environment at every call (GDR_RMS_NORM=fused|composite,
// GDR_CAUSAL_CONV=kernel|aten, ...): one parser, so every switch treats unset and empty
// alike and refuses anything else with the same message naming the variable. Switches a
// run config can also set (GDR_CORE_IMPL, GDR_CORE_PREP, GDR_ATTENTION) are
// OverridableSwitch objects.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>
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

// A process-wide switch with an in-process override (what a run config's key sets), read
// at every call: the override if set, else the environment variable (unset or empty: the
// default), parsed by `parse`, which names the variable in its error.
template <typename Choice>
class OverridableSwitch {
 public:
  using Parse = Choice (*)(const std::string& text, const std::string& source);
  OverridableSwitch(const char* variable, Choice fallback, Parse parse)
      : variable_(variable), fallback_(fallback), parse_(parse) {}

  void set_override(std::optional<Choice> value) {
    std::lock_guard<std::mutex> lock(mutex_);
    override_ = value;
  }

  Choice get() const {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (override_.has_value()) return *override_;
    }
    const char* env = std::getenv(variable_);
    if (env == nullptr || env[0] == '\0') return fallback_;
    return parse_(env, variable_);
  }

 private:
  const char* variable_;
  Choice fallback_;
  Parse parse_;
  mutable std::mutex mutex_;
  std::optional<Choice> override_;
};

}  // namespace gdr
