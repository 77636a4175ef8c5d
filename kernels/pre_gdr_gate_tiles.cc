// Host-side tile rules of the pre-GDR gate backward (see pre_gdr_gate.h).
#include "kernels/pre_gdr_gate.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

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

namespace {

// The backward's reduction tree stays within 32 KB of shared memory (plus the head table,
// within the 48 KB every launch may use without an opt-in).
constexpr int64_t kTreeBytesLimit = 32 * 1024;

int backward_vector_width(const GateTile& tile, int64_t heads) {
  for (int vec : {8, 4}) {
    if (heads % vec == 0 && tile.block_h % vec == 0 &&
        int64_t{2} * vec * tile.threads * int64_t{sizeof(float)} <= kTreeBytesLimit) {
      return vec;
    }
  }
  return 1;
}

}  // namespace

GateBackwardLaunch derive_gate_backward_launch(const GateTile& tile, const GateShape& shape) {
  GateBackwardLaunch launch;
  launch.programs_t = (shape.tokens() + tile.block_t - 1) / tile.block_t;
  launch.programs_h = (shape.heads + tile.block_h - 1) / tile.block_h;
  launch.vec = backward_vector_width(tile, shape.heads);
  launch.lanes = tile.block_h / launch.vec;
  launch.rows = std::min(tile.threads / launch.lanes, tile.block_t);
  launch.threads = (launch.lanes * launch.rows + 31) / 32 * 32;
  launch.shared_bytes = gate_backward_shared_floats(tile, launch) * int64_t{sizeof(float)};
  launch.scratch_floats = launch.programs_t * 2 * shape.heads;
  return launch;
}

int64_t gate_backward_shared_floats(const GateTile& tile, const GateBackwardLaunch& launch) {
  const int64_t tree = int64_t{2} * launch.vec * launch.rows * launch.lanes;
  return int64_t{2} * tile.block_h + std::max<int64_t>(tree, launch.threads);
}

namespace {

int64_t element_bytes(ScalarKind kind) { return kind == ScalarKind::kFloat32 ? 4 : 2; }

// A vec-wide access at `data` (and at every multiple of vec elements after it) is aligned.
bool is_aligned(const void* data, int vec, int64_t element_size) {
  const int64_t align = std::min<int64_t>(16, vec * element_size);
  return reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(align) == 0;
}

GateOperandPlan plan_operand(const StridedOperand& op, const GateShape& shape, int vec,
                             int64_t element_size) {
  GateOperandPlan plan;
  plan.data = op.data;
  plan.stride0 = op.stride0;
  plan.stride1 = op.stride1;
  plan.stride_h = shape.heads == 1 ? 1 : op.stride_h;
  if (shape.dim0 == 1) {
    plan.token_linear = true;
    plan.stride_t = op.stride1;
  } else if (shape.dim1 == 1) {
    plan.token_linear = true;
    plan.stride_t = op.stride0;
  } else if (op.stride0 == shape.dim1 * op.stride1) {
    plan.token_linear = true;
    plan.stride_t = op.stride1;
  }
  if (vec > 1 && plan.stride_h == 1) {
    const bool base_ok = is_aligned(op.data, vec, element_size);
    // Row starts are multiples of vec elements (then vec * element_size bytes apart, a
    // multiple of `align`); head vectors start at multiples of vec within a row.
    const bool rows_ok =
        (shape.dim0 == 1 || op.stride0 % vec == 0) && (shape.dim1 == 1 || op.stride1 % vec == 0);
    plan.vector = base_ok && rows_ok;
  }
  return plan;
}

GateTokenSplit plan_token_split(const GateShape& shape) {
  GateTokenSplit split;
  split.dim1 = shape.dim1;
  if (shape.tokens() >= (int64_t{1} << 31)) return split;
  // Division by a runtime constant d < 2^31 for dividends n < 2^31:
  // n / d = (umulhi(n, magic) + n) >> shift (Granlund-Montgomery, as in ATen's IntDivider).
  const uint32_t divisor = static_cast<uint32_t>(shape.dim1);
  uint32_t shift = 0;
  while (shift < 32 && (uint64_t{1} << shift) < divisor) ++shift;
  split.shift = shift;
  split.magic = static_cast<uint32_t>(
      ((uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor)) / divisor + 1);
  split.fast = true;
  return split;
}

}  // namespace

