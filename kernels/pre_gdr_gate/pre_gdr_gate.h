// The pre-GDR gate kernels: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b),
// and their backward, whose per-head A_log / dt_bias gradients reduce over every token.
// Spec: shared design note pre_gdr_gate.md. Plain C++ (no CUDA or torch headers) so the
// tile rules below are testable on machines without a GPU.
//
// Layout contract: a, b, grad_g, grad_beta are [dim0, dim1, heads] with arbitrary element
// strides (a 2-D tensor is [1, tokens, heads]); g, beta, da, db are written contiguous.
// Math is FP32 whatever the storage type. Every launcher runs on the stream it is given.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

struct CUstream_st;

namespace gdr::kernels {

enum class ScalarKind : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// A strided [dim0, dim1, heads] operand.
struct StridedOperand {
  const void* data = nullptr;
  int64_t stride0 = 0;
  int64_t stride1 = 0;
  int64_t stride_h = 0;
};

struct GateShape {
  int64_t dim0 = 0;
  int64_t dim1 = 0;
  int64_t heads = 0;
  int64_t tokens() const { return dim0 * dim1; }
};

// Note [Gate backward virtual rows] (in the .cu): a program's tokens are summed per head
// in kGateVirtualRowsPerRow * rows virtual rows (token i of the tile in row i % that),
// then the rows in order; the scalar and the vectorised backward both follow it.
constexpr int kGateVirtualRowsPerRow = 4;

// One backward tile: each program reduces block_t tokens x block_h heads with `threads`
// threads laid out as (threads / block_h) token rows of block_h head lanes.
struct GateTile {
  int block_t = 0;
  int block_h = 0;
  int threads = 0;
  bool operator==(const GateTile& o) const {
    return block_t == o.block_t && block_h == o.block_h && threads == o.threads;
  }
};

std::string to_string(const GateTile& tile);

// Everything a backward launch derives from (tile, shape). Note [Gate tile decides
// everything]: the chosen tile alone sets grid, scratch capacity and launch parameters,
// in both reduction modes, so an override or a runtime mode flip cannot desynchronise
// the scratch size from the grid that fills it.
struct GateBackwardLaunch {
  int64_t programs_t = 0;      // grid.x
  int64_t programs_h = 0;      // grid.y
  int rows = 0;                // token rows per program = threads / block_h
  int virtual_rows = 0;        // kGateVirtualRowsPerRow * rows (the in-block sum order)
  int64_t shared_bytes = 0;    // 2 * virtual_rows * block_h floats
  int64_t scratch_floats = 0;  // ordered mode: programs_t * 2 * heads partial sums
  int64_t num_programs() const { return programs_t * programs_h; }
};

// The one candidate list shared by the timing autotuner and the deterministic rule.
const std::vector<GateTile>& pre_gdr_gate_candidate_tiles();

// Empty when `tile` can be launched, otherwise a sentence saying what is wrong.
std::string validate_gate_tile(const GateTile& tile);

GateBackwardLaunch derive_gate_backward_launch(const GateTile& tile, const GateShape& shape);

// The fixed cost rule of deterministic mode: a pure function of the shape and the
// activation element size (no timing, no device query), so every process picks the same
// tile. Lower is better.
double gate_tile_static_cost(const GateTile& tile, const GateShape& shape,
                             int input_element_bytes = 2);

// Launch-parameter constants of the ordered second pass (a fixed shape: see the .cu).
constexpr int kReduceSlotsPerBlock = 32;
constexpr int kReduceRows = 32;

struct GateForwardArgs {
  GateShape shape;
  ScalarKind input_kind = ScalarKind::kFloat32;  // a and b
  ScalarKind param_kind = ScalarKind::kFloat32;  // A_log and dt_bias
  StridedOperand a, b;
  const void* A_log = nullptr;  // [heads], contiguous
  const void* dt_bias = nullptr;
  float* g = nullptr;     // [tokens, heads] contiguous FP32
  float* beta = nullptr;  // [tokens, heads] contiguous FP32
};

struct GateBackwardArgs {
  GateShape shape;
  ScalarKind input_kind = ScalarKind::kFloat32;
  ScalarKind param_kind = ScalarKind::kFloat32;
  StridedOperand a, b;
  StridedOperand grad_g, grad_beta;  // FP32
  const void* A_log = nullptr;
  const void* dt_bias = nullptr;
  void* da = nullptr;  // [tokens, heads] contiguous, input_kind
  void* db = nullptr;
  // kOrderedSinglePass only: outputs ([heads], param_kind) and the ticket slot, an index
  // in [0, kGateTicketSlots) that the launch must not share with any launch that may run
  // concurrently: it owns kGateTicketColumns counters, one per head column of programs
  // (Note [Single-pass ordered reduction] in the .cu), which the kernel leaves zero.
  void* dA_log = nullptr;
  void* ddt_bias = nullptr;
  int ticket_slot = -1;
};

// kAtomic: per-program sums atomically added (default mode; bits may vary run to run).
// kOrdered: partial rows + the ordered second kernel (launch_..._reduce_partials).
// kOrderedSinglePass: partial rows, summed by the last program to finish in the same
// order as kOrdered's second kernel, so both give the same bits (Note [Single-pass
// ordered reduction] in the .cu); needs gate_single_pass_supported.
enum class GateReduction { kAtomic, kOrdered, kOrderedSinglePass };

constexpr int kSinglePassMinThreads = 256;
constexpr int kGateTicketSlots = 4096;
constexpr int kGateTicketColumns = 8;  // head columns (grid.y) a single-pass launch may have

// Empty when the single-pass variant can run this launch, otherwise what stops it: it
// needs tile.threads >= 256 (the tail's layout), at most kGateTicketColumns head columns,
// and partial-row offsets that fit 32 bits (the tail indexes with them).
std::string gate_single_pass_unsupported_reason(const GateTile& tile,
                                                const GateBackwardLaunch& launch);
bool gate_single_pass_supported(const GateTile& tile, const GateBackwardLaunch& launch);

// Partial rows the single-pass tail loads per virtual row in one round.
constexpr int kSinglePassTailUnroll = 8;

// The automatic choice between the ordered variants (both give the same bits, so this is
// about speed alone; a pure function of its arguments): the single pass for eager launches
// of at most 2^19 elements (where the host's launch work outlasts the GPU's) whose head
// columns have at most kReduceRows * kSinglePassTailUnroll = 256 programs each (the tail
// is then one round of loads); the two pass otherwise and under graph capture. Eager calls
// at those shapes pay host time per launch, and the second launch costs the host more than
// the single pass's tail costs the GPU; in a graph the launches are free and the two
// pass's short reduce kernel (launched early, Note [Gate reduce launched early]) beats the
// tail's ticket and reloads (measured: docs/benchmarks.md, Decisions).
bool gate_single_pass_preferred(const GateTile& tile, const GateBackwardLaunch& launch,
                                const GateShape& shape, bool capturing);

// Whether launch_pre_gdr_gate_forward takes the vectorised kernel for these arguments:
// contiguous a and b, heads a multiple of 4 and at most 1024, 32-bit indices, a and b
// aligned to 4 elements and g, beta to 16 bytes. Otherwise the scalar (strided) kernel
// runs; both compute every element with the same calls, so the bits are the same.
bool pre_gdr_gate_forward_is_vectorised(const GateForwardArgs& args);

// Whether launch_pre_gdr_gate_backward takes the vectorised element pass for these
// arguments and tile: a, b, grad_g, grad_beta contiguous, heads and tile.block_h multiples
// of 4, 32-bit indices, a, b, da, db aligned to 4 elements and grad_g, grad_beta to 16
// bytes. Otherwise the scalar (strided) pass runs; both follow Note [Gate backward
// virtual rows] and compute every element with the same calls, so for the same tile
// da, db and the per-program sums are the same bits.
bool pre_gdr_gate_backward_is_vectorised(const GateBackwardArgs& args, const GateTile& tile);

// Returns 0 (cudaSuccess) or the CUDA error code of the launch.
int launch_pre_gdr_gate_forward(const GateForwardArgs& args, CUstream_st* stream);

// kAtomic: `out` is a zeroed FP32 [2, heads] accumulator ([0] = dA_log, [1] = ddt_bias).
// kOrdered / kOrderedSinglePass: `out` is FP32 scratch of
// derive_gate_backward_launch(...).scratch_floats, one [2, heads] row per token-program,
// every slot written (no zero-fill needed).
int launch_pre_gdr_gate_backward(const GateBackwardArgs& args, const GateTile& tile,
                                 GateReduction reduction, float* out, CUstream_st* stream);

// Ordered second pass: sums the partial rows in a fixed order that depends only on
// programs_t, then writes dA_log / ddt_bias ([heads], param_kind).
int launch_pre_gdr_gate_reduce_partials(const float* partials, int64_t programs_t, int64_t heads,
                                        ScalarKind param_kind, void* dA_log, void* ddt_bias,
                                        CUstream_st* stream);

}  // namespace gdr::kernels
