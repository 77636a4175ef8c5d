// The tied embedding ops: argument checks, the rows op's schema and CPU implementation (the
// reference), the two autograd functions and the execution policy's tied_embedding switch.
// The CUDA implementation of the rows op registers itself from tied_embedding_cuda.cc
// (linked only into CUDA binaries).
//
// Note [Tied embedding gradient]: with tied embeddings autograd gets two gradients for W,
// the LM head's dW = dlogits^T @ hidden (a GEMM that writes all of [V, H]) and the
// embedding's (EmbeddingBackward0: a zero-filled dense [V, H] plus a scatter of N rows),
// and adds them: three [V, H] passes for N rows of work (their cost in the 0.8B step:
// docs/benchmarks.md, Tied embedding gradient).
// The pair here gives W one gradient instead:
//   - the LM head's backward computes d_hidden and dW with MmBackward's exact mm calls,
//     returns d_hidden, and hands dW to the shared state instead of returning it (W's slot
//     gets an undefined gradient, which autograd drops);
//   - the lookup's backward takes that dW (else allocates zeros: the LM head's backward
//     did not run), adds each id's token rows of d_h into it in place (FP32 sums in token
//     order, one rounding: kernels/tied_embedding/embedding_rows.h) and returns it as W's gradient.
// Ordering: the lookup's output feeds everything, so in a model the lookup's backward runs
// after the LM head's. The LM head does not rely on that: it stashes dW only when the
// current backward will still run this state's lookup node (the node is in the graph
// task's graph, exec_info lets it execute, and it has not run yet in this task);
// otherwise it returns dW to autograd as usual, which then adds the two gradients itself.
// The lookup takes a stash only from its own graph task, so a backward that died between
// the two leaves nothing stale for the next one. Everything here is host bookkeeping: no
// sync, no allocation beyond the ops', so it works under CUDA graph capture (the stash is
// just a held tensor of the capture's pool).
//
// Bits: W's gradient is round(dW_lm + sum) where the composite gives
// round(dW_lm + round(sum')) with sum' ATen's embedding backward sum (its own order; on
// CUDA sorted segments of FP32 partial sums): equal in FP64 up to summation order, within
// one ulp of the 16-bit dtype per element otherwise. d_hidden and the forwards are
// bitwise the composite's.
#include "ops/tied_embedding/tied_embedding_op.h"

#include <ATen/Parallel.h>
#include <ATen/ops/_unsafe_view.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "ops/tied_embedding/tied_embedding_internal.h"

namespace gdr {

class TiedEmbeddingState {
 public:
  std::mutex mutex;
  std::weak_ptr<torch::autograd::Node> lookup_node;  // set after the lookup's forward
  at::Tensor stashed_grad_weight;                    // the LM head's dW, for the lookup
  int stash_task = -1;                               // graph task that stashed it
  std::optional<int> lookup_ran_in_task;             // graph task whose backward ran the lookup
};

TiedEmbeddingStatePtr make_tied_embedding_state() { return std::make_shared<TiedEmbeddingState>(); }

namespace tied_embedding_internal {

void check_add_rows_inputs(const at::Tensor& grad_weight, const at::Tensor& ids,
                           const at::Tensor& rows) {
  constexpr const char* op = "tied_embedding_add_rows_";
  TORCH_CHECK(grad_weight.defined() && ids.defined() && rows.defined(), op,
              ": expected defined grad_weight, ids and rows");
  const at::ScalarType s = grad_weight.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16 || s == at::kDouble, op,
              ": expected grad_weight of dtype Float, Half, BFloat16 or Double, but got ", s);
  TORCH_CHECK(!grad_weight.is_cuda() || s != at::kDouble, op,
              ": grad_weight is Double on CUDA; expected Float, Half or BFloat16");
  TORCH_CHECK(grad_weight.dim() == 2 && grad_weight.is_contiguous(), op,
              ": expected a contiguous 2-D grad_weight [V, H], but got shape ", grad_weight.sizes(),
              " and strides ", grad_weight.strides());
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, op,
              ": expected ids [N] of dtype Long, but got shape ", ids.sizes(), " and dtype ",
              ids.scalar_type());
  TORCH_CHECK(rows.scalar_type() == s, op, ": expected rows of dtype ", s,
              " (grad_weight's), but got ", rows.scalar_type());
  TORCH_CHECK(rows.dim() == 2 && rows.size(0) == ids.size(0) &&
                  rows.size(1) == grad_weight.size(1) && rows.is_contiguous(),
              op, ": expected contiguous rows of shape [", ids.size(0), ", ", grad_weight.size(1),
              "], but got shape ", rows.sizes(), " and strides ", rows.strides());
  TORCH_CHECK(ids.device() == grad_weight.device() && rows.device() == grad_weight.device(), op,
              ": expected ids and rows on grad_weight's device ", grad_weight.device(),
              ", but got ", ids.device(), " and ", rows.device());
}

}  // namespace tied_embedding_internal

