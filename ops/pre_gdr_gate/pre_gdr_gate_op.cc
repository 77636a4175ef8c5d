// The pre-GDR gate op: schema, argument checks, CPU implementation, autograd, the
// unfused composite and the tile selection. The CUDA implementation registers itself
// from pre_gdr_gate_cuda.cc (linked only into CUDA binaries).
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"

#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/softplus.h>
#include <ATen/ops/zeros_like.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <mutex>
#include <sstream>
#include <unordered_map>
#include <vector>

#include "kernels/pre_gdr_gate/pre_gdr_gate_math.h"
#include "ops/policy/autograd_policy.h"
#include "ops/policy/determinism.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_internal.h"

namespace gdr {
namespace gate_internal {
namespace {

bool is_supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

// One of the four inputs' dtype: Float, Half or BFloat16, or Double on the CPU (Note [Gate
// FP64 on the CPU]).
void check_dtype(const at::Tensor& t, const char* name) {
  TORCH_CHECK(is_supported_dtype(t.scalar_type()), "pre_gdr_gate: expected ", name,
              " of dtype Float, Half or BFloat16 (or Double on the CPU), but got ",
              t.scalar_type());
  TORCH_CHECK(!t.is_cuda() || t.scalar_type() != at::kDouble, "pre_gdr_gate: ", name,
              " is Double on ", t.device(),
              "; the CUDA kernels take Float, Half or BFloat16 (Double runs on the CPU only)");
}

void check_activation(const at::Tensor& t, const char* name, const at::Tensor& A_log) {
  TORCH_CHECK(t.defined(), "pre_gdr_gate: ", name, " is undefined");
  TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "pre_gdr_gate: expected ", name,
              " of shape [B, S, Hv] or [T, Hv], but got ", t.dim(), " dimensions ", t.sizes());
  TORCH_CHECK(t.size(-1) == A_log.size(0), "pre_gdr_gate: ", name, " has ", t.size(-1),
              " heads in its last dimension but A_log has ", A_log.size(0),
              " (expected Hv = A_log.size(0)); ", name, ".shape = ", t.sizes());
  TORCH_CHECK(t.numel() > 0, "pre_gdr_gate: ", name, " has no tokens (shape ", t.sizes(),
              "); expected at least one token");
  TORCH_CHECK(t.device() == A_log.device(), "pre_gdr_gate: ", name, " is on ", t.device(),
              " but A_log is on ", A_log.device(), "; expected all tensors on one device");
}

}  // namespace

void check_forward_inputs(const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                          const at::Tensor& dt_bias) {
  TORCH_CHECK(A_log.defined() && dt_bias.defined(),
              "pre_gdr_gate: A_log and dt_bias must be defined");
  TORCH_CHECK(A_log.dim() == 1, "pre_gdr_gate: expected A_log of shape [Hv], but got shape ",
              A_log.sizes());
  TORCH_CHECK(A_log.size(0) > 0, "pre_gdr_gate: A_log is empty; expected Hv >= 1 heads");
  TORCH_CHECK(dt_bias.sizes() == A_log.sizes(), "pre_gdr_gate: expected dt_bias of shape ",
              A_log.sizes(), " (same as A_log), but got ", dt_bias.sizes());
  check_dtype(A_log, "A_log");
  TORCH_CHECK(dt_bias.scalar_type() == A_log.scalar_type(),
              "pre_gdr_gate: expected dt_bias of dtype ", A_log.scalar_type(),
              " (same as A_log), but got ", dt_bias.scalar_type());
  TORCH_CHECK(dt_bias.device() == A_log.device(), "pre_gdr_gate: dt_bias is on ", dt_bias.device(),
              " but A_log is on ", A_log.device(), "; expected all tensors on one device");
  check_activation(a, "a", A_log);
  check_activation(b, "b", A_log);
  check_dtype(a, "a");
  TORCH_CHECK(b.scalar_type() == a.scalar_type(), "pre_gdr_gate: expected b of dtype ",
              a.scalar_type(), " (same as a), but got ", b.scalar_type());
  if (A_log.scalar_type() == at::kDouble) {
    TORCH_CHECK(a.scalar_type() == at::kDouble,
                "pre_gdr_gate: expected a of dtype Double (A_log is Double: an FP64 gate takes "
                "all four inputs in Double), but got ",
                a.scalar_type());
  } else {
    TORCH_CHECK(a.scalar_type() != at::kDouble, "pre_gdr_gate: expected a of dtype Float, Half or ",
                "BFloat16 (A_log is ", A_log.scalar_type(),
                "; a Double a needs Double A_log and dt_bias), but got Double");
  }
  TORCH_CHECK(b.sizes() == a.sizes(), "pre_gdr_gate: expected b of shape ", a.sizes(),
              " (same as a), but got ", b.sizes());
}

void check_backward_inputs(const at::Tensor& grad_g, const at::Tensor& grad_beta,
                           const at::Tensor& a, const at::Tensor& b, const at::Tensor& A_log,
                           const at::Tensor& dt_bias) {
  check_forward_inputs(a, b, A_log, dt_bias);
  for (const auto& [grad, name] :
       {std::pair<const at::Tensor&, const char*>{grad_g, "grad_g"},
        std::pair<const at::Tensor&, const char*>{grad_beta, "grad_beta"}}) {
    TORCH_CHECK(grad.defined(), "pre_gdr_gate_backward: ", name, " is undefined");
    if (a.scalar_type() == at::kDouble) {
      TORCH_CHECK(grad.scalar_type() == at::kDouble, "pre_gdr_gate_backward: expected ", name,
                  " of dtype Double (the outputs of Double inputs are FP64), but got ",
                  grad.scalar_type());
    } else {
      TORCH_CHECK(grad.scalar_type() == at::kFloat, "pre_gdr_gate_backward: expected ", name,
                  " of dtype Float (the outputs are FP32), but got ", grad.scalar_type());
    }
    TORCH_CHECK(grad.sizes() == a.sizes(), "pre_gdr_gate_backward: expected ", name, " of shape ",
                a.sizes(), " (same as a), but got ", grad.sizes());
    TORCH_CHECK(grad.device() == a.device(), "pre_gdr_gate_backward: ", name, " is on ",
                grad.device(), " but a is on ", a.device());
  }
}

kernels::GateShape gate_shape(const at::Tensor& a) {
  if (a.dim() == 2) return {1, a.size(0), a.size(1)};
  return {a.size(0), a.size(1), a.size(2)};
}

kernels::StridedOperand strided_operand(const at::Tensor& t) {
  if (t.dim() == 2) return {t.data_ptr(), 0, t.stride(0), t.stride(1)};
  return {t.data_ptr(), t.stride(0), t.stride(1), t.stride(2)};
}

kernels::ScalarKind scalar_kind(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return kernels::ScalarKind::kFloat32;
    case at::kHalf: return kernels::ScalarKind::kFloat16;
    case at::kBFloat16: return kernels::ScalarKind::kBFloat16;
    default: TORCH_CHECK(false, "pre_gdr_gate: unsupported dtype ", t.scalar_type());
  }
}

