// The RMSNorm kernel bodies run on the CPU: kernels/rms_norm/rms_norm_kernel.cuh is compiled as
// host code with stand-ins for the CUDA built-ins (one std::thread per CUDA thread, a
// barrier for __syncthreads, a per-warp exchange slot and barrier for __shfl_xor_sync,
// one block at a time) and checked against a plain FP64 loop written from the spec
// (kernels/rms_norm/rms_norm.h): both flavours, FP32 and BF16 storage, rows of 1024, 256, 128 and
// the odd 100 and 1000 (vectorised and scalar paths), row counts with tails, zero rows,
// strided row layouts. The weight gradient's partial rows and the ordered second pass are
// checked bit for bit against the documented summation order (Note [RMSNorm
// determinism]), also with several rows per warp, and every register-resident variant
// (Note [RMSNorm register-resident rows]: row prefetching, rows in registers) against the
// streaming kernels' bits: y, rstd, dx, dz and the partial rows. Speed and the real hardware are
// the GPU test's business.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <math.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/rms_norm/rms_norm.h"

// Host stand-ins for the CUDA built-ins the kernel bodies use (see the NOTE in the .cuh).
#include "tests/ops/emulated_cuda.h"

inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }

#define __device__
#define __forceinline__ inline
#include "kernels/rms_norm/rms_norm_kernel.cuh"
#undef __device__
#undef __forceinline__

#include "tests/ops/emulated_storage_element.h"