using tied_embedding_internal::check_add_rows_inputs;

namespace {

// ---------------------------------------------------------------------------
// CPU implementation (the reference): tokens grouped by id in token order, each group
// summed in Acc from its first row, one rounding into dW. Groups are independent rows, so
// the parallel split does not change the bits.

template <typename T, typename Acc>
void add_rows_typed(T* dw, const int64_t* ids, const T* rows, int64_t tokens, int64_t hidden,
                    int64_t vocab) {
  std::vector<int64_t> heads;                 // first token of each id, in token order
  std::vector<int64_t> next(tokens, -1);      // next token with the same id
  std::unordered_map<int64_t, int64_t> last;  // id -> its latest token so far
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t id = ids[t];
    if (id < 0 || id >= vocab) continue;
    const auto [it, first] = last.try_emplace(id, t);
    if (first) {
      heads.push_back(t);
    } else {
      next[it->second] = t;
      it->second = t;
    }
  }
  const int64_t groups = static_cast<int64_t>(heads.size());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<Acc> acc(hidden);
    for (int64_t g = begin; g < end; ++g) {
      const int64_t head = heads[g];
      const T* first = rows + head * hidden;
      for (int64_t c = 0; c < hidden; ++c) acc[c] = static_cast<Acc>(first[c]);
      for (int64_t u = next[head]; u >= 0; u = next[u]) {
        const T* row = rows + u * hidden;
        for (int64_t c = 0; c < hidden; ++c) acc[c] += static_cast<Acc>(row[c]);
      }
      T* dst = dw + ids[head] * hidden;
      for (int64_t c = 0; c < hidden; ++c)
        dst[c] = static_cast<T>(static_cast<Acc>(dst[c]) + acc[c]);
    }
  });
}

void add_rows_cpu(at::Tensor& grad_weight, const at::Tensor& ids, const at::Tensor& rows) {
  check_add_rows_inputs(grad_weight, ids, rows);
  const int64_t tokens = ids.size(0), hidden = grad_weight.size(1), vocab = grad_weight.size(0);
  const at::Tensor ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  switch (grad_weight.scalar_type()) {
    case at::kFloat:
      add_rows_typed<float, float>(grad_weight.data_ptr<float>(), id, rows.data_ptr<float>(),
                                   tokens, hidden, vocab);
      break;
    case at::kDouble:
      add_rows_typed<double, double>(grad_weight.data_ptr<double>(), id, rows.data_ptr<double>(),
                                     tokens, hidden, vocab);
      break;
    case at::kHalf:
      add_rows_typed<c10::Half, float>(grad_weight.data_ptr<c10::Half>(), id,
                                       rows.data_ptr<c10::Half>(), tokens, hidden, vocab);
      break;
    case at::kBFloat16:
      add_rows_typed<c10::BFloat16, float>(grad_weight.data_ptr<c10::BFloat16>(), id,
                                           rows.data_ptr<c10::BFloat16>(), tokens, hidden, vocab);
      break;
    default:
      TORCH_CHECK(false, "tied_embedding_add_rows_: unsupported dtype ", grad_weight.scalar_type());
  }
}

using AddRowsSignature = void(at::Tensor&, const at::Tensor&, const at::Tensor&);

const c10::TypedOperatorHandle<AddRowsSignature>& add_rows_op() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("gdr::tied_embedding_add_rows_", "")
                             .typed<AddRowsSignature>();
  return op;
}

// ---------------------------------------------------------------------------
// Autograd

// The state in the autograd context (saved_data holds IValues: a registered custom class).
class StateHolder : public torch::CustomClassHolder {
 public:
  explicit StateHolder(TiedEmbeddingStatePtr s) : state(std::move(s)) {}
  TiedEmbeddingStatePtr state;
};

TiedEmbeddingState& state_of(torch::autograd::AutogradContext* ctx) {
  return *ctx->saved_data["state"].toCustomClass<StateHolder>()->state;
}

void check_weight(const char* op, const at::Tensor& weight) {
  TORCH_CHECK(weight.defined(), op, ": weight is undefined");
  TORCH_CHECK(weight.dim() == 2, op, ": expected a 2-D weight [V, H], but got shape ",
              weight.sizes());
  const at::ScalarType s = weight.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kHalf || s == at::kBFloat16 || s == at::kDouble, op,
              ": expected weight of dtype Float, Half, BFloat16 or Double, but got ", s);
}