namespace {
std::mutex g_record_mutex;
PreGdrGateBackwardRecord g_last_record;
}  // namespace

void record_backward(const PreGdrGateBackwardRecord& record) {
  std::lock_guard<std::mutex> lock(g_record_mutex);
  const int64_t calls = g_last_record.calls + 1;
  g_last_record = record;
  g_last_record.calls = calls;
}

}  // namespace gate_internal

PreGdrGateBackwardRecord pre_gdr_gate_last_backward() {
  std::lock_guard<std::mutex> lock(gate_internal::g_record_mutex);
  return gate_internal::g_last_record;
}

// ---------------------------------------------------------------------------
// Tile override and selection

namespace {

// The execution policy's fixed tile, checked against the launch rules (the policy's parser
// only lets launchable tiles in, but a policy built in code may hold any).
std::optional<kernels::GateTile> policy_tile() {
  const std::optional<kernels::GateTile>& tile = current_execution_policy().gate_tile;
  if (tile.has_value()) {
    const std::string problem = kernels::validate_gate_tile(*tile);
    TORCH_CHECK(problem.empty(), "pre_gdr_gate_backward: the execution policy's pre_gdr_gate_tile ",
                kernels::to_string(*tile), " cannot be launched: ", problem);
  }
  return tile;
}

}  // namespace

