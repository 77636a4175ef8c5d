// cuDNN flash attention graphs for the causal attention op: see cudnn_attention.h.
//
// Note [cuDNN through dlopen]: the frontend is compiled with dynamic loading, so this file
// never links libcudnn. It opens libcudnn.so.9 by soname at first use; in a process that
// links libtorch_cuda (every gdr CUDA binary) that is the copy libtorch already loaded, so
// gdr and ATen share one cuDNN, and a binary built against this machine's cuDNN headers
// runs with whichever cuDNN 9 the GPU machine's torch brought.
#include "kernels/attention/cudnn_attention.h"

#include <cudnn_frontend.h>
#include <dlfcn.h>

#include <cstdlib>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

namespace cudnn_frontend {
// Declared by the frontend's shim under NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING; set once by
// load_cudnn() below.
void* cudnn_dlhandle = nullptr;
}  // namespace cudnn_frontend

namespace gdr::kernels {
namespace {

namespace fe = cudnn_frontend;

void load_cudnn() {
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    // The frontend opens the CUDA runtime itself for its few runtime calls, trying
    // libcudart.so.12 before .13 and taking the first when both are installed: name the
    // major version this binary runs (a value the user set wins).
    const std::string cudart = "libcudart.so." + std::to_string(CUDART_VERSION / 1000);
    setenv("CUDNN_FRONTEND_CUDART_LIB_NAME", cudart.c_str(), /*overwrite=*/0);
    void* handle = dlopen("libcudnn.so.9", RTLD_NOW | RTLD_GLOBAL);
    if (handle == nullptr) {
      const char* why = dlerror();
      error = std::string("cudnn_attention: cannot load libcudnn.so.9 (") +
              (why != nullptr ? why : "unknown error") +
              "); the attention op needs cuDNN 9 (PyTorch's CUDA wheels bring it)";
      return;
    }
    fe::cudnn_dlhandle = handle;
  });
  if (!error.empty()) throw std::runtime_error(error);
}

// One handle per (thread, device), as cuDNN handles are not to be shared between threads
// running at the same time. Never destroyed: process lifetime, like ATen's handle pool.
cudnnHandle_t handle_for(int device) {
  thread_local std::map<int, cudnnHandle_t> handles;
  auto it = handles.find(device);
  if (it != handles.end()) return it->second;
  load_cudnn();
  cudnnHandle_t handle = nullptr;
  const cudnnStatus_t status = fe::detail::create_handle(&handle);
  if (status != CUDNN_STATUS_SUCCESS || handle == nullptr) {
    throw std::runtime_error("cudnn_attention: cudnnCreate failed on device " +
                             std::to_string(device) + " (status " +
                             std::to_string(static_cast<int>(status)) + ")");
  }
  handles.emplace(device, handle);
  return handle;
}

enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kGradO, kGradQ, kGradK, kGradV };

enum class Pass { kForward, kBackward };

struct CachedGraph {
  std::shared_ptr<fe::graph::Graph> graph;
  std::string error;  // non-empty: this problem is not supported, and why
  int64_t workspace_bytes = 0;
};

// Everything a graph depends on. The backward's key adds its strides and the algorithm;
// the forward's leaves them at zero so problems differing only there share a forward.
std::vector<int64_t> cache_key(const AttentionProblem& p, Pass pass) {
  int32_t scale_bits;
  static_assert(sizeof(scale_bits) == sizeof(p.scale));
  std::memcpy(&scale_bits, &p.scale, sizeof(scale_bits));
  std::vector<int64_t> key = {static_cast<int64_t>(pass),
                              p.device,
                              static_cast<int64_t>(p.dtype),
                              p.batch,
                              p.q_heads,
                              p.kv_heads,
                              p.seq_len,
                              p.head_dim,
                              scale_bits};
  auto append = [&key](const AttentionStrides& s) { key.insert(key.end(), s.begin(), s.end()); };
  append(p.q);
  append(p.k);
  append(p.v);
  append(p.o);
  if (pass == Pass::kBackward) {
    append(p.grad_o);
    append(p.grad_q);
    append(p.grad_k);
    append(p.grad_v);
    key.push_back(p.deterministic ? 1 : 0);
  }
  return key;
}