void check_state(const char* op, const TiedEmbeddingStatePtr& state) {
  TORCH_CHECK(state != nullptr, op, ": state is null; expected make_tied_embedding_state()");
}

// Whether the current backward will still run `node` (Note [Tied embedding gradient]).
bool runs_later_in_this_task(const std::shared_ptr<torch::autograd::Node>& node,
                             const TiedEmbeddingState& state) {
  if (!node) return false;
  const auto* nodes = torch::autograd::get_current_graph_task_nodes_in_graph();
  if (nodes == nullptr || nodes->count(node.get()) == 0) return false;
  const auto* exec_info = torch::autograd::get_current_graph_task_exec_info();
  if (exec_info != nullptr && !exec_info->empty()) {
    const auto it = exec_info->find(node.get());
    if (it == exec_info->end() || !it->second.should_execute()) return false;
  }
  return state.lookup_ran_in_task != torch::autograd::get_current_graph_task_id();
}

class TiedEmbeddingLookup : public torch::autograd::Function<TiedEmbeddingLookup> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& ids, const at::Tensor& weight,
                                                const TiedEmbeddingStatePtr& state) {
    const at::Tensor flat = ids.reshape(-1);
    at::Tensor h = weight.index_select(0, flat);
    if (ids.dim() != 1) {
      std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
      shape.push_back(weight.size(1));
      h = at::_unsafe_view(h, shape);
    }
    ctx->save_for_backward({flat});
    ctx->saved_data["state"] = c10::IValue(c10::make_intrusive<StateHolder>(state));
    ctx->saved_data["vocab"] = weight.size(0);
    ctx->saved_data["hidden"] = weight.size(1);
    ctx->saved_data["weight_dtype"] = weight.scalar_type();
    ctx->saved_data["weight_device"] = weight.device();
    return {h};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    TiedEmbeddingState& state = state_of(ctx);
    const int task = torch::autograd::get_current_graph_task_id();
    at::Tensor grad_weight;
    {
      const std::lock_guard<std::mutex> lock(state.mutex);
      state.lookup_ran_in_task = task;
      if (state.stashed_grad_weight.defined() && state.stash_task == task) {
        grad_weight = std::move(state.stashed_grad_weight);
      }
      state.stashed_grad_weight = at::Tensor();
    }
    if (!ctx->needs_input_grad(1)) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const at::Tensor flat = ctx->get_saved_variables()[0];
    const at::Tensor& grad = grads[0];
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    if (!grad_weight.defined()) {
      grad_weight = at::zeros({ctx->saved_data["vocab"].toInt(), ctx->saved_data["hidden"].toInt()},
                              at::TensorOptions()
                                  .dtype(ctx->saved_data["weight_dtype"].toScalarType())
                                  .device(ctx->saved_data["weight_device"].toDevice()));
    } else if (!grad_weight.is_contiguous()) {
      grad_weight = grad_weight.contiguous();
    }
    if (grad.defined()) {
      const at::Tensor rows = grad.reshape({flat.size(0), grad_weight.size(1)}).contiguous();
      add_rows_op().call(grad_weight, flat, rows);
    }
    return {at::Tensor(), grad_weight, at::Tensor()};
  }
};

// matmul's fold of hidden [..., H] into the mm operand [N, H].
at::Tensor folded(const at::Tensor& hidden) {
  return hidden.dim() == 2 ? hidden : hidden.reshape({-1, hidden.size(-1)});
}

