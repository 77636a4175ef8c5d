// autotune_configs: the one tile selector shared by every reducing kernel of gdr.
//
// Note [Tile selection]: both reduction modes take their tile from here.
//   - An explicit override (API or environment variable) wins in both modes.
//   - Deterministic mode: no timing and no tuned-table lookup; the candidate with the
//     lowest static cost (a pure function of the shapes) is taken, so two processes
//     always pick the same tile.
//   - Default mode: every candidate is timed once per cache key and the fastest is
//     cached; later calls with the same key reuse it.
// Pinning the tile does not by itself switch to ordered arithmetic: only
// use_deterministic_mode() does (see Note [Deterministic mode resolution]).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace gdr {

enum class SelectionSource { kOverride, kStaticCost, kAutotuneCache, kAutotuneTimed };

const char* to_string(SelectionSource source);

template <typename Config>
struct TileSelection {
  Config config;
  SelectionSource source;
};

namespace autotune_internal {
std::optional<int> cached_choice(const std::string& key);
void store_choice(const std::string& key, int index);
}  // namespace autotune_internal

// Forgets every timed choice (tests use it to force re-tuning).
void clear_autotune_cache();
int64_t autotune_cache_size();
// Incremented by every clear_autotune_cache(): callers that keep their own copy of a
// choice (e.g. the gate op's per-shape cache) drop it when the generation moves.
int64_t autotune_cache_generation();

// `static_cost` must be a pure function of the shapes; `time_ms` runs one candidate and
// returns its time (it is only called in default mode, on a cache miss). An empty
// `time_ms` means timing is not possible now (e.g. the stream is capturing a CUDA graph):
// a cache miss then takes the static-cost choice without caching it.
template <typename Config>
TileSelection<Config> autotune_configs(const std::vector<Config>& candidates,
                                       const std::string& cache_key, bool deterministic,
                                       const std::optional<Config>& override_config,
                                       const std::function<double(const Config&)>& static_cost,
                                       const std::function<double(const Config&)>& time_ms) {
  TORCH_CHECK(!candidates.empty(), "autotune_configs: empty candidate list for ", cache_key);
  if (override_config.has_value()) return {*override_config, SelectionSource::kOverride};
  auto cheapest = [&] {
    size_t best = 0;
    double best_cost = static_cost(candidates[0]);
    for (size_t i = 1; i < candidates.size(); ++i) {
      const double cost = static_cost(candidates[i]);
      if (cost < best_cost) {
        best = i;
        best_cost = cost;
      }
    }
    return TileSelection<Config>{candidates[best], SelectionSource::kStaticCost};
  };
  if (deterministic) return cheapest();
  if (std::optional<int> cached = autotune_internal::cached_choice(cache_key)) {
    return {candidates[static_cast<size_t>(*cached)], SelectionSource::kAutotuneCache};
  }
  if (!time_ms) return cheapest();
  size_t best = 0;
  double best_ms = time_ms(candidates[0]);
  for (size_t i = 1; i < candidates.size(); ++i) {
    const double ms = time_ms(candidates[i]);
    if (ms < best_ms) {
      best = i;
      best_ms = ms;
    }
  }
  autotune_internal::store_choice(cache_key, static_cast<int>(best));
  return {candidates[best], SelectionSource::kAutotuneTimed};
}

}  // namespace gdr