TileSelection<kernels::GateTile> select_pre_gdr_gate_tile(
    const kernels::GateShape& shape, const std::string& dtype_key, int device_index,
    bool deterministic, const std::function<double(const kernels::GateTile&)>& time_ms,
    int input_element_bytes) {
  // Token counts are bucketed to the next power of two: nearby lengths share a timing.
  int64_t bucket = 1;
  while (bucket < shape.tokens()) bucket <<= 1;
  const std::string key = "pre_gdr_gate_backward|tokens<=" + std::to_string(bucket) +
                          "|heads=" + std::to_string(shape.heads) + "|" + dtype_key +
                          "|device=" + std::to_string(device_index);
  return autotune_configs<kernels::GateTile>(
      kernels::pre_gdr_gate_candidate_tiles(), key, deterministic, policy_tile(),
      [&](const kernels::GateTile& tile) {
        return kernels::gate_tile_static_cost(tile, shape, input_element_bytes);
      },
      time_ms);
}

namespace {

// Note [Gate per-shape tile cache].
struct CachedTile {
  kernels::GateTile tile;
  SelectionSource source;
  int64_t generation;
};

struct SelectionKeyHash {
  size_t operator()(const std::array<int64_t, 9>& k) const {
    size_t h = 0;
    for (int64_t v : k) h = h * 1000003u ^ std::hash<int64_t>()(v);
    return h;
  }
};

std::mutex g_tile_cache_mutex;
std::unordered_map<std::array<int64_t, 9>, CachedTile, SelectionKeyHash>& tile_cache() {
  static auto* cache =
      new std::unordered_map<std::array<int64_t, 9>, CachedTile, SelectionKeyHash>();
  return *cache;
}

int64_t token_bucket(int64_t tokens) {
  int64_t bucket = 1;
  while (bucket < tokens) bucket <<= 1;
  return bucket;
}

}  // namespace

TileSelection<kernels::GateTile> select_pre_gdr_gate_tile_cached(
    const GateSelectionKey& key, bool deterministic, const std::function<std::string()>& dtype_key,
    const std::function<std::function<double(const kernels::GateTile&)>()>& make_timer) {
  if (std::optional<kernels::GateTile> tile = policy_tile()) {
    return {*tile, SelectionSource::kOverride};
  }
  // Deterministic: the rule sees the exact token count; default: the autotuner's bucket.
  const std::array<int64_t, 9> cache_key = {
      deterministic ? 1 : 0,
      deterministic ? key.shape.tokens() : token_bucket(key.shape.tokens()),
      key.shape.heads,
      key.input_dtype,
      key.param_dtype,
      key.contiguous ? 1 : 0,
      key.device_index,
      key.input_element_bytes,
      0};
  const int64_t generation = autotune_cache_generation();
  {
    std::lock_guard<std::mutex> lock(g_tile_cache_mutex);
    auto it = tile_cache().find(cache_key);
    if (it != tile_cache().end() && it->second.generation == generation) {
      return {it->second.tile, it->second.source};
    }
  }
  const TileSelection<kernels::GateTile> selection =
      select_pre_gdr_gate_tile(key.shape, dtype_key(), key.device_index, deterministic,
                               deterministic ? nullptr : make_timer(), key.input_element_bytes);
  const bool cacheable = deterministic ? selection.source == SelectionSource::kStaticCost
                                       : selection.source == SelectionSource::kAutotuneTimed ||
                                             selection.source == SelectionSource::kAutotuneCache;
  if (cacheable) {
    const SelectionSource later =
        deterministic ? SelectionSource::kStaticCost : SelectionSource::kAutotuneCache;
    std::lock_guard<std::mutex> lock(g_tile_cache_mutex);
    tile_cache()[cache_key] = {selection.config, later, generation};
  }
  return selection;
}

