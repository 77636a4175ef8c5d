// Accuracy of the GDR core against an FP64 reference on fixed, seeded inputs: the pieces of
// bench/gdr_core_accuracy_main.cc (the binary) and of its CPU test
// (tests/ops/gdr_core_accuracy_test.cc).
//
// The inputs are those gdn_anchor.py hands FLA / FlashQLA (raw BF16 q, k, v; FP32
// g = logsigmoid(randn); BF16 beta = rand; BF16 d_o), drawn from the CPU generator so every
// machine draws the same bits, and saved to a safetensors file that
// tools/gpu/gdn_anchor_accuracy.py reads, so gdr and the anchors are measured on the same
// inputs. The reference is gdr's own core computed in FP64 on the CPU (the composite
// chunked form, or the token-by-token recurrence): the FP64 path rounds nothing but the
// FP64 arithmetic, so its error against the exact result is ~1e-13 relative, far below
// what is measured.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"

namespace gdr::bench {

struct AccuracyShape {
  int64_t B = 1, T = 2048, H = 16, Hk = 16, dk = 128, dv = 128;
};

// The inputs, on the CPU: q, k [B, T, Hk, dk], v [B, T, H, dv], beta [B, T, H] and
// d_o [B, T, H, dv] BF16; g [B, T, H] FP32 (log decay, < 0). q and k are not normalised:
// the core's fused L2 norm (GdrQkNorm::kL2, FLA's use_qk_l2norm_in_kernel) does it.
struct AccuracyInputs {
  at::Tensor q, k, v, g, beta, d_o;
  double scale = 0;  // dk^-1/2, the model's and FLA's default
};

AccuracyInputs make_accuracy_inputs(const AccuracyShape& shape, uint64_t seed);

// The tensors one run yields, in this order: o, final_state, dq, dk, dv, dg, dbeta; each
// in the dtype the implementation returns it, on the CPU.
using NamedResults = std::vector<std::pair<std::string, at::Tensor>>;

// Which form of the core a run uses.
enum class CoreForm { kChunked, kRecurrent };

// Runs gdr's core on `device`: q, k, v cast to `qkv_dtype` (exact from BF16), g and beta
// FP32 (FP64 when qkv_dtype is FP64: the reference), GdrQkNorm::kL2, scale, the final state
// returned; then the backward of sum(o * d_o) (d_o in o's dtype) through autograd. The
// final state gets no gradient of its own, as in gdn_anchor.py's forward+backward.
NamedResults run_gdr_core(const AccuracyInputs& in, at::ScalarType qkv_dtype,
                          const c10::Device& device, CoreForm form = CoreForm::kChunked);

// Error figures of `x` against `ref`, both read as FP64: max |x - ref|, that over
// max |ref| (the "max relative error" of the tables), ||x - ref||_2 / ||ref||_2, max |ref|.
struct ErrorFigures {
  double max_abs_err = 0, max_rel_err = 0, rel_l2_err = 0, max_abs_ref = 0;
};
ErrorFigures error_of(const at::Tensor& x, const at::Tensor& ref);

// One `ACCURACY {json}` line (the keys tools/gpu/gdn_anchor_accuracy.py prints as well).
std::string accuracy_line(const std::string& impl, const std::string& path,
                          const std::string& tensor, const AccuracyShape& shape,
                          const ErrorFigures& e);

// Writes the inputs (q, k, v, g, beta, d_o as made) and the reference results as FP64
// ("ref_o", "ref_final_state", "ref_dq", ...) to `path`, with the shape, scale, q/k norm
// and seed in the metadata.
absl::Status write_accuracy_file(const std::string& path, const AccuracyInputs& in,
                                 const AccuracyShape& shape, uint64_t seed,
                                 const NamedResults& reference, const std::string& reference_name);

}  // namespace gdr::bench
