// RunConfig loading: a strict, table-driven reader for the trainer's sections; the `model:`
// section is handed to the model's own loader (models/qwen/config.h) so its keys, defaults
// and messages live in one place.
#include "gdr/run_config.h"
#include "io/yaml_file.h"

#include <yaml-cpp/yaml.h>

#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace gdr {
namespace {

constexpr const char* kSections[] = {"model", "data", "optimizer", "schedule", "train", "kernels"};

absl::Status key_error(const std::string& file, absl::string_view key, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", key, ": ", problem));
}

using io::describe_yaml_node;
using io::is_plain_yaml_scalar;

template <typename T>
absl::Status read_plain(const YAML::Node& node, const std::string& key, const std::string& file,
                        absl::string_view expected, T* out) {
  const auto problem = io::read_plain_yaml_scalar(node, std::string(expected), out);
  return problem.has_value() ? key_error(file, key, *problem) : absl::OkStatus();
}

using Setter = std::function<absl::Status(const YAML::Node&, const std::string& key,
                                          const std::string& file, RunConfig&)>;
// `show` renders the parsed value canonically, for comparing two configs.
using Shower = std::function<std::string(RunConfig&)>;
struct Field {
  std::string section;
  std::string name;
  Setter set;
  Shower show;
};

std::string exact(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

Field int_field(const char* section, const char* name, int64_t& (*get)(RunConfig&)) {
  return {section, name,
          [get](const YAML::Node& n, const std::string& k, const std::string& f, RunConfig& c) {
            return read_plain(n, k, f, "an integer", &get(c));
          },
          [get](RunConfig& c) { return absl::StrCat(get(c)); }};
}

Field double_field(const char* section, const char* name, double& (*get)(RunConfig&)) {
  return {section, name,
          [get](const YAML::Node& n, const std::string& k, const std::string& f, RunConfig& c) {
            return read_plain(n, k, f, "a number", &get(c));
          },
          [get](RunConfig& c) { return exact(get(c)); }};
}

Field string_field(const char* section, const char* name, std::string& (*get)(RunConfig&)) {
  return {section, name,
          [get](const YAML::Node& n, const std::string& k, const std::string& f, RunConfig& c) {
            if (!n.IsDefined() || !n.IsScalar()) {
              return key_error(f, k,
                               absl::StrCat("expected a string but got ", describe_yaml_node(n)));
            }
            get(c) = n.Scalar();
            return absl::OkStatus();
          },
          [get](RunConfig& c) { return get(c); }};
}

// A string that must be one of `names`; `apply` receives the index of the match, `index`
// gives it back.
Field choice_field(const char* section, const char* name, std::vector<std::string> names,
                   std::function<void(RunConfig&, size_t)> apply,
                   std::function<size_t(const RunConfig&)> index) {
  return {section, name,
          [names, apply](const YAML::Node& n, const std::string& k, const std::string& f,
                         RunConfig& c) {
            const std::string expected = absl::StrCat("one of ", absl::StrJoin(names, ", "));
            if (!n.IsDefined() || !n.IsScalar()) {
              return key_error(
                  f, k, absl::StrCat("expected ", expected, " but got ", describe_yaml_node(n)));
            }
            for (size_t i = 0; i < names.size(); ++i) {
              if (n.Scalar() == names[i]) {
                apply(c, i);
                return absl::OkStatus();
              }
            }
            return key_error(
                f, k, absl::StrCat("expected ", expected, " but got ", describe_yaml_node(n)));
          },
          [names, index](RunConfig& c) { return names[index(c)]; }};
}

// A choice of the execution policy's `kernels:` section, parsed and shown by the policy.
Field kernel_field(const std::string& key) {
  return {"kernels", key,
          [key](const YAML::Node& n, const std::string& k, const std::string& f, RunConfig& c) {
            if (!is_plain_yaml_scalar(n)) {
              return key_error(f, k,
                               absl::StrCat("expected a scalar but got ", describe_yaml_node(n)));
            }
            return set_execution_policy_value(c.kernels, key, n.Scalar(), absl::StrCat(f, ": ", k));
          },
          [key](RunConfig& c) { return execution_policy_value(c.kernels, key); }};
}

const std::vector<Field>& run_fields() {
  static const std::vector<Field>* const fields = [] {
    auto* all = new std::vector<Field>{
        choice_field(
            "data", "source", {"embedded", "indexed"},
            [](RunConfig& c, size_t i) {
              c.data.source = i == 0 ? DataSource::kEmbedded : DataSource::kIndexed;
            },
            [](const RunConfig& c) -> size_t { return c.data.source == DataSource::kIndexed; }),
        string_field("data", "path", [](RunConfig& c) -> std::string& { return c.data.path; }),
        string_field("data", "prefix", [](RunConfig& c) -> std::string& { return c.data.prefix; }),
        int_field("data", "seq_len", [](RunConfig& c) -> int64_t& { return c.data.seq_len; }),
        int_field("data", "micro_batch_size",
                  [](RunConfig& c) -> int64_t& { return c.data.micro_batch_size; }),
        double_field("data", "valid_fraction",
                     [](RunConfig& c) -> double& { return c.data.valid_fraction; }),
        string_field("data", "valid_path",
                     [](RunConfig& c) -> std::string& { return c.data.valid_path; }),
        string_field("data", "valid_prefix",
                     [](RunConfig& c) -> std::string& { return c.data.valid_prefix; }),
        choice_field(
            "data", "document_masking", {"false", "true"},
            [](RunConfig& c, size_t i) { c.data.document_masking = i == 1; },
            [](const RunConfig& c) -> size_t { return c.data.document_masking ? 1 : 0; }),
        choice_field(
            "optimizer", "impl", {"fused", "loop"},
            [](RunConfig& c, size_t i) {
              c.optimizer.impl = i == 0 ? OptimizerImpl::kFused : OptimizerImpl::kLoop;
            },
            [](const RunConfig& c) -> size_t { return c.optimizer.impl == OptimizerImpl::kLoop; }),
        double_field("optimizer", "lr", [](RunConfig& c) -> double& { return c.optimizer.lr; }),
        {"optimizer", "betas",
         [](const YAML::Node& n, const std::string& k, const std::string& f, RunConfig& c) {
           if (!n.IsSequence() || n.size() != 2) {
             return key_error(
                 f, k,
                 absl::StrCat("expected a list of two numbers but got ", describe_yaml_node(n)));
           }
           if (absl::Status s = read_plain(n[0], k + "[0]", f, "a number", &c.optimizer.beta1);
               !s.ok()) {
             return s;
           }
           return read_plain(n[1], k + "[1]", f, "a number", &c.optimizer.beta2);
         },
         [](RunConfig& c) {
           return absl::StrCat("[", exact(c.optimizer.beta1), ", ", exact(c.optimizer.beta2), "]");
         }},
        double_field("optimizer", "eps", [](RunConfig& c) -> double& { return c.optimizer.eps; }),
        double_field("optimizer", "weight_decay",
                     [](RunConfig& c) -> double& { return c.optimizer.weight_decay; }),
        double_field("optimizer", "grad_clip",
                     [](RunConfig& c) -> double& { return c.optimizer.grad_clip; }),
        int_field("schedule", "warmup_steps",
                  [](RunConfig& c) -> int64_t& { return c.schedule.warmup_steps; }),
        int_field("schedule", "total_steps",
                  [](RunConfig& c) -> int64_t& { return c.schedule.total_steps; }),
        double_field("schedule", "min_lr_ratio",
                     [](RunConfig& c) -> double& { return c.schedule.min_lr_ratio; }),
        int_field("train", "steps", [](RunConfig& c) -> int64_t& { return c.train.steps; }),
        int_field("train", "grad_accum",
                  [](RunConfig& c) -> int64_t& { return c.train.grad_accum; }),
        int_field("train", "seed", [](RunConfig& c) -> int64_t& { return c.train.seed; }),
        choice_field(
            "train", "dtype", {"fp32", "bf16"},
            [](RunConfig& c, size_t i) {
              c.train.dtype = i == 0 ? TrainDtype::kFloat32 : TrainDtype::kBFloat16;
            },
            [](const RunConfig& c) -> size_t { return c.train.dtype == TrainDtype::kBFloat16; }),
        choice_field(
            "train", "device", {"cpu", "cuda"},
            [](RunConfig& c, size_t i) {
              c.train.device = i == 0 ? TrainDevice::kCpu : TrainDevice::kCuda;
            },
            [](const RunConfig& c) -> size_t { return c.train.device == TrainDevice::kCuda; }),
        int_field("train", "log_every", [](RunConfig& c) -> int64_t& { return c.train.log_every; }),
        string_field("train", "metrics_path",
                     [](RunConfig& c) -> std::string& { return c.train.metrics_path; }),
        string_field("train", "checkpoint_dir",
                     [](RunConfig& c) -> std::string& { return c.train.checkpoint_dir; }),
        int_field("train", "checkpoint_every",
                  [](RunConfig& c) -> int64_t& { return c.train.checkpoint_every; }),
        string_field("train", "init_from",
                     [](RunConfig& c) -> std::string& { return c.train.init_from; }),
        string_field("train", "snapshot_dir",
                     [](RunConfig& c) -> std::string& { return c.train.snapshot_dir; }),
        choice_field(
            "train", "on_nonfinite", {"stop", "skip"},
            [](RunConfig& c, size_t i) {
              c.train.on_nonfinite = i == 0 ? OnNonfinite::kStop : OnNonfinite::kSkip;
            },
            [](const RunConfig& c) -> size_t {
              return c.train.on_nonfinite == OnNonfinite::kSkip;
            }),
        int_field("train", "num_threads",
                  [](RunConfig& c) -> int64_t& { return c.train.num_threads; }),
        int_field("train", "eval_every",
                  [](RunConfig& c) -> int64_t& { return c.train.eval_every; }),
        int_field("train", "eval_batches",
                  [](RunConfig& c) -> int64_t& { return c.train.eval_batches; }),
        choice_field(
            "train", "overlap_grad_reduction", {"false", "true"},
            [](RunConfig& c, size_t i) { c.train.overlap_grad_reduction = i == 1; },
            [](const RunConfig& c) -> size_t { return c.train.overlap_grad_reduction ? 1 : 0; }),
        choice_field(
            "train", "shard_optimizer_state", {"false", "true"},
            [](RunConfig& c, size_t i) { c.train.shard_optimizer_state = i == 1; },
            [](const RunConfig& c) -> size_t { return c.train.shard_optimizer_state ? 1 : 0; }),
        choice_field(
            "train", "cuda_graphs", {"false", "true"},
            [](RunConfig& c, size_t i) { c.train.cuda_graphs = i == 1; },
            [](const RunConfig& c) -> size_t { return c.train.cuda_graphs ? 1 : 0; }),
        choice_field(
            "train", "recompute", {"none", "attention", "full"},
            [](RunConfig& c, size_t i) { c.train.recompute = static_cast<Recompute>(i); },
            [](const RunConfig& c) -> size_t { return static_cast<size_t>(c.train.recompute); }),
    };
    for (const ExecutionPolicyKey& key : execution_policy_keys()) {
      if (absl::StartsWith(key.config_key, "kernels.")) all->push_back(kernel_field(key.key));
    }
    return all;
  }();
  return *fields;
}

const Field* find_field(absl::string_view section, absl::string_view name) {
  for (const Field& f : run_fields()) {
    if (f.section == section && f.name == name) return &f;
  }
  return nullptr;
}

bool is_section(absl::string_view name) {
  for (const char* s : kSections) {
    if (name == s) return true;
  }
  return false;
}

// The validation set: at most one source, of the training data's kind, and one when
// evaluation is asked for.
absl::Status validate_validation_set(const RunConfig& c, const std::string& file) {
  const DataConfig& d = c.data;
  if (!(d.valid_fraction >= 0 && d.valid_fraction <= 0.5)) {
    return key_error(file, "data.valid_fraction",
                     absl::StrCat("expected a number in [0, 0.5] but got ", d.valid_fraction));
  }
  const int sources = (d.valid_fraction > 0 ? 1 : 0) + (d.valid_path.empty() ? 0 : 1) +
                      (d.valid_prefix.empty() ? 0 : 1);
  if (sources > 1) {
    return key_error(file, "data.valid_fraction",
                     "set one of data.valid_fraction, data.valid_path and data.valid_prefix");
  }
  if (!d.valid_path.empty() && d.source != DataSource::kEmbedded) {
    return key_error(
        file, "data.valid_path",
        "a text file for data.source embedded; with indexed data use data.valid_prefix");
  }
  if (!d.valid_prefix.empty() && d.source != DataSource::kIndexed) {
    return key_error(file, "data.valid_prefix",
                     "an indexed dataset for data.source indexed; with embedded data use "
                     "data.valid_path");
  }
  if (c.train.eval_every > 0 && sources == 0) {
    return key_error(file, "train.eval_every",
                     "evaluation needs a validation set: set data.valid_fraction, data.valid_path "
                     "or data.valid_prefix");
  }
  return absl::OkStatus();
}

// Range checks that the types alone do not give.
absl::Status validate(const RunConfig& c, const std::string& file) {
  auto positive = [&](int64_t v, const char* key) {
    return v >= 1 ? absl::OkStatus()
                  : key_error(file, key, absl::StrCat("expected an integer >= 1 but got ", v));
  };
  auto non_negative = [&](int64_t v, const char* key) {
    return v >= 0 ? absl::OkStatus()
                  : key_error(file, key, absl::StrCat("expected an integer >= 0 but got ", v));
  };
  const absl::Status checks[] = {
      positive(c.data.seq_len, "data.seq_len"),
      positive(c.data.micro_batch_size, "data.micro_batch_size"),
      positive(c.train.steps, "train.steps"),
      positive(c.train.grad_accum, "train.grad_accum"),
      positive(c.train.log_every, "train.log_every"),
      non_negative(c.train.checkpoint_every, "train.checkpoint_every"),
      non_negative(c.train.num_threads, "train.num_threads"),
      non_negative(c.schedule.warmup_steps, "schedule.warmup_steps"),
      non_negative(c.schedule.total_steps, "schedule.total_steps"),
      non_negative(c.train.eval_every, "train.eval_every"),
      positive(c.train.eval_batches, "train.eval_batches"),
  };
  for (const absl::Status& s : checks) {
    if (!s.ok()) return s;
  }
  if (!(c.optimizer.lr > 0) || !std::isfinite(c.optimizer.lr)) {
    return key_error(file, "optimizer.lr",
                     absl::StrCat("expected a number > 0 but got ", c.optimizer.lr));
  }
  for (const auto& [v, key] : {std::pair{c.optimizer.beta1, "optimizer.betas[0]"},
                               std::pair{c.optimizer.beta2, "optimizer.betas[1]"}}) {
    if (!(v >= 0 && v < 1)) {
      return key_error(file, key, absl::StrCat("expected a number in [0, 1) but got ", v));
    }
  }
  if (!(c.optimizer.eps > 0)) {
    return key_error(file, "optimizer.eps",
                     absl::StrCat("expected a number > 0 but got ", c.optimizer.eps));
  }
  if (!(c.optimizer.weight_decay >= 0)) {
    return key_error(file, "optimizer.weight_decay",
                     absl::StrCat("expected a number >= 0 but got ", c.optimizer.weight_decay));
  }
  if (!(c.schedule.min_lr_ratio >= 0 && c.schedule.min_lr_ratio <= 1)) {
    return key_error(file, "schedule.min_lr_ratio",
                     absl::StrCat("expected a number in [0, 1] but got ", c.schedule.min_lr_ratio));
  }
  if (c.data.source == DataSource::kIndexed && c.data.prefix.empty()) {
    return key_error(file, "data.prefix", "required when data.source is indexed");
  }
  if (c.data.source == DataSource::kEmbedded && c.data.path.empty()) {
    return key_error(file, "data.path", "required when data.source is embedded");
  }
  return validate_validation_set(c, file);
}

// Runs the model loader on `root` when overrides changed the model section: it reads files
// only, so the merged YAML goes through a private temporary file whose name is mapped back
// to `path` in messages.
template <typename T>
absl::StatusOr<T> load_via_temp_file(
    const std::string& text, const std::string& shown_as,
    const std::function<absl::StatusOr<T>(const std::string&)>& load) {
  char tmp[] = "/tmp/gdr_run_config_XXXXXX";
  const int fd = mkstemp(tmp);
  if (fd < 0) return absl::InternalError("cannot create a temporary config file in /tmp");
  const bool written = write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  close(fd);
  absl::StatusOr<T> loaded =
      written ? load(tmp) : absl::InternalError("cannot write a temporary config file in /tmp");
  unlink(tmp);
  if (!loaded.ok()) {
    return absl::Status(loaded.status().code(),
                        absl::StrReplaceAll(loaded.status().message(), {{tmp, shown_as}}));
  }
  return loaded;
}

absl::StatusOr<QwenConfig> load_model_section(const std::string& path, const YAML::Node& root,
                                              bool model_overridden) {
  if (!model_overridden) return load_qwen_config_yaml(path);
  return load_via_temp_file<QwenConfig>(YAML::Dump(root), path, load_qwen_config_yaml);
}

// Keys a resumed run may change without changing what its steps compute.
bool may_change_on_resume(absl::string_view dotted) {
  static constexpr absl::string_view kFree[] = {
      "train.steps",
      "train.log_every",
      "train.metrics_path",
      "train.checkpoint_dir",
      "train.checkpoint_every",
      "train.snapshot_dir",
      "train.on_nonfinite",
      "train.overlap_grad_reduction",
      "train.shard_optimizer_state",  // checkpoints hold the full state either way
      "train.cuda_graphs",
      "train.eval_every",
      "train.eval_batches",
      "train.init_from",        // the checkpoint's weights replace it
      "schedule.total_steps"};  // compared by its effective value
  for (absl::string_view k : kFree) {
    if (k == dotted) return true;
  }
  // Kernel choices that compute the same bits whatever their value.
  for (const ExecutionPolicyKey& key : execution_policy_keys()) {
    if (key.same_bits && key.config_key == dotted) return true;
  }
  return false;
}

}  // namespace

absl::string_view train_dtype_name(TrainDtype dtype) {
  return dtype == TrainDtype::kFloat32 ? "fp32" : "bf16";
}

absl::StatusOr<ConfigOverride> parse_config_override(const std::string& text) {
  const size_t eq = text.find('=');
  const size_t dot = text.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot == 0 || dot + 1 >= eq) {
    return absl::InvalidArgumentError(
        absl::StrCat("--set ", text, ": expected section.key=value, e.g. --set=train.steps=5"));
  }
  return ConfigOverride{text.substr(0, eq), text.substr(eq + 1)};
}

