// Host-side tile rules of the pre-GDR gate backward (see pre_gdr_gate.h).
#include "kernels/pre_gdr_gate.h"

#include <cmath>

namespace gdr::kernels {

std::string to_string(const GateTile& tile) {
  return std::to_string(tile.block_t) + "x" + std::to_string(tile.block_h) + "x" +
         std::to_string(tile.threads);
}

const std::vector<GateTile>& pre_gdr_gate_candidate_tiles() {
  static const std::vector<GateTile> tiles = [] {
    std::vector<GateTile> out;
    for (int block_t : {32, 64, 128, 256, 512}) {
      for (int block_h : {16, 32, 64}) {
        for (int threads : {128, 256}) {
          GateTile tile{block_t, block_h, threads};
          if (validate_gate_tile(tile).empty()) out.push_back(tile);
        }
      }
    }
    return out;
  }();
  return tiles;
}

std::string validate_gate_tile(const GateTile& tile) {
  if (tile.threads < 32 || tile.threads > 1024 || tile.threads % 32 != 0) {
    return "threads must be a multiple of 32 in [32, 1024], got " +
           std::to_string(tile.threads);
  }
  if (tile.block_h < 1 || tile.block_h > tile.threads || tile.threads % tile.block_h != 0) {
    return "block_h must divide threads (" + std::to_string(tile.threads) + "), got " +
           std::to_string(tile.block_h);
  }
  const int rows = tile.threads / tile.block_h;
  if (tile.block_t < rows || tile.block_t > (1 << 16)) {
    return "block_t must be in [threads / block_h = " + std::to_string(rows) +
           ", 65536], got " + std::to_string(tile.block_t);
  }
  return "";
}

GateBackwardLaunch derive_gate_backward_launch(const GateTile& tile, const GateShape& shape) {
  GateBackwardLaunch launch;
  launch.programs_t = (shape.tokens() + tile.block_t - 1) / tile.block_t;
  launch.programs_h = (shape.heads + tile.block_h - 1) / tile.block_h;
  launch.rows = tile.threads / tile.block_h;
  launch.shared_bytes = int64_t{2} * launch.rows * tile.block_h * int64_t{sizeof(float)};
  launch.scratch_floats = launch.programs_t * 2 * shape.heads;
  return launch;
}

// The model behind the rule: the backward is memory-bound, so what matters is (1) enough
// resident threads to cover HBM latency, which we fix at a reference machine's worth of
// programs (kTargetPrograms, ~2 per SM on a 132-SM part: a constant, not a device query,
// so the choice is a pure function of the shape), (2) lanes wasted when block_h exceeds
// the head count, and (3) the partial rows the ordered pass must read. Ties go to the
// smaller tile, then fewer threads (the spec's "min-cost" order).
double gate_tile_static_cost(const GateTile& tile, const GateShape& shape) {
  constexpr double kTargetPrograms = 264.0;
  const GateBackwardLaunch launch = derive_gate_backward_launch(tile, shape);
  const double lanes_used = static_cast<double>(shape.heads) /
                            static_cast<double>(launch.programs_h * tile.block_h);
  const double elements_per_thread =
      static_cast<double>(tile.block_t) * tile.block_h / tile.threads / lanes_used;
  const double waves = std::ceil(static_cast<double>(launch.num_programs()) / kTargetPrograms);
  const double main_cost = waves * elements_per_thread;
  const double reduce_cost = static_cast<double>(launch.programs_t) / kReduceRows;
  return main_cost + reduce_cost + 1e-6 * tile.block_t * tile.block_h + 1e-9 * tile.threads;
}

}  // namespace gdr::kernels