// ---------------------------------------------------------------------------
// CPU implementation: the same scalar formulas (kernels/pre_gdr_gate/pre_gdr_gate_math.h) in FP32,
// per-head sums accumulated in FP64 in token order (deterministic by construction).
//
// Note [Gate FP64 on the CPU]: Double inputs (a, b, A_log and dt_bias all Double; a mix is
// an error) run the same code in FP64: FP64 formulas (the double overloads in
// pre_gdr_gate_math.h), FP64 per-head sums in the same token order, and g, beta, da, db,
// dA_log, ddt_bias in FP64. That is what end-to-end FP64 runs of the model need (the
// Hugging Face parity test, tests/models/hf_parity_test.cc, and finite-difference checks).
// The CUDA kernels have no FP64 path: Double on CUDA is refused by the argument checks.
// Float, Half and BFloat16 inputs keep FP32 math and FP32 outputs, bit for bit as before.

namespace {

// The compute type of a gate call: FP64 for Double inputs, FP32 otherwise.
at::ScalarType gate_compute_type(const at::Tensor& a) {
  return a.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

at::Tensor as_3d(const at::Tensor& t, at::ScalarType type) {
  at::Tensor f = t.to(type).contiguous();
  return f.dim() == 2 ? f.unsqueeze(0) : f;
}

template <typename T>
void gate_forward_cpu_kernel(int64_t n, int64_t heads, const T* ap, const T* bp, const T* Ap,
                             const T* dtp, T* gp, T* betap) {
  for (int64_t e = 0; e < n; ++e) {
    const int64_t h = e % heads;
    gp[e] = -std::exp(Ap[h]) * kernels::gate_softplus(ap[e] + dtp[h]);
    betap[e] = kernels::gate_sigmoid(bp[e]);
  }
}

std::tuple<at::Tensor, at::Tensor> pre_gdr_gate_forward_cpu(const at::Tensor& a,
                                                            const at::Tensor& b,
                                                            const at::Tensor& A_log,
                                                            const at::Tensor& dt_bias) {
  gate_internal::check_forward_inputs(a, b, A_log, dt_bias);
  const at::ScalarType ct = gate_compute_type(a);
  const at::Tensor af = as_3d(a, ct), bf = as_3d(b, ct);
  const at::Tensor Af = A_log.to(ct).contiguous(), dtf = dt_bias.to(ct).contiguous();
  at::Tensor g = at::empty(a.sizes(), a.options().dtype(ct));
  at::Tensor beta = at::empty(a.sizes(), a.options().dtype(ct));
  const int64_t heads = A_log.size(0);
  const int64_t n = af.numel();
  if (ct == at::kDouble) {
    gate_forward_cpu_kernel<double>(n, heads, af.data_ptr<double>(), bf.data_ptr<double>(),
                                    Af.data_ptr<double>(), dtf.data_ptr<double>(),
                                    g.data_ptr<double>(), beta.data_ptr<double>());
  } else {
    gate_forward_cpu_kernel<float>(n, heads, af.data_ptr<float>(), bf.data_ptr<float>(),
                                   Af.data_ptr<float>(), dtf.data_ptr<float>(), g.data_ptr<float>(),
                                   beta.data_ptr<float>());
  }
  return {g, beta};
}

// One pass over the elements in token order: da, db, and the per-head sums of dA_log and
// ddt_bias accumulated in FP64.
template <typename T>
void gate_backward_cpu_kernel(int64_t n, int64_t heads, const T* ap, const T* bp, const T* dgp,
                              const T* dbetap, const T* Ap, const T* dtp, T* dap, T* dbp,
                              std::vector<double>& sum_A_log, std::vector<double>& sum_dt_bias) {
  for (int64_t e = 0; e < n; ++e) {
    const int64_t h = e % heads;
    const T neg_exp_A = -std::exp(Ap[h]);
    const T pre = ap[e] + dtp[h];
    T softplus, softplus_grad;
    kernels::gate_softplus_and_grad(pre, softplus, softplus_grad);
    const T g = neg_exp_A * softplus;
    const T da_value = dgp[e] * (neg_exp_A * softplus_grad);
    const T beta = kernels::gate_sigmoid(bp[e]);
    dap[e] = da_value;
    dbp[e] = dbetap[e] * beta * (T(1) - beta);
    sum_A_log[h] += static_cast<double>(dgp[e]) * static_cast<double>(g);
    sum_dt_bias[h] += static_cast<double>(da_value);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pre_gdr_gate_backward_cpu(
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& A_log, const at::Tensor& dt_bias) {
  gate_internal::check_backward_inputs(grad_g, grad_beta, a, b, A_log, dt_bias);
  const at::ScalarType ct = gate_compute_type(a);
  const at::Tensor af = as_3d(a, ct), bf = as_3d(b, ct);
  const at::Tensor dgf = as_3d(grad_g, ct), dbetaf = as_3d(grad_beta, ct);
  const at::Tensor Af = A_log.to(ct).contiguous(), dtf = dt_bias.to(ct).contiguous();
  const int64_t heads = A_log.size(0);
  const int64_t n = af.numel();
  at::Tensor da = at::empty(a.sizes(), a.options().dtype(ct));
  at::Tensor db = at::empty(a.sizes(), a.options().dtype(ct));
  std::vector<double> sum_A_log(heads, 0.0), sum_dt_bias(heads, 0.0);
  if (ct == at::kDouble) {
    gate_backward_cpu_kernel<double>(
        n, heads, af.data_ptr<double>(), bf.data_ptr<double>(), dgf.data_ptr<double>(),
        dbetaf.data_ptr<double>(), Af.data_ptr<double>(), dtf.data_ptr<double>(),
        da.data_ptr<double>(), db.data_ptr<double>(), sum_A_log, sum_dt_bias);
  } else {
    gate_backward_cpu_kernel<float>(
        n, heads, af.data_ptr<float>(), bf.data_ptr<float>(), dgf.data_ptr<float>(),
        dbetaf.data_ptr<float>(), Af.data_ptr<float>(), dtf.data_ptr<float>(), da.data_ptr<float>(),
        db.data_ptr<float>(), sum_A_log, sum_dt_bias);
  }
  // The sums rounded to the compute type (FP32: as the CUDA kernels store them), then to
  // the parameters' dtype.
  at::Tensor sums = at::empty({2, heads}, A_log.options().dtype(at::kDouble));
  double* sp = sums.data_ptr<double>();
  for (int64_t h = 0; h < heads; ++h) {
    sp[h] = sum_A_log[h];
    sp[heads + h] = sum_dt_bias[h];
  }
  sums = sums.to(ct);
  return {da.to(a.scalar_type()), db.to(b.scalar_type()), sums[0].to(A_log.scalar_type()),
          sums[1].to(dt_bias.scalar_type())};
}

// ---------------------------------------------------------------------------
// Autograd

const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>&
forward_op() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("gdr::pre_gdr_gate", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&)>();
  return op;
}

const c10::TypedOperatorHandle<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
    const at::Tensor&)>&
backward_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::pre_gdr_gate_backward", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op;
}

class PreGdrGateFunction : public torch::autograd::Function<PreGdrGateFunction> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& a, const at::Tensor& b,
                                                const at::Tensor& A_log,
                                                const at::Tensor& dt_bias) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    save_execution_policy(ctx);
    auto [g, beta] = forward_op().call(a, b, A_log, dt_bias);
    // Saving the inputs (not g/beta) keeps the saved bytes at the input dtype; backward
    // recomputes g and beta with the same formulas.
    ctx->save_for_backward({a, b, A_log, dt_bias});
    return {g, beta};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const ExecutionPolicyGuard policy = restore_execution_policy(ctx);
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& a = saved[0];
    const auto out_options = a.options().dtype(gate_compute_type(a));
    at::Tensor grad_g = grads[0].defined() ? grads[0] : at::zeros_like(a, out_options);
    at::Tensor grad_beta = grads[1].defined() ? grads[1] : at::zeros_like(a, out_options);
    auto [da, db, dA_log, ddt_bias] =
        backward_op().call(grad_g, grad_beta, saved[0], saved[1], saved[2], saved[3]);
    return {da, db, dA_log, ddt_bias};
  }
};

