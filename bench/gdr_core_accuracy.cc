#include "bench/gdr_core_accuracy.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>

#include "io/safetensors.h"
#include "ops/gdr_core/chunk_prep_op.h"
#include "ops/gdr_core/gdr_core_op.h"

namespace gdr::bench {

AccuracyInputs make_accuracy_inputs(const AccuracyShape& s, uint64_t seed) {
  // The CPU generator: the same bits on every machine, whatever GPU runs the cores.
  at::manual_seed(seed);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  AccuracyInputs in;
  in.q = at::randn({s.B, s.T, s.Hk, s.dk}, f32).to(at::kBFloat16);
  in.k = at::randn({s.B, s.T, s.Hk, s.dk}, f32).to(at::kBFloat16);
  in.v = at::randn({s.B, s.T, s.H, s.dv}, f32).to(at::kBFloat16);
  // gdn_anchor.py's distributions: log decays of logsigmoid(randn) (mean decay ~0.5 a
  // token, so the state forgets within tens of tokens) and write strengths in [0, 1).
  in.g = at::log_sigmoid(at::randn({s.B, s.T, s.H}, f32));
  in.beta = at::rand({s.B, s.T, s.H}, f32).to(at::kBFloat16);
  in.d_o = at::randn({s.B, s.T, s.H, s.dv}, f32).to(at::kBFloat16);
  in.scale = 1.0 / std::sqrt(static_cast<double>(s.dk));
  return in;
}

NamedResults run_gdr_core(const AccuracyInputs& in, at::ScalarType qkv_dtype,
                          const c10::Device& device, CoreForm form) {
  // g and beta as the model hands them to the core (FP32 from the pre-GDR gate; BF16 beta
  // widens exactly); FP64 for the reference, which then computes in FP64 throughout.
  const at::ScalarType gate_dtype = qkv_dtype == at::kDouble ? at::kDouble : at::kFloat;
  auto leaf = [&](const at::Tensor& t, at::ScalarType dtype) {
    return t.to(device, dtype).detach().requires_grad_(true);
  };
  const at::Tensor q = leaf(in.q, qkv_dtype), k = leaf(in.k, qkv_dtype), v = leaf(in.v, qkv_dtype),
                   g = leaf(in.g, gate_dtype), beta = leaf(in.beta, gate_dtype);
  auto [o, final_state] = form == CoreForm::kChunked
                              ? gated_delta_rule_chunked(q, k, v, g, beta, in.scale, std::nullopt,
                                                         true, kGdrChunkSize, GdrQkNorm::kL2)
                              : gated_delta_rule_recurrent(q, k, v, g, beta, in.scale, std::nullopt,
                                                           true, GdrQkNorm::kL2);
  const at::Tensor grad_o = in.d_o.to(device, o.scalar_type());
  const std::vector<at::Tensor> grads = torch::autograd::grad({o}, {q, k, v, g, beta}, {grad_o});
  const at::Device cpu(at::kCPU);
  return {{"o", o.detach().to(cpu)},  {"final_state", final_state.detach().to(cpu)},
          {"dq", grads[0].to(cpu)},   {"dk", grads[1].to(cpu)},
          {"dv", grads[2].to(cpu)},   {"dg", grads[3].to(cpu)},
          {"dbeta", grads[4].to(cpu)}};
}

ErrorFigures error_of(const at::Tensor& x, const at::Tensor& ref) {
  const at::Tensor r = ref.to(at::kCPU, at::kDouble);
  const at::Tensor d = x.to(at::kCPU, at::kDouble) - r;
  ErrorFigures e;
  e.max_abs_err = d.abs().max().item<double>();
  e.max_abs_ref = r.abs().max().item<double>();
  e.max_rel_err = e.max_abs_ref > 0 ? e.max_abs_err / e.max_abs_ref : e.max_abs_err;
  const double ref_norm = r.norm().item<double>();
  const double err_norm = d.norm().item<double>();
  e.rel_l2_err = ref_norm > 0 ? err_norm / ref_norm : err_norm;
  return e;
}

std::string accuracy_line(const std::string& impl, const std::string& path,
                          const std::string& tensor, const AccuracyShape& s,
                          const ErrorFigures& e) {
  const nlohmann::ordered_json j = {{"impl", impl},
                                    {"path", path},
                                    {"tensor", tensor},
                                    {"B", s.B},
                                    {"T", s.T},
                                    {"H", s.H},
                                    {"Hk", s.Hk},
                                    {"dk", s.dk},
                                    {"dv", s.dv},
                                    {"max_abs_err", e.max_abs_err},
                                    {"max_rel_err", e.max_rel_err},
                                    {"rel_l2_err", e.rel_l2_err},
                                    {"max_abs_ref", e.max_abs_ref}};
  return "ACCURACY " + j.dump();
}

absl::Status write_accuracy_file(const std::string& path, const AccuracyInputs& in,
                                 const AccuracyShape& s, uint64_t seed,
                                 const NamedResults& reference, const std::string& reference_name) {
  io::NamedTensors tensors = {{"q", in.q}, {"k", in.k},       {"v", in.v},
                              {"g", in.g}, {"beta", in.beta}, {"d_o", in.d_o}};
  for (const auto& [name, t] : reference) tensors.push_back({"ref_" + name, t.to(at::kDouble)});
  const io::SafetensorsMetadata metadata = {
      {"shape", nlohmann::json(
                    {{"B", s.B}, {"T", s.T}, {"H", s.H}, {"Hk", s.Hk}, {"dk", s.dk}, {"dv", s.dv}})
                    .dump()},
      {"scale", nlohmann::json(in.scale).dump()},
      {"qk_norm", "l2: x * rsqrt(sum(x^2) + " + nlohmann::json(kQkL2NormEps).dump() +
                      ") per head row, before the head repeat"},
      {"head_map", "value head h reads key head h / (H / Hk) (repeat_interleave)"},
      {"seed", std::to_string(seed)},
      {"reference", reference_name},
      {"gradients", "of sum(o * d_o); the final state gets no gradient"}};
  return io::write_safetensors(path, tensors, metadata);
}

}  // namespace gdr::bench
