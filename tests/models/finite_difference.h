// Gradient check by central differences (a small gradcheck for C++ tests).
//
// check_gradients(f, inputs) evaluates the scalar f(inputs) once with autograd and
// compares d f / d inputs[i] with (f(x + eps e_j) - f(x - eps e_j)) / (2 eps) for every
// element j of every input. Inputs must be contiguous FP64 (tight checks) or FP32 leaves
// with requires_grad; they are perturbed in place and restored. Costs 2 * numel
// evaluations of f: keep shapes tiny.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <functional>
#include <sstream>
#include <vector>

namespace gdr::testing {

struct GradientTolerance {
  double eps = 1e-6;
  double atol = 1e-8;
  double rtol = 1e-6;
};

inline double read_element(const at::Tensor& t, int64_t j) {
  return t.scalar_type() == at::kDouble ? t.data_ptr<double>()[j] : t.data_ptr<float>()[j];
}

inline void write_element(const at::Tensor& t, int64_t j, double value) {
  if (t.scalar_type() == at::kDouble) {
    t.data_ptr<double>()[j] = value;
  } else {
    t.data_ptr<float>()[j] = static_cast<float>(value);
  }
}

inline ::testing::AssertionResult check_gradients(
    const std::function<at::Tensor(const std::vector<at::Tensor>&)>& f,
    const std::vector<at::Tensor>& inputs, GradientTolerance tol = {}) {
  for (const at::Tensor& x : inputs) {
    if (!x.is_contiguous() || !x.requires_grad() ||
        (x.scalar_type() != at::kDouble && x.scalar_type() != at::kFloat)) {
      return ::testing::AssertionFailure()
             << "check_gradients: inputs must be contiguous FP64/FP32 leaves with requires_grad";
    }
  }
  const at::Tensor y = f(inputs);
  const std::vector<at::Tensor> analytic = torch::autograd::grad({y}, inputs,
                                                                 /*grad_outputs=*/{},
                                                                 /*retain_graph=*/false,
                                                                 /*create_graph=*/false,
                                                                 /*allow_unused=*/true);
  at::NoGradGuard no_grad;
  int failures = 0;
  std::ostringstream report;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& x = inputs[i];
    const at::Tensor grad = analytic[i].defined() ? analytic[i].to(at::kDouble).contiguous()
                                                  : at::zeros(x.sizes(), at::kDouble);
    for (int64_t j = 0; j < x.numel(); ++j) {
      // Restore the saved value rather than adding back: exact in FP32 too.
      const double original = read_element(x, j);
      write_element(x, j, original + tol.eps);
      const double plus = f(inputs).item<double>();
      write_element(x, j, original - tol.eps);
      const double minus = f(inputs).item<double>();
      write_element(x, j, original);
      const double numeric = (plus - minus) / (2 * tol.eps);
      const double exact = grad.data_ptr<double>()[j];
      if (!(std::abs(exact - numeric) <= tol.atol + tol.rtol * std::abs(numeric))) {
        if (++failures <= 5) {
          report << "\n  input " << i << " element " << j << ": autograd " << exact
                 << " vs finite difference " << numeric;
        }
      }
    }
  }
  if (failures == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << failures << " gradient elements differ:" << report.str();
}

// A fixed random projection to a scalar, so every output element gets its own weight.
inline at::Tensor weighted_sum(const at::Tensor& out, const at::Tensor& weights) {
  return (out * weights).sum();
}

}  // namespace gdr::testing
