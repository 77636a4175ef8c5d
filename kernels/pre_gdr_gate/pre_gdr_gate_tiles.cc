// Host-side tile rules of the pre-GDR gate backward (see pre_gdr_gate.h).
#include "kernels/pre_gdr_gate/pre_gdr_gate.h"

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
    return "threads must be a multiple of 32 in [32, 1024], got " + std::to_string(tile.threads);
  }
  if (tile.block_h < 1 || tile.block_h > tile.threads || tile.threads % tile.block_h != 0) {
    return "block_h must divide threads (" + std::to_string(tile.threads) + "), got " +
           std::to_string(tile.block_h);
  }
  const int rows = tile.threads / tile.block_h;
  if (tile.block_t < rows || tile.block_t > (1 << 16)) {
    return "block_t must be in [threads / block_h = " + std::to_string(rows) + ", 65536], got " +
           std::to_string(tile.block_t);
  }
  return "";
}

GateBackwardLaunch derive_gate_backward_launch(const GateTile& tile, const GateShape& shape) {
  GateBackwardLaunch launch;
  launch.programs_t = (shape.tokens() + tile.block_t - 1) / tile.block_t;
  launch.programs_h = (shape.heads + tile.block_h - 1) / tile.block_h;
  launch.rows = tile.threads / tile.block_h;
  launch.virtual_rows = kGateVirtualRowsPerRow * launch.rows;
  launch.shared_bytes = int64_t{2} * launch.virtual_rows * tile.block_h * int64_t{sizeof(float)};
  launch.scratch_floats = launch.programs_t * 2 * shape.heads;
  return launch;
}

std::string gate_single_pass_unsupported_reason(const GateTile& tile,
                                                const GateBackwardLaunch& launch) {
  if (tile.threads < kSinglePassMinThreads) {
    return "needs a tile of at least " + std::to_string(kSinglePassMinThreads) + " threads (got " +
           to_string(tile) + ")";
  }
  if (launch.programs_h > kGateTicketColumns) {
    return "needs at most " + std::to_string(kGateTicketColumns) +
           " head columns of programs (got " + std::to_string(launch.programs_h) + " with tile " +
           to_string(tile) + ")";
  }
  if (launch.scratch_floats >= (int64_t{1} << 31)) {
    return "needs fewer than 2^31 partial sums (got " + std::to_string(launch.scratch_floats) + ")";
  }
  return "";
}

bool gate_single_pass_supported(const GateTile& tile, const GateBackwardLaunch& launch) {
  return gate_single_pass_unsupported_reason(tile, launch).empty();
}

bool gate_single_pass_preferred(const GateTile& tile, const GateBackwardLaunch& launch,
                                const GateShape& shape, bool capturing) {
  constexpr int64_t kHostBoundElements = int64_t{1} << 19;
  return !capturing && gate_single_pass_supported(tile, launch) &&
         launch.programs_t <= int64_t{kReduceRows} * kSinglePassTailUnroll &&
         shape.tokens() * shape.heads <= kHostBoundElements;
}

// The rule, fitted to the per-tile sweep (bench/pre_gdr_gate_bench --tiles; results in
// docs/benchmarks.md, Decisions) and written as a cost so ties resolve the same way
// everywhere:
//   (1) 256 threads, and 16 head lanes per program (one 32-byte BF16 sector per token
//       row), or, when Hv >= 64, 32 for 16-bit activations and 64 for FP32 (fewer, wider
//       rows won there: at 65536 x 64 FP32 the sweep found 128x64x256 faster than
//       256x32x256);
//   (2) about 640 programs for 16-bit activations, 448 for FP32 (twice the bytes per
//       program): enough to fill a 132-SM part a few times over without a long tail of
//       partial rows for the ordered pass (constants, not a device query, so the choice
//       is a pure function of the shape and dtype);
//   (3) ties to the smaller block_t.
double gate_tile_static_cost(const GateTile& tile, const GateShape& shape,
                             int input_element_bytes) {
  const double kTargetPrograms = input_element_bytes >= 4 ? 448.0 : 640.0;
  const int wide_block_h = input_element_bytes >= 4 ? 64 : 32;
  const int preferred_block_h = shape.heads >= 64 ? wide_block_h : 16;
  const GateBackwardLaunch launch = derive_gate_backward_launch(tile, shape);
  double cost = 0.0;
  if (tile.block_h != preferred_block_h) cost += 1000.0;
  if (tile.threads != 256) cost += 100.0;
  cost += std::abs(std::log2(static_cast<double>(launch.num_programs()) / kTargetPrograms));
  return cost + 1e-6 * tile.block_t;
}

}  // namespace gdr::kernels
