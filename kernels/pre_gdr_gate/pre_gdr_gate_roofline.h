// Roofline probes for the pre-GDR gate backward (benchmark support, no torch): kernels
// that split the backward's time into its memory traffic and its element math, so that a
// bandwidth target can be judged against what the math alone costs. Each probe walks the
// flat [tokens, heads] operands (heads a multiple of 4) four heads per thread, as the
// vectorised backward does:
// - kTraffic: the backward's loads and stores (a, b in the input dtype, grad_g, grad_beta
//   FP32; da, db in the input dtype) with one multiply per element: the HBM floor of
//   this read/write mix.
// - kMath: gate_backward_elements4 on register-resident operands perturbed per
//   iteration (so nothing is hoisted), one FP32 store per thread at the end: the element
//   math's issue and latency floor, without memory traffic.
// - kTrafficAndMath: both in one loop, one token in flight per thread (the backward's
//   element pass without its per-program row sums).
// Run by bench/pre_gdr_gate_bench --roofline; see docs/benchmarks.md when measured.
#pragma once

#include <cstdint>

#include "kernels/pre_gdr_gate/pre_gdr_gate.h"

struct CUstream_st;

namespace gdr::kernels {

enum class GateRooflineProbe { kTraffic, kMath, kTrafficAndMath };

struct GateRooflineArgs {
  int64_t tokens = 0;
  int64_t heads = 0;                              // a multiple of 4
  ScalarKind input_kind = ScalarKind::kBFloat16;  // a, b, da, db; A_log and dt_bias FP32
  const void* a = nullptr;                        // [tokens, heads] contiguous, 16-byte aligned
  const void* b = nullptr;
  const float* grad_g = nullptr;  // [tokens, heads] contiguous, 16-byte aligned
  const float* grad_beta = nullptr;
  const float* A_log = nullptr;  // [heads]
  const float* dt_bias = nullptr;
  void* da = nullptr;  // [tokens, heads], the input dtype
  void* db = nullptr;
  float* sink = nullptr;  // gate_roofline_sink_floats(...) floats: kMath's per-thread results
};

// The grid the probes launch (a multiple of the head vectors per token row, so each
// thread keeps its heads): about 4 blocks of 256 threads per SM.
int64_t gate_roofline_blocks(int64_t heads, int multiprocessors);
int64_t gate_roofline_sink_floats(int64_t heads, int multiprocessors);

// Returns 0 (cudaSuccess) or the CUDA error of the launch; cudaErrorInvalidValue for
// heads not a multiple of 4, more than 2^31 elements or misaligned operands.
int launch_gate_roofline_probe(const GateRooflineArgs& args, GateRooflineProbe probe,
                               int multiprocessors, CUstream_st* stream);

}  // namespace gdr::kernels
