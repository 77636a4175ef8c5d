// The fused pre-GDR gate op (spec: shared design note pre_gdr_gate.md):
//   g    = -exp(A_log[h]) * softplus(a + dt_bias[h])   (FP32)
//   beta = sigmoid(b)                                   (FP32)
// a, b: [B, S, Hv] or [T, Hv], FP32/FP16/BF16, same dtype, any strides (no copies are
// made on CUDA). A_log, dt_bias: [Hv], FP32/FP16/BF16, same dtype. Outputs are
// contiguous FP32 of a's shape. On the CPU all four may instead be Double: FP64 math and
// FP64 outputs (and gradients), for end-to-end FP64 runs (Note [Gate FP64 on the CPU] in
// pre_gdr_gate_op.cc); Double on CUDA is an error (the kernels have no FP64 path). CUDA work runs
// on the current CUDA stream with scratch from the caching allocator. On CUDA, g and beta are two
// non-overlapping tensors of one allocation, as are da and db (and the backward's scratch); dA_log
// and ddt_bias share a small allocation of their own (Note [Gate host path] in
// pre_gdr_gate_cuda.cc).
//
// Backward (through autograd or pre_gdr_gate_backward): da/db in the dtype of a/b,
// dA_log/ddt_bias in the parameters' dtype. On CUDA the per-head sums use atomics and a
// timing-autotuned tile by default, and the ordered, bit-reproducible reduction when
// use_deterministic_mode() is true (see Note [Deterministic mode resolution] and
// Note [Tile selection]). The CPU implementation is sequential and always deterministic.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <tuple>

#include "kernels/pre_gdr_gate/pre_gdr_gate.h"
#include "ops/autotune/autotune.h"
#include "ops/policy/execution_policy.h"

namespace gdr {

// Autograd-aware entry point (dispatches to CPU or CUDA).
std::tuple<at::Tensor, at::Tensor> pre_gdr_gate(const at::Tensor& a, const at::Tensor& b,
                                                const at::Tensor& A_log, const at::Tensor& dt_bias);

// The backward op alone (no autograd): returns (da, db, dA_log, ddt_bias).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pre_gdr_gate_backward(
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& A_log, const at::Tensor& dt_bias);

// The unfused libtorch composition of the same formulas (autograd through ATen ops), FP32
// math (FP64 for Double inputs); the `none` fusion level of the model and the reference of
// the tests.
std::tuple<at::Tensor, at::Tensor> pre_gdr_gate_composite(const at::Tensor& a, const at::Tensor& b,
                                                          const at::Tensor& A_log,
                                                          const at::Tensor& dt_bias);

// An explicit tile for the CUDA backward, in both modes, is the execution policy's
// gate_tile (kernels.pre_gdr_gate_tile in a run config, GDR_PRE_GDR_GATE_TILE
// "BLOCK_TxBLOCK_HxTHREADS" in the environment, or an ExecutionPolicyGuard in code;
// ops/policy/execution_policy.h). A tile the launch rules refuse is an error saying why.

// The CUDA backward's tile choice (Note [Tile selection]); `time_ms` is only called in
// default mode on an autotune-cache miss.
TileSelection<kernels::GateTile> select_pre_gdr_gate_tile(
    const kernels::GateShape& shape, const std::string& dtype_key, int device_index,
    bool deterministic, const std::function<double(const kernels::GateTile&)>& time_ms,
    int input_element_bytes = 2);

// What identifies a backward call for tile selection (Note [Gate per-shape tile cache]).
struct GateSelectionKey {
  kernels::GateShape shape;
  int input_dtype = 0;  // at::ScalarType values
  int param_dtype = 0;
  bool contiguous = true;
  int device_index = 0;
  int input_element_bytes = 2;
};

// Note [Gate per-shape tile cache]: the CUDA backward's tile choice on the hot path. The
// policy's fixed tile is consulted on every call and wins; then a
// per-key cache of earlier choices answers without building string keys or re-running
// the cost rule: in deterministic mode the static rule's choice (a pure function of the
// shape, cached per exact shape), in default mode the autotuned choice (per token bucket,
// dropped when clear_autotune_cache() runs). On a miss it calls select_pre_gdr_gate_tile
// with the dtype key and the timing function the factories make (called only then: the
// factory may return an empty function when timing is impossible, e.g. during graph
// capture, and such an untimed choice is not cached). Sources reported are those of
// select_pre_gdr_gate_tile (kStaticCost / kAutotuneCache once cached).
TileSelection<kernels::GateTile> select_pre_gdr_gate_tile_cached(
    const GateSelectionKey& key, bool deterministic, const std::function<std::string()>& dtype_key,
    const std::function<std::function<double(const kernels::GateTile&)>()>& make_timer);

// Which ordered (deterministic) reduction the CUDA backward uses. kAuto = single pass (one
// launch; the last program of each head column sums) where
// kernels::gate_single_pass_preferred says so (eager calls at small, launch-bound shapes),
// two pass otherwise (graph capture included); kSinglePass fails with the reason when
// kernels::gate_single_pass_unsupported_reason names one or no ticket slot is free. The
// execution policy's gate_ordered (GateOrderedVariant; kernels.pre_gdr_gate_ordered,
// GDR_PRE_GDR_GATE_ORDERED=single_pass|two_pass|auto). Both variants sum in the same order,
// so they give the same bits (Note [Single-pass ordered reduction]).

// What the most recent CUDA backward did (any thread); tests use it to prove which path
// ran through the real autograd dispatch.
struct PreGdrGateBackwardRecord {
  int64_t calls = 0;  // CUDA backward calls so far in this process
  bool ordered = false;
  kernels::GateReduction reduction = kernels::GateReduction::kAtomic;
  kernels::GateTile tile;
  SelectionSource source = SelectionSource::kStaticCost;
  kernels::GateBackwardLaunch launch;
  bool vectorised = false;  // the vectorised element pass ran (else the scalar one)
};
PreGdrGateBackwardRecord pre_gdr_gate_last_backward();

}  // namespace gdr