class TiedLmHead : public torch::autograd::Function<TiedLmHead> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& hidden, const at::Tensor& weight,
                                                const TiedEmbeddingStatePtr& state) {
    // matmul's fold: [..., H] -> [N, H] (a view for a contiguous hidden), one mm with
    // W.t(), the result re-viewed to [..., V].
    at::Tensor logits = folded(hidden).mm(weight.t());
    if (hidden.dim() != 2) {
      std::vector<int64_t> shape(hidden.sizes().begin(), hidden.sizes().end() - 1);
      shape.push_back(weight.size(0));
      logits = at::_unsafe_view(logits, shape);
    }
    ctx->save_for_backward({hidden, weight});
    ctx->saved_data["state"] = c10::IValue(c10::make_intrusive<StateHolder>(state));
    ctx->saved_data["hidden_sizes"] = hidden.sizes();
    return {logits};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor& grad = grads[0];
    if (!grad.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    const auto saved = ctx->get_saved_variables();
    const at::Tensor hidden_2d = folded(saved[0]);
    const at::Tensor mat2 = saved[1].t();
    const std::vector<int64_t> hidden_sizes = ctx->saved_data["hidden_sizes"].toIntVector();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    // _unsafe_view's backward: grad.reshape(mm output sizes).
    const at::Tensor grad_2d = grad.reshape({hidden_2d.size(0), mat2.size(1)});
    at::Tensor grad_hidden, grad_weight;
    if (ctx->needs_input_grad(0)) {
      // mm_mat1_backward (FunctionsManual.cpp): column-major mat1 gets a column-major grad.
      const bool column_major =
          hidden_2d.stride(0) == 1 && hidden_2d.stride(1) == hidden_2d.size(0);
      const at::Tensor grad_mat1 = column_major ? mat2.mm(grad_2d.t()).t() : grad_2d.mm(mat2.t());
      grad_hidden = grad_mat1.reshape(hidden_sizes);  // the fold's (view) backward
    }
    if (ctx->needs_input_grad(1)) {
      // mm_mat2_backward, then t()'s backward (another t()).
      const bool column_major = mat2.stride(0) == 1 && mat2.stride(1) == mat2.size(0);
      const at::Tensor grad_mat2 =
          column_major ? grad_2d.t().mm(hidden_2d).t() : hidden_2d.t().mm(grad_2d);
      grad_weight = grad_mat2.t();
      TiedEmbeddingState& state = state_of(ctx);
      const std::lock_guard<std::mutex> lock(state.mutex);
      if (!state.stashed_grad_weight.defined() &&
          runs_later_in_this_task(state.lookup_node.lock(), state)) {
        state.stashed_grad_weight = std::move(grad_weight);
        state.stash_task = torch::autograd::get_current_graph_task_id();
        grad_weight = at::Tensor();
      }
    }
    return {grad_hidden, grad_weight, at::Tensor()};
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(gdr, m) {
  m.class_<StateHolder>("TiedEmbeddingState");
  m.def("tied_embedding_add_rows_(Tensor(a!) grad_weight, Tensor ids, Tensor rows) -> ()");
}

TORCH_LIBRARY_IMPL(gdr, CPU, m) { m.impl("tied_embedding_add_rows_", &add_rows_cpu); }

at::Tensor tied_embedding_lookup(const at::Tensor& ids, const at::Tensor& weight,
                                 const TiedEmbeddingStatePtr& state) {
  constexpr const char* op = "tied_embedding_lookup";
  check_state(op, state);
  check_weight(op, weight);
  TORCH_CHECK(ids.defined() && ids.scalar_type() == at::kLong, op,
              ": expected ids of dtype Long, but got ",
              ids.defined() ? c10::toString(ids.scalar_type()) : "an undefined tensor");
  TORCH_CHECK(ids.device() == weight.device(), op, ": ids are on ", ids.device(),
              " but weight is on ", weight.device(), "; expected one device");
  at::Tensor h = TiedEmbeddingLookup::apply(ids, weight, state)[0];
  const std::lock_guard<std::mutex> lock(state->mutex);
  state->lookup_node = h.grad_fn();
  return h;
}

at::Tensor tied_lm_head(const at::Tensor& hidden, const at::Tensor& weight,
                        const TiedEmbeddingStatePtr& state) {
  constexpr const char* op = "tied_lm_head";
  check_state(op, state);
  check_weight(op, weight);
  TORCH_CHECK(hidden.defined() && hidden.dim() >= 2 && hidden.size(-1) == weight.size(1), op,
              ": expected hidden [..., ", weight.size(1), "] with at least 2 dims, but got shape ",
              hidden.defined() ? hidden.sizes() : at::IntArrayRef());
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), op, ": expected hidden of dtype ",
              weight.scalar_type(), " (weight's), but got ", hidden.scalar_type());
  TORCH_CHECK(hidden.device() == weight.device(), op, ": hidden is on ", hidden.device(),
              " but weight is on ", weight.device(), "; expected one device");
  return TiedLmHead::apply(hidden, weight, state)[0];
}

void tied_embedding_add_rows_(at::Tensor& grad_weight, const at::Tensor& ids,
                              const at::Tensor& rows) {
  add_rows_op().call(grad_weight, ids, rows);
}

bool tied_embedding_fusable(const at::Tensor& weight) {
  const at::ScalarType s = weight.scalar_type();
  const bool dtype_ok = s == at::kFloat || s == at::kHalf || s == at::kBFloat16 ||
                        (s == at::kDouble && !weight.is_cuda());
  return dtype_ok && weight.dim() == 2 &&
         current_execution_policy().tied_embedding == TiedEmbeddingImpl::kFused;
}

}  // namespace gdr
