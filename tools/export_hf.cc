// export_hf: a training checkpoint -> a Hugging Face model directory (safetensors +
// config.json, + tokenizer/generation files from the run's starting checkpoint) that
// transformers loads with Qwen3_5ForCausalLM.from_pretrained. See gdr/export_hf.h.
//
//   bazel run //tools:export_hf -- --checkpoint=runs/tiny/checkpoints --output=runs/tiny/hf
//
// Exit status: 0 written, 2 bad arguments or bad input (one line on stderr).
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "gdr/export_hf.h"

namespace {

constexpr char kUsage[] =
    "usage: export_hf --checkpoint=DIR --output=DIR [--dtype=bf16|fp32]\n"
    "                 [--companion_dir=DIR] [--reference_logits=FILE]\n"
    "\n"
    "Writes the model of a gdr training checkpoint as a Hugging Face directory:\n"
    "model.safetensors (sharded above 5 GiB) and config.json, which transformers 5.x loads\n"
    "with Qwen3_5ForCausalLM.from_pretrained.\n"
    "  --checkpoint=DIR        a step_<N> directory, or a checkpoint_dir (its newest complete\n"
    "                          step)\n"
    "  --output=DIR            a new or empty directory (nothing is overwritten)\n"
    "  --dtype=bf16|fp32       the stored weights' dtype (default bf16, as HF ships)\n"
    "  --companion_dir=DIR     copy tokenizer and generation_config files from here (default:\n"
    "                          the run's train.init_from when it is a directory)\n"
    "  --reference_logits=FILE also write gdr's FP32 CPU logits of a fixed batch from the\n"
    "                          written weights, for tools/hf/check_export.py\n"
    "Exit status: 0 written, 2 bad arguments or bad input.\n";

int fail(absl::string_view message) {
  std::cerr << "export_hf: error: " << message << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* wd = std::getenv("BUILD_WORKING_DIRECTORY"); wd != nullptr && *wd != '\0') {
    if (chdir(wd) != 0) return fail(std::string("cannot enter ") + wd);
  }
  std::string checkpoint, output;
  gdr::ExportHfOptions options;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (absl::ConsumePrefix(&arg, "--checkpoint=")) {
      checkpoint = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--output=")) {
      output = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--dtype=")) {
      if (arg == "bf16") {
        options.dtype = at::kBFloat16;
      } else if (arg == "fp32") {
        options.dtype = at::kFloat;
      } else {
        return fail(std::string("--dtype: expected bf16 or fp32 but got '") + std::string(arg) +
                    "'");
      }
    } else if (absl::ConsumePrefix(&arg, "--companion_dir=")) {
      options.companion_dir = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--reference_logits=")) {
      options.reference_logits_path = std::string(arg);
    } else {
      return fail(std::string("unknown argument '") + argv[i] + "' (see --help)");
    }
  }
  if (checkpoint.empty() || output.empty()) {
    return fail("--checkpoint and --output are required (see --help)");
  }
  absl::StatusOr<gdr::ExportHfReport> report =
      gdr::export_hf_checkpoint(checkpoint, output, options);
  if (!report.ok()) return fail(report.status().message());
  std::cout << "wrote " << output << ": step " << report->step << " of " << report->step_dir << ", "
            << report->tensors << " tensors, " << report->bytes << " bytes of weights";
  if (!report->copied_files.empty()) {
    std::cout << ", copied " << absl::StrJoin(report->copied_files, ", ");
  }
  if (!options.reference_logits_path.empty()) {
    std::cout << "; reference logits in " << options.reference_logits_path;
  }
  std::cout << "\n";
  return 0;
}
