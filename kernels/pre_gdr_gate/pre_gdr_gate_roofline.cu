// Roofline probes of the pre-GDR gate backward (kernels/pre_gdr_gate/pre_gdr_gate_roofline.h): the
// backward's traffic alone, its element math alone, and both, on the flat operands. The
// probes share gate_backward_elements4 and the vector loads and stores with the real
// kernel (kernels/pre_gdr_gate/pre_gdr_gate.cu), so their instruction mix is the real one less the
// per-program row sums and the reduction.
#include "kernels/pre_gdr_gate/pre_gdr_gate_roofline.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <numeric>

#include "kernels/common/storage_element.cuh"
#include "kernels/pre_gdr_gate/pre_gdr_gate_element.cuh"

namespace gdr::kernels {
namespace {

constexpr int kRooflineThreads = 256;
constexpr int kRooflineBlocksPerSm = 4;

template <typename In>
__device__ __forceinline__ void load_operands(const GateRooflineArgs& args, int32_t v,
                                              float (&a)[4], float (&b)[4], float (&dg)[4],
                                              float (&dbeta)[4]) {
  load_floats_ldg<In, 4>(static_cast<const In*>(args.a) + 4 * v, a);
  load_floats_ldg<In, 4>(static_cast<const In*>(args.b) + 4 * v, b);
  load_floats_ldg<float, 4>(args.grad_g + 4 * v, dg);
  load_floats_ldg<float, 4>(args.grad_beta + 4 * v, dbeta);
}

// One thread: head vectors v, v + stride, ... of the flat [tokens, heads] operands. The
// grid's stride is a multiple of heads / 4 (gate_roofline_blocks), so the thread's four
// heads, and its A_log and dt_bias terms, are fixed.
template <typename In, GateRooflineProbe kProbe>
__global__ void __launch_bounds__(kRooflineThreads)
    gate_roofline_kernel(GateRooflineArgs args, int32_t vectors) {
  const int32_t stride = static_cast<int32_t>(gridDim.x) * kRooflineThreads;
  const int32_t first = static_cast<int32_t>(blockIdx.x) * kRooflineThreads + threadIdx.x;
  const int32_t h0 = static_cast<int32_t>((4 * static_cast<int64_t>(first)) % args.heads);
  float neg_exp_A[4], dt[4], sum_A_log[4] = {}, sum_dt_bias[4] = {};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    neg_exp_A[j] = -expf(__ldg(args.A_log + h0 + j));
    dt[j] = __ldg(args.dt_bias + h0 + j);
  }
  In* da = static_cast<In*>(args.da);
  In* db = static_cast<In*>(args.db);
  if constexpr (kProbe == GateRooflineProbe::kMath) {
    // Real operand values, loaded once; each iteration shifts grad_g by the iteration's
    // index so that the math cannot be hoisted out of the loop.
    float a[4], b[4], dg[4], dbeta[4];
    load_operands<In>(args, first % vectors, a, b, dg, dbeta);
    for (int32_t v = first; v < vectors; v += stride) {
      float dg_v[4] = {dg[0] + static_cast<float>(v), dg[1], dg[2], dg[3]};
      float da_value[4], db_value[4];
      gate_backward_elements4(a, b, dg_v, dbeta, neg_exp_A, dt, da_value, db_value, sum_A_log,
                              sum_dt_bias);
      sum_A_log[0] += da_value[1] + db_value[2];  // keep every result live
      sum_dt_bias[0] += da_value[3] + db_value[0] + da_value[2] + db_value[1] + db_value[3];
    }
  } else {
    for (int32_t v = first; v < vectors; v += stride) {
      float a[4], b[4], dg[4], dbeta[4], da_value[4], db_value[4];
      load_operands<In>(args, v, a, b, dg, dbeta);
      if constexpr (kProbe == GateRooflineProbe::kTraffic) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          da_value[j] = a[j] * dg[j];
          db_value[j] = b[j] * dbeta[j];
        }
      } else {
        gate_backward_elements4(a, b, dg, dbeta, neg_exp_A, dt, da_value, db_value, sum_A_log,
                                sum_dt_bias);
      }
      store_floats<In, 4>(da + 4 * v, da_value);
      store_floats<In, 4>(db + 4 * v, db_value);
    }
  }
  args.sink[first] = (sum_A_log[0] + sum_A_log[1]) + (sum_A_log[2] + sum_A_log[3]) +
                     (sum_dt_bias[0] + sum_dt_bias[1]) + (sum_dt_bias[2] + sum_dt_bias[3]);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename In>
int launch_for(const GateRooflineArgs& args, GateRooflineProbe probe, int64_t blocks,
               CUstream_st* stream) {
  const int32_t vectors = static_cast<int32_t>(args.tokens * args.heads / 4);
  auto kernel = gate_roofline_kernel<In, GateRooflineProbe::kTraffic>;
  if (probe == GateRooflineProbe::kMath)
    kernel = gate_roofline_kernel<In, GateRooflineProbe::kMath>;
  if (probe == GateRooflineProbe::kTrafficAndMath) {
    kernel = gate_roofline_kernel<In, GateRooflineProbe::kTrafficAndMath>;
  }
  kernel<<<static_cast<unsigned>(blocks), kRooflineThreads, 0, stream>>>(args, vectors);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace

int64_t gate_roofline_blocks(int64_t heads, int multiprocessors) {
  // The stride (blocks * threads vectors) must be a multiple of the heads / 4 vectors of a
  // token row.
  const int64_t lanes = heads / 4;
  const int64_t step = lanes / std::gcd(lanes, int64_t{kRooflineThreads});
  const int64_t wanted = int64_t{kRooflineBlocksPerSm} * std::max(multiprocessors, 1);
  return (wanted + step - 1) / step * step;
}

int64_t gate_roofline_sink_floats(int64_t heads, int multiprocessors) {
  return gate_roofline_blocks(heads, multiprocessors) * kRooflineThreads;
}

int launch_gate_roofline_probe(const GateRooflineArgs& args, GateRooflineProbe probe,
                               int multiprocessors, CUstream_st* stream) {
  const int64_t elements = args.tokens * args.heads;
  if (args.heads <= 0 || args.heads % 4 != 0 || args.tokens <= 0 || elements > 0x7fffffffLL ||
      !aligned16(args.grad_g) || !aligned16(args.grad_beta) || args.sink == nullptr) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t blocks = gate_roofline_blocks(args.heads, multiprocessors);
  if (blocks * kRooflineThreads > elements / 4) {
    return static_cast<int>(cudaErrorInvalidValue);  // every thread needs a first vector
  }
  switch (args.input_kind) {
    case ScalarKind::kFloat32: return launch_for<float>(args, probe, blocks, stream);
    case ScalarKind::kFloat16: return launch_for<__half>(args, probe, blocks, stream);
    case ScalarKind::kBFloat16: return launch_for<__nv_bfloat16>(args, probe, blocks, stream);
  }
  return static_cast<int>(cudaErrorInvalidValue);
}

}  // namespace gdr::kernels
