// Host side of full pre-GDR fusion: the head layout rule, shape validation and the plain
// C++ reference of the kernels (same formulas, same rounding points, sequential order).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "kernels/pre_gdr_gate/pre_gdr_full_fusion.h"
#include "kernels/pre_gdr_gate/pre_gdr_full_fusion_math.h"

namespace gdr::kernels {

HeadLayout full_fusion_head_layout(int64_t head_dim) {
  const bool power_of_two = head_dim > 0 && (head_dim & (head_dim - 1)) == 0;
  if (!power_of_two || head_dim < 4 || head_dim > 256) return {0, 0};
  // NOTE: the kernels are instantiated for per_lane 4 and 8 only (pre_gdr_full_fusion.cu).
  const int per_lane = head_dim <= 128 ? 4 : 8;
  return {static_cast<int>(head_dim / per_lane), per_lane};
}

std::string validate_full_fusion_shape(const FullFusionShape& s) {
  if (s.batch < 1 || s.seq < 1) {
    return "expected at least one token (batch " + std::to_string(s.batch) + ", sequence " +
           std::to_string(s.seq) + ")";
  }
  if (s.num_k_heads < 1 || s.num_v_heads < 1) return "expected Hk >= 1 and Hv >= 1";
  if (s.num_v_heads % s.num_k_heads != 0) {
    return "expected Hv a multiple of Hk but got Hv = " + std::to_string(s.num_v_heads) +
           ", Hk = " + std::to_string(s.num_k_heads);
  }
  for (const auto& [name, dim] : {std::pair<const char*, int64_t>{"dk", s.head_k_dim},
                                  std::pair<const char*, int64_t>{"dv", s.head_v_dim}}) {
    if (full_fusion_head_layout(dim).lanes == 0) {
      return std::string("expected head dim ") + name + " a power of two in [4, 256] but got " +
             std::to_string(dim);
    }
  }
  if (s.groups() > 65535) {
    return "expected at most 65535 heads in 2*Hk + Hv but got " + std::to_string(s.groups());
  }
  return "";
}

float round_to_kind(float x, ScalarKind kind) {
  if (kind == ScalarKind::kFloat32 || !std::isfinite(x) || x == 0.0f) return x;
  // Significand bits (with the implicit one), smallest normal exponent (frexp convention,
  // |x| in [2^(e-1), 2^e)) and largest finite value of the 16-bit format.
  const int precision = kind == ScalarKind::kBFloat16 ? 8 : 11;
  const int min_exponent = kind == ScalarKind::kBFloat16 ? -125 : -13;
  const double max_finite = kind == ScalarKind::kBFloat16 ? 3.3895313892515355e38 : 65504.0;
  int exponent = 0;
  std::frexp(static_cast<double>(x), &exponent);
  if (exponent < min_exponent) exponent = min_exponent;  // subnormals: a fixed quantum
  const double quantum = std::ldexp(1.0, exponent - precision);
  const double rounded = std::nearbyint(static_cast<double>(x) / quantum) * quantum;
  if (std::fabs(rounded) > max_finite) {
    return rounded > 0 ? std::numeric_limits<float>::infinity()
                       : -std::numeric_limits<float>::infinity();
  }
  return static_cast<float>(rounded);
}

namespace {

// y (rounded conv output) and s (rounded SiLU output) of every [B, T, C] element.
void recompute_conv_silu(const FullFusionShape& shape, ScalarKind kind, const float* qkv,
                         const float* conv_weight, std::vector<float>& y, std::vector<float>& s) {
  const int64_t C = shape.conv_dim(), T = shape.seq;
  y.assign(shape.tokens() * C, 0.0f);
  s.assign(shape.tokens() * C, 0.0f);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        float w[kFullFusionConvTaps], window[kFullFusionConvTaps];
        for (int j = 0; j < kFullFusionConvTaps; ++j) {
          const int64_t src = t + j - (kFullFusionConvTaps - 1);
          w[j] = conv_weight[c * kFullFusionConvTaps + j];
          window[j] = src >= 0 ? qkv[(b * T + src) * C + c] : 0.0f;
        }
        const int64_t e = (b * T + t) * C + c;
        y[e] = round_to_kind(full_fusion_conv(w, window), kind);
        s[e] = round_to_kind(full_fusion_silu(y[e]), kind);
      }
    }
  }
}

}  // namespace