std::shared_ptr<fe::graph::Tensor_attributes> input(fe::graph::Graph& graph, const char* name,
                                                    Uid uid, int64_t batch, int64_t heads,
                                                    const AttentionProblem& p,
                                                    const AttentionStrides& s) {
  return graph.tensor(fe::graph::Tensor_attributes()
                          .set_name(name)
                          .set_uid(uid)
                          .set_dim({batch, heads, p.seq_len, p.head_dim})
                          .set_stride({s[0], s[1], s[2], s[3]}));
}

void set_output(const std::shared_ptr<fe::graph::Tensor_attributes>& t, Uid uid, int64_t heads,
                const AttentionProblem& p, const AttentionStrides& s) {
  t->set_output(true)
      .set_uid(uid)
      .set_dim({p.batch, heads, p.seq_len, p.head_dim})
      .set_stride({s[0], s[1], s[2], s[3]});
}

std::string step_error(const char* step, const fe::error_t& status) {
  fe::error_t copy = status;
  return std::string(step) + ": " + copy.get_message();
}

CachedGraph build(const AttentionProblem& p, Pass pass) {
  CachedGraph out;
  auto graph = std::make_shared<fe::graph::Graph>();
  graph
      ->set_io_data_type(p.dtype == AttentionDtype::kBFloat16 ? fe::DataType_t::BFLOAT16
                                                              : fe::DataType_t::HALF)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  auto q = input(*graph, "q", kQ, p.batch, p.q_heads, p, p.q);
  auto k = input(*graph, "k", kK, p.batch, p.kv_heads, p, p.k);
  auto v = input(*graph, "v", kV, p.batch, p.kv_heads, p, p.v);
  const std::vector<int64_t> stats_dim = {p.batch, p.q_heads, p.seq_len, 1};
  const std::vector<int64_t> stats_stride = {p.q_heads * p.seq_len, p.seq_len, 1, 1};
  if (pass == Pass::kForward) {
    auto options = fe::graph::SDPA_attributes()
                       .set_name("gdr_causal_attention")
                       .set_generate_stats(true)
                       .set_causal_mask(true)
                       .set_attn_scale(p.scale);
    auto [o, stats] = graph->sdpa(q, k, v, options);
    set_output(o, kO, p.q_heads, p, p.o);
    stats->set_output(true)
        .set_uid(kStats)
        .set_data_type(fe::DataType_t::FLOAT)
        .set_dim(stats_dim)
        .set_stride(stats_stride);
  } else {
    auto o = input(*graph, "o", kO, p.batch, p.q_heads, p, p.o);
    auto grad_o = input(*graph, "grad_o", kGradO, p.batch, p.q_heads, p, p.grad_o);
    auto stats = graph->tensor(fe::graph::Tensor_attributes()
                                   .set_name("stats")
                                   .set_uid(kStats)
                                   .set_dim(stats_dim)
                                   .set_stride(stats_stride)
                                   .set_data_type(fe::DataType_t::FLOAT));
    auto options = fe::graph::SDPA_backward_attributes()
                       .set_name("gdr_causal_attention_backward")
                       .set_causal_mask(true)
                       .set_attn_scale(p.scale)
                       .set_deterministic_algorithm(p.deterministic);
    auto [grad_q, grad_k, grad_v] = graph->sdpa_backward(q, k, v, o, grad_o, stats, options);
    set_output(grad_q, kGradQ, p.q_heads, p, p.grad_q);
    set_output(grad_k, kGradK, p.kv_heads, p, p.grad_k);
    set_output(grad_v, kGradV, p.kv_heads, p, p.grad_v);
  }
  cudnnHandle_t handle = handle_for(p.device);
  fe::error_t status = graph->validate();
  if (!status.is_good()) return {nullptr, step_error("validate", status), 0};
  status = graph->build_operation_graph(handle);
  if (!status.is_good()) return {nullptr, step_error("build_operation_graph", status), 0};
  status = graph->create_execution_plans({fe::HeurMode_t::A});
  if (!status.is_good()) return {nullptr, step_error("create_execution_plans", status), 0};
  status = graph->check_support(handle);
  if (!status.is_good()) return {nullptr, step_error("check_support", status), 0};
  status = graph->build_plans(handle);
  if (!status.is_good()) return {nullptr, step_error("build_plans", status), 0};
  int64_t workspace = 0;
  status = graph->get_workspace_size(workspace);
  if (!status.is_good()) return {nullptr, step_error("get_workspace_size", status), 0};
  out.graph = std::move(graph);
  out.workspace_bytes = workspace;
  return out;
}