absl::StatusOr<RunConfig> load_run_config(const std::string& path,
                                          const std::vector<ConfigOverride>& overrides) {
  absl::StatusOr<YAML::Node> loaded = io::load_yaml_file(path);
  if (!loaded.ok()) return loaded.status();
  YAML::Node root = *loaded;
  if (!root.IsMap()) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": expected a mapping of sections but got ", describe_yaml_node(root)));
  }
  bool model_overridden = false;
  for (const ConfigOverride& o : overrides) {
    const std::vector<std::string> parts = absl::StrSplit(o.path, '.');
    const std::string where = absl::StrCat("--set ", o.path, "=", o.value);
    if (parts.size() != 2 || !is_section(parts[0]) ||
        (parts[0] != "model" && find_field(parts[0], parts[1]) == nullptr)) {
      return key_error(where, o.path, "unknown key");
    }
    YAML::Node value;
    try {
      value = YAML::Load(o.value);
    } catch (const YAML::ParserException& e) {
      return key_error(where, o.path, absl::StrCat("parse error: ", e.msg));
    }
    root[parts[0]][parts[1]] = value;
    model_overridden = model_overridden || parts[0] == "model";
  }

  RunConfig config;
  config.source = path;
  config.config_text = YAML::Dump(root);
  if (!root["model"]) return key_error(path, "model", "required section is missing");
  for (const auto& section : root) {
    const std::optional<std::string> name_text = io::yaml_key_text(section.first);
    if (!name_text.has_value()) {
      return key_error(path, "<section>",
                       absl::StrCat("expected a plain section name but got ",
                                    describe_yaml_node(section.first)));
    }
    const std::string& name = *name_text;
    if (!is_section(name)) return key_error(path, name, "unknown section");
    if (name == "model") continue;
    if (!section.second.IsMap()) {
      return key_error(
          path, name,
          absl::StrCat("expected a mapping but got ", describe_yaml_node(section.second)));
    }
    for (const auto& item : section.second) {
      const std::optional<std::string> key_text = io::yaml_key_text(item.first);
      if (!key_text.has_value()) {
        return key_error(
            path, absl::StrCat(name, ".<key>"),
            absl::StrCat("expected a plain key but got ", describe_yaml_node(item.first)));
      }
      const std::string& key = *key_text;
      const std::string dotted = absl::StrCat(name, ".", key);
      const Field* field = find_field(name, key);
      if (field == nullptr) return key_error(path, dotted, "unknown key");
      if (absl::Status s = field->set(item.second, dotted, path, config); !s.ok()) return s;
    }
  }
  if (absl::Status s = validate(config, path); !s.ok()) return s;
  absl::StatusOr<QwenConfig> model = load_model_section(path, root, model_overridden);
  if (!model.ok()) return model.status();
  config.model = *model;
  // Note [Document starts] (gdr/data.h): the byte corpus has no document index.
  if (config.data.document_masking && config.data.source == DataSource::kEmbedded &&
      config.model.eos_token_ids.empty()) {
    return key_error(path, "data.document_masking",
                     "true with data.source embedded needs model.eos_token_id (the token that "
                     "ends a document, e.g. 10 for a newline in the byte corpus); the embedded "
                     "corpus has no document index");
  }
  // The rules between choices (Note [Execution policy]), as the file sets them; the
  // environment is applied and checked again at start-up (execution_policy_for_run).
  if (absl::Status s = validate_execution_policy(file_execution_policy(config)); !s.ok()) {
    return absl::Status(s.code(), absl::StrCat(path, ": ", s.message()));
  }
  return config;
}