void pre_gdr_full_fusion_forward_reference(const FullFusionShape& shape, ScalarKind kind,
                                           const float* qkv, const float* conv_weight, float* q,
                                           float* k, float* v) {
  std::vector<float> y, s;
  recompute_conv_silu(shape, kind, qkv, conv_weight, y, s);
  const int64_t C = shape.conv_dim(), Hk = shape.num_k_heads, Hv = shape.num_v_heads;
  const int64_t dk = shape.head_k_dim, dv = shape.head_v_dim, repeats = Hv / Hk;
  for (int64_t token = 0; token < shape.tokens(); ++token) {
    const float* row = s.data() + token * C;
    for (int which = 0; which < 2; ++which) {  // q, then k
      float* out = which == 0 ? q : k;
      for (int64_t hk = 0; hk < Hk; ++hk) {
        const float* head = row + which * shape.key_dim() + hk * dk;
        float sum = 0.0f;
        for (int64_t d = 0; d < dk; ++d) sum += head[d] * head[d];
        const float r = full_fusion_rsqrt(sum + kFullFusionL2Eps);
        for (int64_t rep = 0; rep < repeats; ++rep) {
          float* dst = out + (token * Hv + hk * repeats + rep) * dk;
          for (int64_t d = 0; d < dk; ++d) dst[d] = head[d] * r;
        }
      }
    }
    for (int64_t e = 0; e < Hv * dv; ++e) v[token * Hv * dv + e] = row[2 * shape.key_dim() + e];
  }
}

void pre_gdr_full_fusion_backward_reference(const FullFusionShape& shape, ScalarKind kind,
                                            const float* qkv, const float* conv_weight,
                                            const float* grad_q, const float* grad_k,
                                            const float* grad_v, float* grad_qkv,
                                            float* grad_conv_weight) {
  std::vector<float> y, s;
  recompute_conv_silu(shape, kind, qkv, conv_weight, y, s);
  const int64_t C = shape.conv_dim(), T = shape.seq, Hk = shape.num_k_heads;
  const int64_t Hv = shape.num_v_heads, dk = shape.head_k_dim, dv = shape.head_v_dim;
  const int64_t repeats = Hv / Hk;
  // dy: gradient of the conv output (the SiLU input), rounded like the unfused graph.
  std::vector<float> dy(shape.tokens() * C, 0.0f);
  std::vector<float> grad(std::max(dk, dv));
  for (int64_t token = 0; token < shape.tokens(); ++token) {
    const int64_t base = token * C;
    for (int which = 0; which < 2; ++which) {
      const float* g_in = which == 0 ? grad_q : grad_k;
      for (int64_t hk = 0; hk < Hk; ++hk) {
        const int64_t c0 = which * shape.key_dim() + hk * dk;
        for (int64_t d = 0; d < dk; ++d) {
          float sum = 0.0f;  // repeat_interleave backward: the value heads of this key head
          for (int64_t rep = 0; rep < repeats; ++rep)
            sum += g_in[(token * Hv + hk * repeats + rep) * dk + d];
          grad[d] = sum;
        }
        float sum_sq = 0.0f, dot = 0.0f;
        for (int64_t d = 0; d < dk; ++d) {
          sum_sq += s[base + c0 + d] * s[base + c0 + d];
          dot += grad[d] * s[base + c0 + d];
        }
        const float r = full_fusion_rsqrt(sum_sq + kFullFusionL2Eps);
        for (int64_t d = 0; d < dk; ++d) {
          const int64_t e = base + c0 + d;
          const float ds = round_to_kind(full_fusion_l2_backward(grad[d], s[e], r, dot), kind);
          dy[e] = round_to_kind(full_fusion_silu_backward(ds, y[e]), kind);
        }
      }
    }
    for (int64_t e = 0; e < Hv * dv; ++e) {
      const int64_t c = base + 2 * shape.key_dim() + e;
      const float ds = round_to_kind(grad_v[token * Hv * dv + e], kind);
      dy[c] = round_to_kind(full_fusion_silu_backward(ds, y[c]), kind);
    }
  }
  std::vector<double> dw(C * kFullFusionConvTaps, 0.0);
  for (int64_t b = 0; b < shape.batch; ++b) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t c = 0; c < C; ++c) {
        float w[kFullFusionConvTaps], dy_window[kFullFusionConvTaps];
        for (int j = 0; j < kFullFusionConvTaps; ++j) {
          w[j] = conv_weight[c * kFullFusionConvTaps + j];
          dy_window[j] = t + j < T ? dy[(b * T + t + j) * C + c] : 0.0f;
          const int64_t src = t + j - (kFullFusionConvTaps - 1);
          if (src >= 0) {
            dw[c * kFullFusionConvTaps + j] += static_cast<double>(dy[(b * T + t) * C + c]) *
                                               static_cast<double>(qkv[(b * T + src) * C + c]);
          }
        }
        grad_qkv[(b * T + t) * C + c] =
            round_to_kind(full_fusion_conv_backward(w, dy_window), kind);
      }
    }
  }
  for (int64_t i = 0; i < C * kFullFusionConvTaps; ++i)
    grad_conv_weight[i] = static_cast<float>(dw[i]);
}

}  // namespace gdr::kernels