// Builds on first use; a failed build is cached too (as its reason), so an unsupported
// problem is diagnosed once.
const CachedGraph& cached_graph(const AttentionProblem& p, Pass pass) {
  static std::mutex mutex;
  static std::map<std::vector<int64_t>, CachedGraph> cache;
  std::vector<int64_t> key = cache_key(p, pass);
  std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(std::move(key), build(p, pass)).first;
  return it->second;  // std::map nodes are stable
}

const CachedGraph& supported_graph(const AttentionProblem& p, Pass pass) {
  const CachedGraph& cached = cached_graph(p, pass);
  if (cached.graph == nullptr) {
    throw std::runtime_error(std::string("cudnn_attention: cuDNN cannot run this ") +
                             (pass == Pass::kForward ? "forward" : "backward") + ": " +
                             cached.error);
  }
  return cached;
}

void execute(const CachedGraph& cached, const AttentionProblem& p,
             std::unordered_map<int64_t, void*>& pointers, void* workspace, cudaStream_t stream,
             const char* what) {
  cudnnHandle_t handle = handle_for(p.device);
  if (fe::detail::set_stream(handle, stream) != CUDNN_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + ": cudnnSetStream failed");
  }
  const fe::error_t status = cached.graph->execute(handle, pointers, workspace);
  if (!status.is_good()) throw std::runtime_error(step_error(what, status));
}

}  // namespace

std::string cudnn_attention_unsupported_reason(const AttentionProblem& problem) {
  load_cudnn();
  const CachedGraph& forward = cached_graph(problem, Pass::kForward);
  if (forward.graph == nullptr) return "forward: " + forward.error;
  const CachedGraph& backward = cached_graph(problem, Pass::kBackward);
  if (backward.graph == nullptr) return "backward: " + backward.error;
  return {};
}

int64_t cudnn_attention_forward_workspace_bytes(const AttentionProblem& problem) {
  return supported_graph(problem, Pass::kForward).workspace_bytes;
}

int64_t cudnn_attention_backward_workspace_bytes(const AttentionProblem& problem) {
  return supported_graph(problem, Pass::kBackward).workspace_bytes;
}

void cudnn_attention_forward(const AttentionProblem& problem, const void* q, const void* k,
                             const void* v, void* o, float* stats, void* workspace,
                             cudaStream_t stream) {
  const CachedGraph& cached = supported_graph(problem, Pass::kForward);
  std::unordered_map<int64_t, void*> pointers = {{kQ, const_cast<void*>(q)},
                                                 {kK, const_cast<void*>(k)},
                                                 {kV, const_cast<void*>(v)},
                                                 {kO, o},
                                                 {kStats, stats}};
  execute(cached, problem, pointers, workspace, stream, "cudnn_attention_forward");
}

void cudnn_attention_backward(const AttentionProblem& problem, const void* q, const void* k,
                              const void* v, const void* o, const void* grad_o, const float* stats,
                              void* grad_q, void* grad_k, void* grad_v, void* workspace,
                              cudaStream_t stream) {
  const CachedGraph& cached = supported_graph(problem, Pass::kBackward);
  std::unordered_map<int64_t, void*> pointers = {{kQ, const_cast<void*>(q)},
                                                 {kK, const_cast<void*>(k)},
                                                 {kV, const_cast<void*>(v)},
                                                 {kO, const_cast<void*>(o)},
                                                 {kGradO, const_cast<void*>(grad_o)},
                                                 {kStats, const_cast<float*>(stats)},
                                                 {kGradQ, grad_q},
                                                 {kGradK, grad_k},
                                                 {kGradV, grad_v}};
  execute(cached, problem, pointers, workspace, stream, "cudnn_attention_backward");
}

int64_t cudnn_attention_backend_version() {
  load_cudnn();
  return fe::detail::get_backend_version();
}

}  // namespace gdr::kernels