std::tuple<at::Tensor, at::Tensor> pre_gdr_gate_autograd(const at::Tensor& a, const at::Tensor& b,
                                                         const at::Tensor& A_log,
                                                         const at::Tensor& dt_bias) {
  // Nothing to differentiate: skip the custom Function (a node, saved variables and
  // output wrapping, several microseconds of host time) and call the kernel below
  // autograd, which is what apply() would do. The outputs have no grad_fn either way.
  if (!at::GradMode::is_enabled() || !(a.requires_grad() || b.requires_grad() ||
                                       A_log.requires_grad() || dt_bias.requires_grad())) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return forward_op().call(a, b, A_log, dt_bias);
  }
  auto outputs = PreGdrGateFunction::apply(a, b, A_log, dt_bias);
  return {outputs[0], outputs[1]};
}

}  // namespace

TORCH_LIBRARY(gdr, m) {
  m.def(
      "pre_gdr_gate(Tensor a, Tensor b, Tensor A_log, Tensor dt_bias) -> (Tensor g, Tensor beta)");
  m.def(
      "pre_gdr_gate_backward(Tensor grad_g, Tensor grad_beta, Tensor a, Tensor b, Tensor A_log, "
      "Tensor dt_bias) -> (Tensor da, Tensor db, Tensor dA_log, Tensor ddt_bias)");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) {
  m.impl("pre_gdr_gate", &pre_gdr_gate_forward_cpu);
  m.impl("pre_gdr_gate_backward", &pre_gdr_gate_backward_cpu);
}

