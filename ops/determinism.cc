#include "ops/determinism.h"

#include <ATen/Context.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <string>

namespace gdr {
namespace {

// -1 = no override, 0 = false, 1 = true. Atomic because autograd runs backward on its own
// device threads, which must see the override set by the caller's thread.
std::atomic<int> g_override{-1};

}  // namespace

std::optional<bool> parse_bool_env(const char* name) {
  const char* raw = std::getenv(name);
  if (raw == nullptr || raw[0] == '\0') return std::nullopt;
  const std::string value(raw);
  if (value == "1" || value == "true" || value == "TRUE" || value == "on" || value == "yes") {
    return true;
  }
  if (value == "0" || value == "false" || value == "FALSE" || value == "off" || value == "no") {
    return false;
  }
  TORCH_CHECK(false, "environment variable ", name,
              " must be a boolean (1/true/on/yes or 0/false/off/no), but got '", value, "'");
}

bool use_deterministic_mode() {
  const int forced = g_override.load(std::memory_order_relaxed);
  if (forced >= 0) return forced == 1;
  if (std::optional<bool> from_env = parse_bool_env("GDR_DETERMINISTIC")) return *from_env;
  return at::globalContext().deterministicAlgorithms();
}

void set_deterministic_mode_override(std::optional<bool> value) {
  g_override.store(value.has_value() ? (*value ? 1 : 0) : -1, std::memory_order_relaxed);
}

std::optional<bool> deterministic_mode_override() {
  const int forced = g_override.load(std::memory_order_relaxed);
  if (forced < 0) return std::nullopt;
  return forced == 1;
}

DeterministicModeGuard::DeterministicModeGuard(std::optional<bool> value)
    : previous_(deterministic_mode_override()) {
  set_deterministic_mode_override(value);
}

DeterministicModeGuard::~DeterministicModeGuard() { set_deterministic_mode_override(previous_); }

}  // namespace gdr