ExecutionPolicy file_execution_policy(const RunConfig& config) {
  ExecutionPolicy policy = config.kernels;
  policy.deterministic = config.model.deterministic_mode;
  policy.pre_gdr_fusion = config.model.pre_gdr_fusion;
  policy.cuda_graphs = config.train.cuda_graphs;
  policy.recompute = config.train.recompute;
  return policy;
}

absl::StatusOr<ExecutionPolicy> execution_policy_for_run(
    const RunConfig& config, EnvironmentReader get, std::vector<std::string>* from_environment) {
  ExecutionPolicy policy = file_execution_policy(config);
  if (absl::Status s = apply_environment_overrides(policy, std::move(get), from_environment);
      !s.ok()) {
    return s;
  }
  if (absl::Status s = validate_execution_policy(policy); !s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat(config.source, " with the environment: ", s.message()));
  }
  return policy;
}

}  // namespace gdr

namespace gdr {

absl::StatusOr<RunConfig> load_run_config_text(const std::string& text,
                                               const std::string& shown_as) {
  const std::function<absl::StatusOr<RunConfig>(const std::string&)> load =
      [](const std::string& path) { return load_run_config(path); };
  absl::StatusOr<RunConfig> config = load_via_temp_file<RunConfig>(text, shown_as, load);
  if (config.ok()) config->source = shown_as;
  return config;
}

absl::StatusOr<std::vector<std::string>> resume_config_differences(
    const std::string& saved_config_text, const std::string& saved_source,
    const RunConfig& current) {
  absl::StatusOr<RunConfig> saved = load_run_config_text(saved_config_text, saved_source);
  if (!saved.ok()) return saved.status();
  std::vector<std::string> differing;
  // The model section, key by key as written (both texts come from load_run_config).
  YAML::Node saved_model, current_model;
  try {
    saved_model = YAML::Load(saved_config_text)["model"];
    current_model = YAML::Load(current.config_text)["model"];
  } catch (const YAML::Exception& e) {
    return absl::InvalidArgumentError(absl::StrCat(saved_source, ": ", e.what()));
  }
  std::set<std::string> model_keys;
  for (const YAML::Node* model : {&saved_model, &current_model}) {
    for (const auto& item : *model) {
      // Both texts passed load_run_config, whose model loader refuses keys that are not
      // plain; one that still is not counts as a difference.
      model_keys.insert(io::yaml_key_text(item.first).value_or("<key>"));
    }
  }
  for (const std::string& key : model_keys) {
    const YAML::Node a = saved_model[key], b = current_model[key];
    if (!a || !b || YAML::Dump(a) != YAML::Dump(b)) differing.push_back("model." + key);
  }
  RunConfig mutable_current = current;
  for (const Field& f : run_fields()) {
    const std::string dotted = absl::StrCat(f.section, ".", f.name);
    if (may_change_on_resume(dotted)) continue;
    if (f.show(*saved) != f.show(mutable_current)) differing.push_back(dotted);
  }
  if (saved->schedule_total_steps() != current.schedule_total_steps()) {
    differing.push_back("schedule.total_steps (effective: 0 means train.steps)");
  }
  return differing;
}

}  // namespace gdr