namespace gdr::kernels {

namespace {

using test_support::run_grid;

struct Case {
  bool gated;
  bool bf16;
  bool weight_fp32;
  int64_t rows, cols;
  bool strided;
  int64_t rows_per_program;  // 0: the launch rule's
};

std::string name_of(const Case& c) {
  return std::string(c.gated ? "gated" : "zero_centred") + (c.bf16 ? "_bf16" : "_fp32") +
         (c.weight_fp32 ? "_wfp32" : "") + "_" + std::to_string(c.rows) + "x" +
         std::to_string(c.cols) + (c.strided ? "_strided" : "") +
         (c.rows_per_program ? "_rpp" + std::to_string(c.rows_per_program) : "");
}

// Rows [A, B] of a [A, B, cols] view with B * A = rows: contiguous, or the transpose of a
// wider [B, A, cols + 8] buffer narrowed to cols (two row dims with unrelated strides).
at::Tensor make_rows(const Case& c, at::ScalarType dt, double scale) {
  const int64_t A = c.rows % 2 == 0 && c.rows > 0 ? 2 : 1, B = c.rows / A;
  if (!c.strided) return (at::randn({A, B, c.cols}) * scale).to(dt);
  const at::Tensor wide = (at::randn({B, A, c.cols + 8}) * scale).to(dt);
  return wide.transpose(0, 1).narrow(-1, 0, c.cols);
}

void fill_layout(const at::Tensor& t, RmsNormShape& shape, RowOperand& op) {
  shape.rows = t.numel() / t.size(-1);
  shape.cols = t.size(-1);
  shape.row_dims = 2;
  shape.row_sizes[0] = t.size(0);
  shape.row_sizes[1] = t.size(1);
  op.data = t.data_ptr();
  op.row_strides[0] = t.stride(0);
  op.row_strides[1] = t.stride(1);
}

// Bit-for-bit equality of two tensors' bytes (NaN fills included).
::testing::AssertionResult same_bits(const at::Tensor& got, const at::Tensor& want,
                                     const std::string& what) {
  if (got.nbytes() == want.nbytes() &&
      std::memcmp(got.data_ptr(), want.data_ptr(), got.nbytes()) == 0) {
    return ::testing::AssertionSuccess();
  }
  const at::Tensor g = got.to(at::kDouble).flatten(), w = want.to(at::kDouble).flatten();
  const at::Tensor differ = (g != w).logical_and(g.isnan().logical_and(w.isnan()).logical_not());
  const int64_t first = differ.any().item<bool>() ? differ.nonzero()[0][0].item<int64_t>() : -1;
  return ::testing::AssertionFailure()
         << what << " differs from the streaming kernel's at element " << first << " ("
         << (first >= 0 ? g[first].item<double>() : 0.0) << " vs "
         << (first >= 0 ? w[first].item<double>() : 0.0) << ")";
}

// The streaming kernels' outputs, which every register-resident variant must reproduce
// bit for bit (Note [RMSNorm register-resident rows]).
struct StreamingOutputs {
  at::Tensor y, rstd, dx, dz, partials;
};

template <typename T, typename TW, int VEC, bool kGated, int CHUNKS>
void check_forward_variant(const Case& c, RmsNormForwardArgs fa, const StreamingOutputs& want) {
  if (c.cols > CHUNKS * 32 * VEC) return;  // the variant's precondition
  at::Tensor y = at::full_like(want.y, NAN), rstd = at::full_like(want.rstd, NAN);
  fa.y = y.data_ptr();
  fa.rstd = rstd.data_ptr<float>();
  const int64_t blocks = (c.rows + kRmsNormForwardWarps - 1) / kRmsNormForwardWarps;
  run_grid(blocks, kRmsNormForwardWarps * 32,
           [&](int64_t) { rms_norm_detail::forward_row_resident<T, TW, VEC, kGated, CHUNKS>(fa); });
  const std::string name = "forward chunks " + std::to_string(CHUNKS) + ": ";
  EXPECT_TRUE(same_bits(y, want.y, name + "y"));
  EXPECT_TRUE(same_bits(rstd, want.rstd, name + "rstd"));
}

template <typename T, typename TW, int VEC, bool kGated, int CHUNKS, int STAGES, bool kSharedAcc>
void check_backward_variant(const Case& c, RmsNormBackwardArgs ba,
                            const RmsNormBackwardLaunch& launch, const StreamingOutputs& want) {
  if (c.cols > CHUNKS * 32 * VEC) return;
  at::Tensor dx = at::full_like(want.dx, NAN), dz = at::full_like(want.dz, NAN);
  at::Tensor partials = at::full_like(want.partials, NAN);
  ba.dx = dx.data_ptr();
  ba.dz = dz.data_ptr();
  ba.partials = partials.data_ptr<float>();
  std::vector<float> shared(launch.warps * c.cols, NAN);
  run_grid(launch.programs, launch.warps * 32, [&](int64_t) {
    rms_norm_detail::backward_program_resident<T, TW, VEC, kGated, CHUNKS, STAGES, kSharedAcc>(
        ba, launch.rows_per_program, shared.data());
  });
  const std::string name = "backward chunks " + std::to_string(CHUNKS) + " stages " +
                           std::to_string(STAGES) + (kSharedAcc ? " shared acc" : "") + ": ";
  EXPECT_TRUE(same_bits(dx, want.dx, name + "dx"));
  EXPECT_TRUE(same_bits(dz, want.dz, name + "dz"));
  EXPECT_TRUE(same_bits(partials, want.partials, name + "partials"));
}

template <typename T, typename TW, int VEC, bool kGated>
void check_resident_variants(const Case& c, const RmsNormForwardArgs& fa,
                             const RmsNormBackwardArgs& ba, const RmsNormBackwardLaunch& launch,
                             const StreamingOutputs& want) {
  check_forward_variant<T, TW, VEC, kGated, 1>(c, fa, want);
  check_forward_variant<T, TW, VEC, kGated, 2>(c, fa, want);
  check_forward_variant<T, TW, VEC, kGated, 4>(c, fa, want);
  // Every (chunks, stages, accumulator) the launcher may pick and a few it does not
  // (stage counts that do not divide a warp's rows, more chunks than needed).
  check_backward_variant<T, TW, VEC, kGated, 1, 1, false>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 1, 2, false>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 1, 3, false>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 1, 2, true>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 2, 1, true>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 2, 2, false>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 2, 3, true>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 4, 1, false>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 4, 1, true>(c, ba, launch, want);
  check_backward_variant<T, TW, VEC, kGated, 4, 2, true>(c, ba, launch, want);
}

template <typename T, typename TW, int VEC>
void run_case(const Case& c) {
  const at::ScalarType dt = c.bf16 ? at::kBFloat16 : at::kFloat;
  const at::ScalarType wt = c.weight_fp32 ? at::kFloat : dt;
  at::manual_seed(c.rows * 131 + c.cols);
  const at::Tensor x = make_rows(c, dt, 2.0), z = make_rows(c, dt, 2.0), g = make_rows(c, dt, 1.0);
  const at::Tensor w = (at::randn({c.cols}) * 0.5 + (c.gated ? 1.0 : 0.0)).to(wt);
  const float eps = 1e-6f;

  // Forward.
  at::Tensor y = at::full({c.rows, c.cols}, NAN, at::TensorOptions().dtype(dt));
  at::Tensor rstd = at::full({std::max<int64_t>(c.rows, 1)}, NAN);
  RmsNormForwardArgs fa;
  fa.flavour = c.gated ? RmsNormFlavour::kGated : RmsNormFlavour::kZeroCentred;
  fill_layout(x, fa.shape, fa.x);
  RmsNormShape unused;
  fill_layout(z, unused, fa.z);
  fa.weight = w.data_ptr();
  fa.eps = eps;
  fa.y = y.data_ptr();
  fa.rstd = rstd.data_ptr<float>();
  const int64_t fwd_blocks = (c.rows + kRmsNormForwardWarps - 1) / kRmsNormForwardWarps;
  run_grid(fwd_blocks, kRmsNormForwardWarps * 32, [&](int64_t) {
    if (c.gated) {
      rms_norm_detail::forward_row<T, TW, VEC, true>(fa);
    } else {
      rms_norm_detail::forward_row<T, TW, VEC, false>(fa);
    }
  });

  // Backward.
  RmsNormBackwardLaunch launch = derive_rms_norm_backward_launch(c.rows, c.cols);
  if (c.rows_per_program > 0) {
    launch.rows_per_program = c.rows_per_program;
    launch.programs = (c.rows + c.rows_per_program - 1) / c.rows_per_program;
  }
  at::Tensor dx = at::full({c.rows, c.cols}, NAN, at::TensorOptions().dtype(dt));
  at::Tensor dz = at::full({c.rows, c.cols}, NAN, at::TensorOptions().dtype(dt));
  at::Tensor partials = at::full({std::max<int64_t>(launch.programs * c.cols, 1)}, NAN);
  RmsNormBackwardArgs ba;
  ba.flavour = fa.flavour;
  ba.shape = fa.shape;
  fill_layout(g, unused, ba.grad_y);
  ba.x = fa.x;
  ba.z = fa.z;
  ba.weight = fa.weight;
  ba.rstd = rstd.data_ptr<float>();
  ba.dx = dx.data_ptr();
  ba.dz = dz.data_ptr();
  ba.partials = partials.data_ptr<float>();
  std::vector<float> shared(launch.warps * c.cols);
  run_grid(launch.programs, launch.warps * 32, [&](int64_t) {
    if (c.gated) {
      rms_norm_detail::backward_program<T, TW, VEC, true>(ba, launch.rows_per_program,
                                                          shared.data());
    } else {
      rms_norm_detail::backward_program<T, TW, VEC, false>(ba, launch.rows_per_program,
                                                           shared.data());
    }
  });
  const StreamingOutputs streaming{y, rstd, dx, dz, partials};
  if (c.gated) {
    check_resident_variants<T, TW, VEC, true>(c, fa, ba, launch, streaming);
  } else {
    check_resident_variants<T, TW, VEC, false>(c, fa, ba, launch, streaming);
  }
  at::Tensor dw = at::full({c.cols}, NAN, at::TensorOptions().dtype(wt));
  std::vector<float> slice_sums(kRmsNormReduceSlices * kRmsNormReduceCols);
  run_grid((c.cols + kRmsNormReduceCols - 1) / kRmsNormReduceCols,
           kRmsNormReduceCols * kRmsNormReduceSlices, [&](int64_t) {
             rms_norm_detail::reduce_partials_block<TW>(ba.partials, launch.programs, c.cols,
                                                        static_cast<TW*>(dw.data_ptr()),
                                                        slice_sums.data());
           });

  // Independent FP64 loop from the spec.
  const at::Tensor xd = x.to(at::kDouble).reshape({c.rows, c.cols});
  const at::Tensor zd = z.to(at::kDouble).reshape({c.rows, c.cols});
  const at::Tensor gd = g.to(at::kDouble).reshape({c.rows, c.cols});
  const at::Tensor wd = w.to(at::kDouble);
  auto X = xd.accessor<double, 2>(), Z = zd.accessor<double, 2>(), G = gd.accessor<double, 2>();
  auto W = wd.accessor<double, 1>();
  const at::Tensor yf = y.to(at::kDouble), dxf = dx.to(at::kDouble), dzf = dz.to(at::kDouble);
  auto Y = yf.accessor<double, 2>(), DX = dxf.accessor<double, 2>(), DZ = dzf.accessor<double, 2>();
  std::vector<double> dw_ref(c.cols, 0.0);
  double err_y = 0, err_dx = 0, err_dz = 0, max_y = 0, max_dx = 0, max_dz = 0;
  for (int64_t r = 0; r < c.rows; ++r) {
    double ss = 0;
    for (int64_t k = 0; k < c.cols; ++k) ss += X[r][k] * X[r][k];
    const double rs = 1.0 / std::sqrt(ss / c.cols + eps);
    EXPECT_NEAR(rstd[r].item<float>(), rs, 1e-5 * rs);
    double dot = 0;
    std::vector<double> n(c.cols), dn(c.cols);
    for (int64_t k = 0; k < c.cols; ++k) {
      n[k] = X[r][k] * rs;
      const double sig = 1.0 / (1.0 + std::exp(-Z[r][k]));
      const double scale = c.gated ? W[k] * Z[r][k] * sig : 1.0 + W[k];
      dn[k] = G[r][k] * scale;
      dot += dn[k] * n[k];
      dw_ref[k] += G[r][k] * n[k] * (c.gated ? Z[r][k] * sig : 1.0);
      const double y_ref = n[k] * scale;
      err_y = std::max(err_y, std::fabs(Y[r][k] - y_ref));
      max_y = std::max(max_y, std::fabs(y_ref));
      if (c.gated) {
        const double dz_ref = G[r][k] * n[k] * W[k] * sig * (1.0 + Z[r][k] * (1.0 - sig));
        err_dz = std::max(err_dz, std::fabs(DZ[r][k] - dz_ref));
        max_dz = std::max(max_dz, std::fabs(dz_ref));
      }
    }
    for (int64_t k = 0; k < c.cols; ++k) {
      const double dx_ref = rs * (dn[k] - n[k] * dot / c.cols);
      err_dx = std::max(err_dx, std::fabs(DX[r][k] - dx_ref));
      max_dx = std::max(max_dx, std::fabs(dx_ref));
    }
  }
  // FP32 storage: FP32 rounding of sums of at most 1024 terms. BF16 storage: one BF16
  // rounding of each output (relative 2^-8) on top.
  const double tol = c.bf16 ? 8e-3 : 2e-5;
  EXPECT_LE(err_y, tol * (1 + max_y)) << "y";
  EXPECT_LE(err_dx, tol * (1 + max_dx)) << "dx";
  if (c.gated) {
    EXPECT_LE(err_dz, tol * (1 + max_dz)) << "dz";
  }
  double err_dw = 0, max_dw = 0;
  const at::Tensor dwd = dw.to(at::kDouble);
  for (int64_t k = 0; k < c.cols; ++k) {
    err_dw = std::max(err_dw, std::fabs(dwd[k].item<double>() - dw_ref[k]));
    max_dw = std::max(max_dw, std::fabs(dw_ref[k]));
  }
  const double dw_tol = c.weight_fp32 ? 1e-4 : (c.bf16 ? 8e-3 : 1e-4);
  EXPECT_LE(err_dw, dw_tol * (1 + max_dw)) << "dw";

  // The documented order, replayed in FP32 from the kernel's own inputs and rstd: per
  // warp, its rows in order; warps in order; then the second pass's slices.
  const at::Tensor xs = x.reshape({c.rows, c.cols}), zs = z.reshape({c.rows, c.cols}),
                   gs = g.reshape({c.rows, c.cols});
  const at::Tensor xf = xs.to(at::kFloat), zf = zs.to(at::kFloat), gf = gs.to(at::kFloat);
  auto XF = xf.accessor<float, 2>(), ZF = zf.accessor<float, 2>(), GF = gf.accessor<float, 2>();
  auto RS = rstd.accessor<float, 1>();
  auto P = partials.accessor<float, 1>();
  std::vector<float> expected_partials(launch.programs * c.cols);
  for (int64_t p = 0; p < launch.programs; ++p) {
    const int64_t begin = p * launch.rows_per_program,
                  end = std::min(begin + launch.rows_per_program, c.rows);
    for (int64_t k = 0; k < c.cols; ++k) {
      float total = 0.0f;
      for (int v = 0; v < launch.warps; ++v) {
        float s = 0.0f;
        for (int64_t r = begin + v; r < end; r += launch.warps) {
          const float n = XF[r][k] * RS[r];
          float silu = 0.0f, silu_grad = 0.0f;
          rms_norm_detail::silu_and_grad(ZF[r][k], silu, silu_grad);
          s += c.gated ? GF[r][k] * n * silu : GF[r][k] * n;
        }
        total = v == 0 ? s : total + s;
      }
      expected_partials[p * c.cols + k] = total;
      ASSERT_EQ(P[p * c.cols + k], total) << "partial row " << p << " column " << k;
    }
  }
  for (int64_t k = 0; k < c.cols; ++k) {
    float total = 0.0f;
    for (int s = 0; s < kRmsNormReduceSlices; ++s) {
      float slice = 0.0f;
      for (int64_t p = s; p < launch.programs; p += kRmsNormReduceSlices) {
        slice += expected_partials[p * c.cols + k];
      }
      total = s == 0 ? slice : total + slice;
    }
    ASSERT_EQ(static_cast<float>(dwd[k].item<double>()),
              static_cast<float>(at::scalar_tensor(total).to(wt).item<double>()))
        << "dw column " << k;
  }
}

// See Note [RMSNorm with the residual add]: the streaming kernels with a residual operand
// against the plain kernels run on ATen's sum, and ATen's add of their dx and the stream
// gradient (the composite's roundings); then every register-resident variant against the
// streaming residual kernels, bit for bit.
template <typename T, typename TW, int VEC, int CHUNKS>
void check_residual_forward(const Case& c, RmsNormForwardArgs fa, const at::Tensor& want_y,
                            const at::Tensor& want_sum, const at::Tensor& want_rstd) {
  if (c.cols > CHUNKS * 32 * VEC) return;
  at::Tensor y = at::full_like(want_y, NAN), sum = at::full_like(want_sum, NAN);
  at::Tensor rstd = at::full_like(want_rstd, NAN);
  fa.y = y.data_ptr();
  fa.sum = sum.data_ptr();
  fa.rstd = rstd.data_ptr<float>();
  run_grid(
      (c.rows + kRmsNormForwardWarps - 1) / kRmsNormForwardWarps, kRmsNormForwardWarps * 32,
      [&](int64_t) { rms_norm_detail::forward_row_resident<T, TW, VEC, false, CHUNKS, true>(fa); });
  const std::string name = "residual forward chunks " + std::to_string(CHUNKS) + ": ";
  EXPECT_TRUE(same_bits(y, want_y, name + "y"));
  EXPECT_TRUE(same_bits(sum, want_sum, name + "sum"));
  EXPECT_TRUE(same_bits(rstd, want_rstd, name + "rstd"));
}

template <typename T, typename TW, int VEC, int CHUNKS, int STAGES, bool kSharedAcc>
void check_residual_backward(const Case& c, RmsNormBackwardArgs ba,
                             const RmsNormBackwardLaunch& launch, const at::Tensor& want_dx,
                             const at::Tensor& want_partials) {
  if (c.cols > CHUNKS * 32 * VEC) return;
  at::Tensor dx = at::full_like(want_dx, NAN), partials = at::full_like(want_partials, NAN);
  ba.dx = dx.data_ptr();
  ba.partials = partials.data_ptr<float>();
  std::vector<float> shared(launch.warps * c.cols, NAN);
  run_grid(launch.programs, launch.warps * 32, [&](int64_t) {
    rms_norm_detail::backward_program_resident<T, TW, VEC, false, CHUNKS, STAGES, kSharedAcc, true>(
        ba, launch.rows_per_program, shared.data());
  });
  const std::string name = "residual backward chunks " + std::to_string(CHUNKS) + " stages " +
                           std::to_string(STAGES) + (kSharedAcc ? " shared acc" : "") + ": ";
  EXPECT_TRUE(same_bits(dx, want_dx, name + "dx"));
  EXPECT_TRUE(same_bits(partials, want_partials, name + "partials"));
}

template <typename T, typename TW, int VEC>
void run_residual_case(const Case& c) {
  const at::ScalarType dt = c.bf16 ? at::kBFloat16 : at::kFloat;
  const at::ScalarType wt = c.weight_fp32 ? at::kFloat : dt;
  at::manual_seed(c.rows * 17 + c.cols);
  const at::Tensor x = make_rows(c, dt, 2.0), r = make_rows(c, dt, 3.0);
  const at::Tensor g = make_rows(c, dt, 1.0), ds = make_rows(c, dt, 1.0);
  const at::Tensor w = (at::randn({c.cols}) * 0.5).to(wt);
  const at::Tensor sum_ref = (x + r).contiguous();  // ATen's add: the composite's sum
  const int64_t fwd_blocks = (c.rows + kRmsNormForwardWarps - 1) / kRmsNormForwardWarps;
  const auto opts = at::TensorOptions().dtype(dt);

  // Plain streaming kernels on ATen's sum: the composite.
  at::Tensor y_ref = at::full({c.rows, c.cols}, NAN, opts);
  at::Tensor rstd_ref = at::full({std::max<int64_t>(c.rows, 1)}, NAN);
  RmsNormForwardArgs plain;
  fill_layout(sum_ref, plain.shape, plain.x);
  plain.weight = w.data_ptr();
  plain.eps = 1e-6f;
  plain.y = y_ref.data_ptr();
  plain.rstd = rstd_ref.data_ptr<float>();
  run_grid(fwd_blocks, kRmsNormForwardWarps * 32,
           [&](int64_t) { rms_norm_detail::forward_row<T, TW, VEC, false>(plain); });
  const RmsNormBackwardLaunch launch = derive_rms_norm_backward_launch(c.rows, c.cols);
  at::Tensor dx_plain = at::full({c.rows, c.cols}, NAN, opts);
  at::Tensor partials_ref = at::full({std::max<int64_t>(launch.programs * c.cols, 1)}, NAN);
  RmsNormBackwardArgs plain_b;
  plain_b.shape = plain.shape;
  RmsNormShape unused;
  fill_layout(g, unused, plain_b.grad_y);
  plain_b.x = plain.x;
  plain_b.weight = w.data_ptr();
  plain_b.rstd = rstd_ref.data_ptr<float>();
  plain_b.dx = dx_plain.data_ptr();
  plain_b.partials = partials_ref.data_ptr<float>();
  std::vector<float> shared(launch.warps * c.cols);
  run_grid(launch.programs, launch.warps * 32, [&](int64_t) {
    rms_norm_detail::backward_program<T, TW, VEC, false>(plain_b, launch.rows_per_program,
                                                         shared.data());
  });
  const at::Tensor dx_ref = dx_plain + ds.reshape({c.rows, c.cols});  // autograd's add

  // Streaming kernels with the residual operand.
  at::Tensor y = at::full({c.rows, c.cols}, NAN, opts), sum = at::full({c.rows, c.cols}, NAN, opts);
  at::Tensor rstd = at::full({std::max<int64_t>(c.rows, 1)}, NAN);
  RmsNormForwardArgs fa;
  fill_layout(x, fa.shape, fa.x);
  fill_layout(r, unused, fa.residual);
  fa.weight = w.data_ptr();
  fa.eps = 1e-6f;
  fa.y = y.data_ptr();
  fa.sum = sum.data_ptr();
  fa.rstd = rstd.data_ptr<float>();
  run_grid(fwd_blocks, kRmsNormForwardWarps * 32,
           [&](int64_t) { rms_norm_detail::forward_row<T, TW, VEC, false, true>(fa); });
  EXPECT_TRUE(same_bits(sum, sum_ref.reshape({c.rows, c.cols}), "streaming residual sum"));
  EXPECT_TRUE(same_bits(y, y_ref, "streaming residual y"));
  EXPECT_TRUE(same_bits(rstd, rstd_ref, "streaming residual rstd"));

  at::Tensor dx = at::full({c.rows, c.cols}, NAN, opts);
  at::Tensor partials = at::full({std::max<int64_t>(launch.programs * c.cols, 1)}, NAN);
  RmsNormBackwardArgs ba;
  ba.shape = fa.shape;
  fill_layout(g, unused, ba.grad_y);
  fill_layout(sum.view({x.size(0), x.size(1), c.cols}), unused, ba.x);
  fill_layout(ds, unused, ba.grad_sum);
  ba.weight = w.data_ptr();
  ba.rstd = rstd.data_ptr<float>();
  ba.dx = dx.data_ptr();
  ba.partials = partials.data_ptr<float>();
  run_grid(launch.programs, launch.warps * 32, [&](int64_t) {
    rms_norm_detail::backward_program<T, TW, VEC, false, true>(ba, launch.rows_per_program,
                                                               shared.data());
  });
  EXPECT_TRUE(same_bits(dx, dx_ref, "streaming residual dx"));
  EXPECT_TRUE(same_bits(partials, partials_ref, "streaming residual partials"));

  check_residual_forward<T, TW, VEC, 1>(c, fa, y, sum, rstd);
  check_residual_forward<T, TW, VEC, 2>(c, fa, y, sum, rstd);
  check_residual_forward<T, TW, VEC, 4>(c, fa, y, sum, rstd);
  check_residual_backward<T, TW, VEC, 1, 3, false>(c, ba, launch, dx, partials);
  check_residual_backward<T, TW, VEC, 2, 2, true>(c, ba, launch, dx, partials);
  check_residual_backward<T, TW, VEC, 2, 2, false>(c, ba, launch, dx, partials);
  check_residual_backward<T, TW, VEC, 4, 1, true>(c, ba, launch, dx, partials);
  check_residual_backward<T, TW, VEC, 4, 1, false>(c, ba, launch, dx, partials);
}

class RmsNormResidualEmulation : public ::testing::TestWithParam<Case> {};

TEST_P(RmsNormResidualEmulation, ResidualKernelsGiveTheComposedBits) {
  const Case c = GetParam();
  if (c.bf16) {
    const bool vec = c.cols % 8 == 0 && !c.strided;
    if (c.weight_fp32) {
      vec ? run_residual_case<c10::BFloat16, float, 8>(c)
          : run_residual_case<c10::BFloat16, float, 1>(c);
    } else {
      vec ? run_residual_case<c10::BFloat16, c10::BFloat16, 8>(c)
          : run_residual_case<c10::BFloat16, c10::BFloat16, 1>(c);
    }
  } else {
    c.cols % 4 == 0 && !c.strided ? run_residual_case<float, float, 4>(c)
                                  : run_residual_case<float, float, 1>(c);
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, RmsNormResidualEmulation,
                         ::testing::Values(Case{false, true, false, 6, 1024, false, 0},
                                           Case{false, true, true, 10, 1000, false, 0},
                                           Case{false, false, false, 13, 256, false, 0},
                                           Case{false, true, false, 9, 100, false, 0},
                                           Case{false, false, false, 8, 512, true, 0},
                                           Case{false, true, false, 30, 512, false, 0}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return name_of(info.param);
                         });

class RmsNormKernelEmulation : public ::testing::TestWithParam<Case> {};

TEST_P(RmsNormKernelEmulation, MatchesTheSpecAndTheDocumentedSummationOrder) {
  const Case c = GetParam();
  if (c.bf16) {
    const bool vec = c.cols % 8 == 0 && !c.strided;
    if (c.weight_fp32) {
      vec ? run_case<c10::BFloat16, float, 8>(c) : run_case<c10::BFloat16, float, 1>(c);
    } else {
      vec ? run_case<c10::BFloat16, c10::BFloat16, 8>(c)
          : run_case<c10::BFloat16, c10::BFloat16, 1>(c);
    }
  } else {
    c.cols % 4 == 0 && !c.strided ? run_case<float, float, 4>(c) : run_case<float, float, 1>(c);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, RmsNormKernelEmulation,
    ::testing::Values(
        Case{false, true, false, 6, 1024, false, 0}, Case{false, false, false, 7, 1024, false, 0},
        Case{true, true, false, 9, 128, false, 0}, Case{true, false, false, 5, 128, false, 0},
        Case{false, true, true, 13, 256, false, 0}, Case{true, true, true, 10, 1000, false, 0},
        Case{false, false, false, 3, 100, false, 0}, Case{true, true, false, 5, 100, false, 0},
        Case{true, false, false, 37, 128, false, 12}, Case{false, true, false, 38, 256, true, 8},
        Case{true, true, false, 6, 128, true, 0}, Case{false, false, false, 0, 256, false, 0},
        Case{true, true, false, 0, 128, false, 0},
        // Several rows per warp for the prefetching variants: 6 each, 3/3/2/2 (rows per
        // program not a multiple of the warps), 2/2/2/1, tails, partial last chunks.
        Case{true, false, false, 100, 128, false, 24},
        Case{false, false, false, 45, 256, false, 10}, Case{true, false, false, 23, 200, false, 7},
        Case{false, true, false, 30, 1024, false, 6}, Case{true, true, false, 50, 128, false, 20},
        Case{false, true, false, 21, 512, false, 0}, Case{false, false, false, 19, 512, false, 9},
        Case{true, true, true, 33, 256, false, 13}, Case{false, true, false, 26, 1000, false, 11},
        Case{true, false, false, 64, 96, false, 0}),
    [](const ::testing::TestParamInfo<Case>& info) { return name_of(info.param); });

}  // namespace
}  // namespace gdr::kernels
