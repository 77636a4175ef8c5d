// The execution policy's keys, parsers, environment overrides and the current-policy guard
// (Note [Execution policy] in the header). This is the one file of gdr that reads GDR_*
// environment variables.
#include "ops/policy/execution_policy.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

extern char** environ;

namespace gdr {
namespace {

// One choice: its public description, and how to read and write it as text. `parse`
// returns false when the text is not one of the values; the caller words the error.
struct Choice {
  ExecutionPolicyKey key;
  std::function<std::string(const ExecutionPolicy&)> show;
  std::function<bool(ExecutionPolicy&, absl::string_view)> parse;
  // What is wrong with a text parse refused, when "expected <values>" does not say it (the
  // gate tile's launch rules); the whole message after "<source>: ".
  std::function<std::string(absl::string_view)> why_not = nullptr;
};

// An enum choice whose values are named in enum order (names[i] is enumerator i).
template <typename Enum>
Choice enum_choice(const char* key, const char* config_key, const char* variable,
                   std::vector<std::string> names, Enum ExecutionPolicy::*member,
                   const char* what) {
  Choice c;
  c.key = {
      key, config_key, variable, names, names.at(static_cast<size_t>(ExecutionPolicy{}.*member)),
      what};
  c.show = [names, member](const ExecutionPolicy& p) {
    return names.at(static_cast<size_t>(p.*member));
  };
  c.parse = [names, member](ExecutionPolicy& p, absl::string_view text) {
    for (size_t i = 0; i < names.size(); ++i) {
      if (text == names[i]) {
        p.*member = static_cast<Enum>(i);
        return true;
      }
    }
    return false;
  };
  return c;
}

// A boolean choice: true / false in a config, and also 1 / 0 (what the environment
// variables have always taken).
Choice bool_choice(const char* key, const char* config_key, const char* variable,
                   bool ExecutionPolicy::*member, bool default_value, const char* what) {
  Choice c;
  c.key = {key, config_key, variable, {"true", "false"}, default_value ? "true" : "false", what};
  c.show = [member](const ExecutionPolicy& p) { return std::string(p.*member ? "true" : "false"); };
  c.parse = [member](ExecutionPolicy& p, absl::string_view text) {
    if (text == "true" || text == "1") {
      p.*member = true;
      return true;
    }
    if (text == "false" || text == "0") {
      p.*member = false;
      return true;
    }
    return false;
  };
  return c;
}

// "auto" or BLOCK_TxBLOCK_HxTHREADS, a tile the launch rules accept.
std::optional<kernels::GateTile> parse_tile_text(absl::string_view text) {
  const std::vector<std::string> parts = absl::StrSplit(text, 'x');
  if (parts.size() != 3) return std::nullopt;
  int values[3];
  for (int i = 0; i < 3; ++i) {
    const std::string& part = parts[i];
    char* end = nullptr;
    const long value = std::strtol(part.c_str(), &end, 10);
    if (part.empty() || end == nullptr || *end != '\0' || value <= 0 || value >= (1 << 20)) {
      return std::nullopt;
    }
    values[i] = static_cast<int>(value);
  }
  return kernels::GateTile{values[0], values[1], values[2]};
}

Choice gate_tile_choice() {
  Choice c;
  c.key = {"pre_gdr_gate_tile",
           "kernels.pre_gdr_gate_tile",
           "GDR_PRE_GDR_GATE_TILE",
           {"auto", "BLOCK_TxBLOCK_HxTHREADS"},
           "auto",
           "the gate backward's tile in both modes (auto: autotuned by default, the cost rule "
           "in deterministic mode)"};
  c.show = [](const ExecutionPolicy& p) {
    return p.gate_tile.has_value() ? kernels::to_string(*p.gate_tile) : std::string("auto");
  };
  c.parse = [](ExecutionPolicy& p, absl::string_view text) {
    if (text == "auto") {
      p.gate_tile.reset();
      return true;
    }
    const std::optional<kernels::GateTile> tile = parse_tile_text(text);
    if (!tile.has_value() || !kernels::validate_gate_tile(*tile).empty()) return false;
    p.gate_tile = tile;
    return true;
  };
  c.why_not = [](absl::string_view text) -> std::string {
    const std::optional<kernels::GateTile> tile = parse_tile_text(text);
    if (!tile.has_value()) {
      return absl::StrCat(
          "expected auto or a tile BLOCK_TxBLOCK_HxTHREADS of positive integers (e.g. "
          "128x16x256), but got '",
          text, "'");
    }
    return absl::StrCat("tile ", text, " cannot be launched: ", kernels::validate_gate_tile(*tile));
  };
  return c;
}

const std::vector<Choice>& choices() {
  using P = ExecutionPolicy;
  static const std::vector<Choice> all = {
      bool_choice("deterministic", "model.deterministic_mode", "GDR_DETERMINISTIC",
                  &P::deterministic, false,
                  "ordered, bit-reproducible paths in every op (PyTorch's deterministic "
                  "algorithms on)"),
      bool_choice("deterministic_fill_uninitialized_memory",
                  "kernels.deterministic_fill_uninitialized_memory",
                  "GDR_DETERMINISTIC_FILL_UNINITIALIZED_MEMORY",
                  &P::deterministic_fill_uninitialized_memory, false,
                  "PyTorch's NaN fill of new tensors under deterministic algorithms "
                  "(debugging)"),
      enum_choice("pre_gdr_fusion", "model.pre_gdr_fusion", "", {"none", "gate", "full"},
                  &P::pre_gdr_fusion, "how the Gated DeltaNet layers run the pre-GDR gate"),
      gate_tile_choice(),
      enum_choice("pre_gdr_gate_ordered", "kernels.pre_gdr_gate_ordered",
                  "GDR_PRE_GDR_GATE_ORDERED", {"auto", "single_pass", "two_pass"}, &P::gate_ordered,
                  "the gate backward's ordered reduction: one launch, two launches, or by "
                  "shape (same bits)"),
      enum_choice("gdr_core_impl", "kernels.gdr_core_impl", "GDR_CORE_IMPL",
                  {"kernel", "composite"}, &P::gdr_core_impl,
                  "the GDR core's state pass on CUDA: chunk-scan kernels or the ATen loop"),
      enum_choice("gdr_core_prep", "kernels.gdr_core_prep", "GDR_CORE_PREP", {"kernel", "aten"},
                  &P::gdr_core_prep, "the GDR core's chunk preparation on CUDA: kernels or ATen"),
      bool_choice("chunk_scan_tensor_cores", "kernels.chunk_scan_tensor_cores", "GDR_CHUNK_SCAN_TC",
                  &P::chunk_scan_tensor_cores, true,
                  "the chunk scan on tensor cores (3xTF32); false: the FP32 SIMT scan"),
      bool_choice("chunk_prep_tensor_cores", "kernels.chunk_prep_tensor_cores", "GDR_CHUNK_PREP_TC",
                  &P::chunk_prep_tensor_cores, true,
                  "the chunk prep backward's dM and dK / dQ products on tensor cores (3xTF32)"),
      bool_choice("chunk_gemm_tensor_cores", "kernels.chunk_gemm_tensor_cores", "GDR_CHUNK_GEMM_TC",
                  &P::chunk_gemm_tensor_cores, true,
                  "the state pass's GEMMs on the 3xTF32 kernel; false: cuBLAS FP32"),
      bool_choice("chunk_gemm_wgmma", "kernels.chunk_gemm_wgmma", "GDR_CHUNK_GEMM_WGMMA",
                  &P::chunk_gemm_wgmma, true,
                  "that GEMM on wgmma on sm_90a (H100 / H200); false: mma.sync"),
      bool_choice("chunk_gemm_overlap", "kernels.chunk_gemm_overlap", "GDR_CHUNK_GEMM_OVERLAP",
                  &P::chunk_gemm_overlap, true,
                  "the backward's dQd and dP GEMMs on a side stream beside the scan (same bits)"),
      bool_choice("gdr_core_v_fp32", "kernels.gdr_core_v_fp32", "GDR_CORE_V_FP32",
                  &P::gdr_core_v_fp32, false, "hand the GDR core an FP32 copy of v"),
      enum_choice("attention", "kernels.attention", "GDR_ATTENTION", {"cudnn", "aten"},
                  &P::attention, "full attention on CUDA: cuDNN flash attention or ATen's SDPA"),
      enum_choice("rms_norm", "kernels.rms_norm", "GDR_RMS_NORM", {"fused", "composite"},
                  &P::rms_norm, "the zero-centred and gated RMSNorms on CUDA"),
      enum_choice("rms_norm_kernel", "kernels.rms_norm_kernel", "GDR_RMS_NORM_KERNEL",
                  {"resident", "streaming"}, &P::rms_norm_kernel,
                  "the fused norm's kernels: rows in registers where they fit, or streaming"),
      enum_choice("add_rms_norm", "kernels.add_rms_norm", "GDR_ADD_RMS_NORM",
                  {"fused", "composite"}, &P::add_rms_norm,
                  "the residual adds inside the next norm kernel, or separate (same bits)"),
      enum_choice("causal_conv", "kernels.causal_conv", "GDR_CAUSAL_CONV", {"kernel", "aten"},
                  &P::causal_conv, "the GDN causal conv1d + SiLU on CUDA"),
      enum_choice("gated_activation", "kernels.gated_activation", "GDR_GATED_ACTIVATION",
                  {"fused", "composite"}, &P::gated_activation,
                  "silu(gate) * x and x * sigmoid(gate) on CUDA"),
      enum_choice("rope", "kernels.rope", "GDR_ROPE", {"fused", "composite"}, &P::rope,
                  "partial RoPE on CUDA"),
      enum_choice("cross_entropy", "kernels.cross_entropy", "GDR_CROSS_ENTROPY",
                  {"fused", "composite"}, &P::cross_entropy,
                  "the causal-LM loss on CUDA (BF16 logits read in place)"),
      enum_choice("tied_embedding", "kernels.tied_embedding", "GDR_TIED_EMBEDDING",
                  {"fused", "composite"}, &P::tied_embedding,
                  "the tied embedding's one-gradient lookup + LM head"),
      enum_choice("linear_group", "kernels.linear_group", "GDR_LINEAR_GROUP",
                  {"fused", "composite"}, &P::linear_group,
                  "projections of one input as one op (input gradient summed in the GEMMs)"),
      bool_choice("cuda_graphs", "train.cuda_graphs", "", &P::cuda_graphs, true,
                  "the trainer replays microbatches from CUDA graphs (CUDA only; same bits)"),
      enum_choice("recompute", "train.recompute", "GDR_RECOMPUTE", {"none", "attention", "full"},
                  &P::recompute,
                  "activations recomputed in the backward: none, each layer's token mixer, or "
                  "whole layers (same bits)"),
  };
  return all;
}

const Choice* find_choice(absl::string_view key) {
  for (const Choice& c : choices()) {
    if (c.key.key == key) return &c;
  }
  return nullptr;
}

// "expected fused or composite, but got 'x'" (booleans also name 1 and 0).
std::string refusal(const Choice& c, absl::string_view text) {
  if (c.why_not) return c.why_not(text);
  std::vector<std::string> v = c.key.values;
  if (v == std::vector<std::string>{"true", "false"}) v = {"true", "false", "1", "0"};
  const std::string expected =
      v.size() == 2 ? absl::StrCat(v[0], " or ", v[1])
                    : absl::StrCat(absl::StrJoin(v.begin(), v.end() - 1, ", "), " or ", v.back());
  return absl::StrCat("expected ", expected, ", but got '", text, "'");
}

// Non-policy GDR_* variables that parts of gdr read (set-up and scripts, the distributed
// launcher): not typos.
const std::set<std::string>& other_gdr_variables() {
  static const std::set<std::string> names = {"GDR_CACHE", "GDR_LIBTORCH", "GDR_CUDNN_FRONTEND",
                                              "GDR_TORCH_LIB", "GDR_DIST_TIMEOUT_S"};
  return names;
}

// The interned policies; index 0 is the defaults. A deque, so references stay valid.
struct PolicyTable {
  std::mutex mutex;
  std::deque<ExecutionPolicy> policies{ExecutionPolicy{}};
};
PolicyTable& policy_table() {
  static PolicyTable* table = new PolicyTable();  // never destroyed: threads may outlive main
  return *table;
}

const ExecutionPolicy& interned(int64_t id) {
  PolicyTable& table = policy_table();
  std::lock_guard<std::mutex> lock(table.mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(table.policies.size()),
              "ExecutionPolicyGuard: no execution policy was interned under id ", id,
              " (expected an id from intern_execution_policy, below ", table.policies.size(), ")");
  return table.policies[static_cast<size_t>(id)];
}

// The id of this thread's current policy (0: no guard, the defaults) and its object.
thread_local int64_t t_current_id = 0;
thread_local const ExecutionPolicy* t_current = nullptr;

}  // namespace

bool operator==(const ExecutionPolicy& a, const ExecutionPolicy& b) {
  for (const Choice& c : choices()) {
    if (c.show(a) != c.show(b)) return false;
  }
  return true;
}

const std::vector<ExecutionPolicyKey>& execution_policy_keys() {
  static const std::vector<ExecutionPolicyKey> keys = [] {
    static const std::set<std::string> same_bits = {"deterministic_fill_uninitialized_memory",
                                                    "pre_gdr_gate_ordered",
                                                    "chunk_gemm_overlap",
                                                    "rms_norm_kernel",
                                                    "add_rms_norm",
                                                    "gated_activation",
                                                    "rope",
                                                    "cuda_graphs",
                                                    "recompute"};
    std::vector<ExecutionPolicyKey> k;
    for (const Choice& c : choices()) {
      k.push_back(c.key);
      k.back().same_bits = same_bits.count(c.key.key) > 0;
    }
    return k;
  }();
  return keys;
}

absl::Status set_execution_policy_value(ExecutionPolicy& policy, absl::string_view key,
                                        absl::string_view text, absl::string_view source) {
  const Choice* c = find_choice(key);
  if (c == nullptr) return absl::InvalidArgumentError(absl::StrCat(source, ": unknown key"));
  if (!c->parse(policy, text)) {
    return absl::InvalidArgumentError(absl::StrCat(source, ": ", refusal(*c, text)));
  }
  return absl::OkStatus();
}

std::string execution_policy_value(const ExecutionPolicy& policy, absl::string_view key) {
  const Choice* c = find_choice(key);
  TORCH_CHECK(c != nullptr, "execution_policy_value: unknown key '", std::string(key), "'");
  return c->show(policy);
}

absl::Status apply_environment_overrides(ExecutionPolicy& policy, EnvironmentReader get,
                                         std::vector<std::string>* overridden) {
  if (!get) get = [](const char* name) -> const char* { return std::getenv(name); };
  for (const Choice& c : choices()) {
    if (c.key.variable.empty()) continue;
    const char* value = get(c.key.variable.c_str());
    if (value == nullptr || value[0] == '\0') continue;
    if (absl::Status s = set_execution_policy_value(policy, c.key.key, value, c.key.variable);
        !s.ok()) {
      return s;
    }
    if (overridden != nullptr) overridden->push_back(c.key.key);
  }
  return absl::OkStatus();
}

absl::Status validate_execution_policy(const ExecutionPolicy& policy) {
  if (policy.deterministic && policy.pre_gdr_fusion == PreGdrFusion::kFull) {
    return absl::FailedPreconditionError(
        "deterministic_mode: true cannot be combined with pre_gdr_fusion: full (the fully fused "
        "pre-GDR path has no ordered, bit-reproducible backward); use pre_gdr_fusion: gate or "
        "none");
  }
  return absl::OkStatus();
}

std::string describe_execution_policy(const ExecutionPolicy& policy) {
  std::string text;
  for (const Choice& c : choices()) {
    absl::StrAppend(&text, text.empty() ? "" : " ", c.key.key, "=", c.show(policy));
  }
  return text;
}

std::vector<std::string> execution_policy_differences(absl::string_view a, absl::string_view b) {
  auto parse = [](absl::string_view text) {
    std::map<std::string, std::string> values;
    for (absl::string_view item : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
      const std::pair<std::string, std::string> kv = absl::StrSplit(item, absl::MaxSplits('=', 1));
      values[kv.first] = kv.second;
    }
    return values;
  };
  const std::map<std::string, std::string> left = parse(a), right = parse(b);
  std::vector<std::string> keys;
  for (const auto& [key, value] : left) {
    auto it = right.find(key);
    if (it == right.end() || it->second != value) keys.push_back(key);
  }
  for (const auto& [key, value] : right) {
    if (left.count(key) == 0) keys.push_back(key);
  }
  return keys;
}

std::optional<bool> deterministic_mode_from_environment() {
  static constexpr char kVariable[] = "GDR_DETERMINISTIC";
  const char* raw = std::getenv(kVariable);
  if (raw == nullptr || raw[0] == '\0') return std::nullopt;
  const std::string value(raw);
  if (value == "1" || value == "true" || value == "TRUE" || value == "on" || value == "yes") {
    return true;
  }
  if (value == "0" || value == "false" || value == "FALSE" || value == "off" || value == "no") {
    return false;
  }
  TORCH_CHECK(false, "environment variable ", kVariable,
              " must be a boolean (1/true/on/yes or 0/false/off/no), but got '", value, "'");
}

std::vector<std::string> unknown_gdr_environment_variables() {
  std::set<std::string> known = other_gdr_variables();
  for (const Choice& c : choices()) {
    if (!c.key.variable.empty()) known.insert(c.key.variable);
  }
  std::vector<std::string> unknown;
  for (char** entry = environ; entry != nullptr && *entry != nullptr; ++entry) {
    const absl::string_view text(*entry);
    if (!absl::StartsWith(text, "GDR_")) continue;
    const std::string name(text.substr(0, text.find('=')));
    if (known.count(name) == 0) unknown.push_back(name);
  }
  return unknown;
}

const ExecutionPolicy& current_execution_policy() {
  if (t_current != nullptr) return *t_current;
  static const ExecutionPolicy* const defaults = &interned(0);
  return *defaults;
}

int64_t current_execution_policy_id() { return t_current_id; }

int64_t intern_execution_policy(const ExecutionPolicy& policy) {
  PolicyTable& table = policy_table();
  std::lock_guard<std::mutex> lock(table.mutex);
  for (size_t i = 0; i < table.policies.size(); ++i) {
    if (table.policies[i] == policy) return static_cast<int64_t>(i);
  }
  table.policies.push_back(policy);
  return static_cast<int64_t>(table.policies.size() - 1);
}

ExecutionPolicyGuard::ExecutionPolicyGuard(const ExecutionPolicy& policy)
    : ExecutionPolicyGuard(intern_execution_policy(policy)) {}

ExecutionPolicyGuard::ExecutionPolicyGuard(int64_t id) : previous_(t_current_id) {
  t_current = &interned(id);
  t_current_id = id;
}

ExecutionPolicyGuard::~ExecutionPolicyGuard() {
  t_current_id = previous_;
  t_current = &interned(previous_);
}

}  // namespace gdr
