// Host-side tile rules of the pre-GDR gate backward (see pre_gdr_gate.h).
#include "kernels/pre_gdr_gate.h"


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

// The rule, fitted to the H200 per-tile sweep (bench/pre_gdr_gate_bench --tiles,
// docs/benchmarks.md) and written as a cost so ties resolve the same way everywhere:
// the backward is memory/instruction bound and wants (1) 16 head lanes (one 32-byte
// BF16 sector per token row) and 256 threads per program, (2) no more than
// kMaxPrograms programs (about 8 resident per SM of a 132-SM part: a constant, not a
// device query, so the choice is a pure function of the shape), then (3) the smallest
// block_t, i.e. the most parallelism, and the fewest partial rows for the ordered pass.
double gate_tile_static_cost(const GateTile& tile, const GateShape& shape) {
  constexpr int64_t kMaxPrograms = 1024;
  const GateBackwardLaunch launch = derive_gate_backward_launch(tile, shape);
  double cost = 0.0;
  if (tile.block_h != 16) cost += 4000.0;
  if (tile.threads != 256) cost += 2000.0;
  if (launch.num_programs() > kMaxPrograms) {
    cost += 1000.0 * static_cast<double>(launch.num_programs()) / kMaxPrograms;
  }
  return cost + tile.block_t;
}

}  // namespace gdr::kernels