TORCH_LIBRARY_IMPL(gdr, Autograd, m) { m.impl("pre_gdr_gate", &pre_gdr_gate_autograd); }

std::tuple<at::Tensor, at::Tensor> pre_gdr_gate(const at::Tensor& a, const at::Tensor& b,
                                                const at::Tensor& A_log,
                                                const at::Tensor& dt_bias) {
  return forward_op().call(a, b, A_log, dt_bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> pre_gdr_gate_backward(
    const at::Tensor& grad_g, const at::Tensor& grad_beta, const at::Tensor& a, const at::Tensor& b,
    const at::Tensor& A_log, const at::Tensor& dt_bias) {
  return backward_op().call(grad_g, grad_beta, a, b, A_log, dt_bias);
}

std::tuple<at::Tensor, at::Tensor> pre_gdr_gate_composite(const at::Tensor& a, const at::Tensor& b,
                                                          const at::Tensor& A_log,
                                                          const at::Tensor& dt_bias) {
  gate_internal::check_forward_inputs(a, b, A_log, dt_bias);
  // FP32 math, or FP64 for Double inputs (Note [Gate FP64 on the CPU]).
  const at::ScalarType ct = gate_compute_type(a);
  at::Tensor g = -at::exp(A_log.to(ct)) * at::softplus(a.to(ct) + dt_bias.to(ct));
  at::Tensor beta = at::sigmoid(b.to(ct));
  return {g, beta};
}

}  // namespace gdr