GateForwardPlan plan_gate_forward(const GateForwardArgs& args) {
  GateForwardPlan plan;
  const GateShape& shape = args.shape;
  plan.tokens = shape.tokens();
  plan.heads = static_cast<int>(shape.heads);
  plan.vec = shape.heads % 8 == 0 ? 8 : shape.heads % 4 == 0 ? 4 : 1;
  plan.head_vecs = plan.heads / plan.vec;
  plan.block_x = std::min(plan.head_vecs, kForwardThreads);
  plan.block_y = std::max(1, kForwardThreads / plan.block_x);
  // Enough token rows per thread to keep several 16-byte loads in flight on large
  // problems, few enough that small ones still spread over every SM.
  const int64_t thread_items = plan.tokens * plan.head_vecs;
  plan.items = thread_items >= (int64_t{1} << 19) ? 4 : thread_items >= (int64_t{1} << 17) ? 2 : 1;
  // Small problems (the 0.8B shape is 16k thread items): narrower blocks, so that the grid
  // still reaches about two blocks per SM of a 132-SM part instead of 64 full ones.
  auto grid_for = [&](int block_y) {
    const int64_t rows_per_block = int64_t{block_y} * plan.items;
    return (plan.tokens + rows_per_block - 1) / rows_per_block;
  };
  while (plan.block_y > 1 && plan.block_x * plan.block_y > 64 && grid_for(plan.block_y) < 256) {
    plan.block_y /= 2;
  }
  plan.grid = grid_for(plan.block_y);
  plan.input_kind = args.input_kind;
  plan.param_kind = args.param_kind;
  const int64_t in_bytes = element_bytes(args.input_kind);
  plan.a = plan_operand(args.a, shape, plan.vec, in_bytes);
  plan.b = plan_operand(args.b, shape, plan.vec, in_bytes);
  plan.split = !(plan.a.token_linear && plan.b.token_linear);
  plan.token_split = plan_token_split(shape);
  plan.A_log = args.A_log;
  plan.dt_bias = args.dt_bias;
  plan.g = args.g;
  plan.beta = args.beta;
  plan.out_vector = is_aligned(args.g, plan.vec, 4) && is_aligned(args.beta, plan.vec, 4);
  return plan;
}

GateBackwardPlan plan_gate_backward(const GateBackwardArgs& args, const GateTile& tile) {
  GateBackwardPlan plan;
  const GateShape& shape = args.shape;
  plan.tokens = shape.tokens();
  plan.heads = static_cast<int>(shape.heads);
  plan.block_t = tile.block_t;
  plan.block_h = tile.block_h;
  plan.launch = derive_gate_backward_launch(tile, shape);
  plan.input_kind = args.input_kind;
  plan.param_kind = args.param_kind;
  const int vec = plan.launch.vec;
  const int64_t in_bytes = element_bytes(args.input_kind);
  plan.a = plan_operand(args.a, shape, vec, in_bytes);
  plan.b = plan_operand(args.b, shape, vec, in_bytes);
  plan.grad_g = plan_operand(args.grad_g, shape, vec, 4);
  plan.grad_beta = plan_operand(args.grad_beta, shape, vec, 4);
  plan.split = !(plan.a.token_linear && plan.b.token_linear && plan.grad_g.token_linear &&
                 plan.grad_beta.token_linear);
  plan.token_split = plan_token_split(shape);
  plan.A_log = args.A_log;
  plan.dt_bias = args.dt_bias;
  plan.da = args.da;
  plan.db = args.db;
  plan.out_vector = is_aligned(args.da, vec, in_bytes) && is_aligned(args.db, vec, in_bytes);
  return plan;
}

// The rule, fitted to the H200 per-tile sweep (bench/pre_gdr_gate_bench --tiles; table
// in docs/benchmarks.md) and written as a cost so ties resolve the same way everywhere:
//   (1) 256 threads, and 16 head lanes per program (one 32-byte BF16 sector per token
//       row), or 32 when Hv >= 64 (fewer, wider rows won there);
//   (2) about 640 programs for 16-bit activations, 448 for FP32 (twice the bytes per
//       program): enough to fill a 132-SM part a few times over without a long tail of
//       partial rows for the ordered pass (constants, not a device query, so the choice
//       is a pure function of the shape and dtype);
//   (3) ties to the smaller block_t.
double gate_tile_static_cost(const GateTile& tile, const GateShape& shape,
                             int input_element_bytes) {
  const double kTargetPrograms = input_element_bytes >= 4 ? 448.0 : 640.0;
  const int preferred_block_h = shape.heads >= 64 ? 32 : 16;
  const GateBackwardLaunch launch = derive_gate_backward_launch(tile, shape);
  double cost = 0.0;
  if (tile.block_h != preferred_block_h) cost += 1000.0;
  if (tile.threads != 256) cost += 100.0;
  cost += std::abs(std::log2(static_cast<double>(launch.num_programs()) / kTargetPrograms));
  return cost + 1e-6 * tile.block_t;
}

}  // namespace gdr::kernels
