#include "gdr/export_hf.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>

#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "gdr/checkpoint.h"
#include "gdr/run_config.h"
#include "io/safetensors.h"
#include "models/qwen/hf_checkpoint.h"
#include "models/qwen/model.h"

namespace gdr {
namespace {

namespace fs = std::filesystem;

// The files of a Hugging Face model directory that are not weights or config.json.
constexpr const char* kCompanionFiles[] = {"generation_config.json",
                                           "tokenizer.json",
                                           "tokenizer_config.json",
                                           "special_tokens_map.json",
                                           "added_tokens.json",
                                           "vocab.json",
                                           "merges.txt",
                                           "chat_template.jinja",
                                           "chat_template.json",
                                           "preprocessor_config.json"};

absl::Status check_output_dir(const std::string& output_dir) {
  std::error_code ec;
  if (!fs::exists(output_dir, ec)) return absl::OkStatus();
  if (!fs::is_directory(output_dir, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat(output_dir, ": --output exists and is not a directory"));
  }
  if (!fs::is_empty(output_dir, ec)) {
    return absl::FailedPreconditionError(
        absl::StrCat(output_dir,
                     ": --output exists and is not empty; name a new directory (nothing is "
                     "overwritten)"));
  }
  return absl::OkStatus();
}

absl::Status write_reference_logits(const QwenConfig& config, const std::string& model_dir,
                                    const std::string& path) {
  try {
    QwenForCausalLM model(config);
    absl::StatusOr<HfLoadReport> loaded = load_hf_checkpoint(*model, model_dir);
    if (!loaded.ok()) return loaded.status();
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(0);
    const at::Tensor ids =
        at::randint(config.vocab_size, {kReferenceBatchRows, kReferenceBatchTokens}, gen,
                    at::TensorOptions().dtype(at::kLong));
    c10::NoGradGuard no_grad;
    const at::Tensor logits = model->forward(ids).to(at::kFloat).contiguous();
    return io::write_safetensors(path, {{"input_ids", ids}, {"logits", logits}},
                                 {{"format", "pt"}});
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(path, ": ", e.what_without_backtrace()));
  }
}

}  // namespace

absl::StatusOr<ExportHfReport> export_hf_checkpoint(const std::string& checkpoint,
                                                    const std::string& output_dir,
                                                    const ExportHfOptions& options) {
  if (options.dtype != at::kBFloat16 && options.dtype != at::kFloat) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dtype: expected bf16 or fp32 but got ", c10::toString(options.dtype)));
  }
  if (absl::Status s = check_output_dir(output_dir); !s.ok()) return s;
  absl::StatusOr<std::string> step_dir = resolve_checkpoint_dir(checkpoint);
  if (!step_dir.ok()) return step_dir.status();
  absl::StatusOr<Checkpoint> ckpt = read_checkpoint(*step_dir);
  if (!ckpt.ok()) return ckpt.status();
  absl::StatusOr<RunConfig> run =
      load_run_config_text(ckpt->state.config_text, *step_dir + "/state.json: config");
  if (!run.ok()) return run.status();

  std::string companion = options.companion_dir;
  std::error_code ec;
  if (companion.empty() && !run->train.init_from.empty() &&
      fs::is_directory(run->train.init_from, ec)) {
    companion = run->train.init_from;
  }
  if (!companion.empty() && !fs::is_directory(companion, ec)) {
    return absl::NotFoundError(absl::StrCat(companion, ": --companion_dir is not a directory"));
  }

  ExportHfReport report;
  report.step_dir = *step_dir;
  report.step = ckpt->state.step;
  std::string target = output_dir;
  while (target.size() > 1 && target.back() == '/') target.pop_back();
  const std::string partial = target + ".partial";
  fs::remove_all(partial, ec);  // a crashed export's leftovers
  try {
    QwenForCausalLM model(run->model);
    io::NamedTensors params;
    for (const auto& item : model->named_parameters())
      params.emplace_back(item.key(), item.value());
    if (absl::Status s = io::check_tensor_specs(io::specs_of(ckpt->model), io::specs_of(params),
                                                *step_dir + "/model.safetensors");
        !s.ok()) {
      return s;
    }
    {
      c10::NoGradGuard no_grad;
      std::map<std::string, at::Tensor> saved(ckpt->model.begin(), ckpt->model.end());
      for (auto& [name, param] : params) param.copy_(saved.at(name));
    }
    HfSaveOptions save;
    save.dtype = options.dtype;
    if (absl::Status s = save_hf_checkpoint(*model, partial, save); !s.ok()) return s;
    for (const auto& [name, param] : params) {
      ++report.tensors;
      report.bytes += param.numel() * static_cast<int64_t>(c10::elementSize(options.dtype));
    }
  } catch (const c10::Error& e) {
    return absl::InvalidArgumentError(absl::StrCat(*step_dir, ": ", e.what_without_backtrace()));
  }
  for (const char* name : kCompanionFiles) {
    const fs::path from = fs::path(companion) / name;
    if (companion.empty() || !fs::is_regular_file(from, ec)) continue;
    fs::copy_file(from, fs::path(partial) / name, fs::copy_options::overwrite_existing, ec);
    if (ec) {
      return absl::InternalError(
          absl::StrCat(from.string(), ": cannot copy into ", partial, ": ", ec.message()));
    }
    report.copied_files.push_back(name);
  }
  if (!options.reference_logits_path.empty()) {
    if (absl::Status s = write_reference_logits(run->model, partial, options.reference_logits_path);
        !s.ok()) {
      return s;
    }
  }
  // Publish: an empty output_dir (allowed above) is replaced by the complete one.
  fs::remove(target, ec);
  fs::rename(partial, target, ec);
  if (ec) {
    return absl::InternalError(
        absl::StrCat(partial, ": cannot rename to ", target, ": ", ec.message()));
  }
  return report;
}

}  // namespace gdr
