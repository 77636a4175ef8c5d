#include "ops/autotune/autotune.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace gdr {
namespace {

std::mutex& cache_mutex() {
  static std::mutex mutex;
  return mutex;
}

std::unordered_map<std::string, int>& cache() {
  static std::unordered_map<std::string, int> map;
  return map;
}

}  // namespace

const char* to_string(SelectionSource source) {
  switch (source) {
    case SelectionSource::kOverride: return "override";
    case SelectionSource::kStaticCost: return "static-cost";
    case SelectionSource::kAutotuneCache: return "autotune-cache";
    case SelectionSource::kAutotuneTimed: return "autotune-timed";
  }
  return "unknown";
}

namespace autotune_internal {

std::optional<int> cached_choice(const std::string& key) {
  std::lock_guard<std::mutex> lock(cache_mutex());
  auto it = cache().find(key);
  if (it == cache().end()) return std::nullopt;
  return it->second;
}

void store_choice(const std::string& key, int index) {
  std::lock_guard<std::mutex> lock(cache_mutex());
  cache()[key] = index;
}

}  // namespace autotune_internal

namespace {
std::atomic<int64_t> g_generation{0};
}  // namespace

void clear_autotune_cache() {
  std::lock_guard<std::mutex> lock(cache_mutex());
  cache().clear();
  g_generation.fetch_add(1);
}

int64_t autotune_cache_generation() { return g_generation.load(); }

int64_t autotune_cache_size() {
  std::lock_guard<std::mutex> lock(cache_mutex());
  return static_cast<int64_t>(cache().size());
}

}  // namespace gdr
