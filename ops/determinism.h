// use_deterministic_mode(): the one switch that sends gdr's ops down their ordered,
// bit-reproducible paths.
//
// Note [Deterministic mode resolution]: the answer is, in order of precedence,
//   1. an in-process override (set_deterministic_mode_override / DeterministicModeGuard),
//   2. the environment variable GDR_DETERMINISTIC (1/true/on or 0/false/off),
//   3. PyTorch's global switch, at::globalContext().deterministicAlgorithms().
// It is read at every call, so flipping any of them between calls switches paths.
#pragma once

#include <optional>

namespace gdr {

bool use_deterministic_mode();

void set_deterministic_mode_override(std::optional<bool> value);
std::optional<bool> deterministic_mode_override();

// Sets the override for a scope and restores the previous one.
class DeterministicModeGuard {
 public:
  explicit DeterministicModeGuard(std::optional<bool> value);
  ~DeterministicModeGuard();
  DeterministicModeGuard(const DeterministicModeGuard&) = delete;
  DeterministicModeGuard& operator=(const DeterministicModeGuard&) = delete;

 private:
  std::optional<bool> previous_;
};

// Parses a boolean environment variable; nullopt when unset or empty. Throws
// c10::Error naming the variable when the value is not a recognised boolean.
std::optional<bool> parse_bool_env(const char* name);

}  // namespace gdr
