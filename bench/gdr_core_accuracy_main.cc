// gdr_core_accuracy: the GDR core's errors against an FP64 reference, on the inputs that
// tools/gpu/gdn_anchor_accuracy.py then hands FLA and FlashQLA (issue 31).
//
// Draws seeded inputs at one shape (default 1 x 2048, H = Hk = 16, dk = dv = 128: the
// anchors' 0.8B head shape), computes the reference (gdr's core in FP64 on the CPU: the
// chunked composite, or --reference=recurrent for the token-by-token form), writes inputs
// and reference to --inputs=PATH (safetensors), then runs gdr's default path on --device
// for each of --paths: bf16 (BF16 q, k, v as the model hands them, FP32 g and beta) and
// fp32 (the same values in FP32). Prints one `ACCURACY {json}` line per path and tensor
// (o, final_state, dq, dk, dv, dg, dbeta): max |err|, max |err| / max |ref|,
// ||err|| / ||ref||, max |ref|. With --check=TOL it exits 1 when a max relative error
// exceeds TOL (for scripted checks).
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_policy.h"
#include "bench/gdr_core_accuracy.h"
#include "ops/gdr_core/gdr_core_op.h"

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Inputs, reference and file, then each path's errors; the exit code of main.
int run(const gdr::bench::AccuracyShape& shape, uint64_t seed, const std::string& inputs_path,
        const c10::Device& device, const std::vector<std::string>& paths,
        gdr::bench::CoreForm reference_form, double check);

}  // namespace

int main(int argc, char** argv) {
  const std::optional<gdr::ExecutionPolicy> policy =
      gdr::bench::environment_policy("gdr_core_accuracy");
  if (!policy.has_value()) return 2;
  const gdr::ExecutionPolicyGuard policy_guard(*policy);
  gdr::bench::AccuracyShape shape;
  long long seed = 0;
  std::string inputs_path = "gdr_core_accuracy_inputs.safetensors";
  std::string device_name = "cuda";
  std::vector<std::string> paths = {"bf16", "fp32"};
  gdr::bench::CoreForm reference_form = gdr::bench::CoreForm::kChunked;
  double check = -1;
  long long key_heads = 0;  // 0: H
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    long long value = 0;
    if (arg == "--help") {
      std::printf(
          "usage: gdr_core_accuracy [--batch=B] [--seq=T] [--heads=H] [--key_heads=Hk] [--dk=D]\n"
          "       [--dv=D] [--seed=S] [--inputs=PATH] [--device=cuda|cpu] [--paths=bf16,fp32]\n"
          "       [--reference=chunked|recurrent] [--check=TOL]\n"
          "  The GDR core's errors against its FP64 CPU reference on seeded inputs "
          "(gdn_anchor.py's\n"
          "  distributions, raw q/k with the fused L2 norm), one 'ACCURACY {json}' line per path\n"
          "  and tensor; inputs and reference are written to PATH (default\n"
          "  gdr_core_accuracy_inputs.safetensors) for tools/gpu/gdn_anchor_accuracy.py.\n"
          "  Defaults: 1 x 2048, H = 16, Hk = H, dk = dv = 128, seed 0, cuda, both paths, "
          "chunked.\n");
      return 0;
    }
    if (std::sscanf(argv[i], "--batch=%lld", &value) == 1 && value > 0) {
      shape.B = value;
    } else if (std::sscanf(argv[i], "--seq=%lld", &value) == 1 && value > 0) {
      shape.T = value;
    } else if (std::sscanf(argv[i], "--heads=%lld", &value) == 1 && value > 0) {
      shape.H = value;
    } else if (std::sscanf(argv[i], "--key_heads=%lld", &value) == 1 && value > 0) {
      key_heads = value;
    } else if (std::sscanf(argv[i], "--dk=%lld", &value) == 1 && value > 0) {
      shape.dk = value;
    } else if (std::sscanf(argv[i], "--dv=%lld", &value) == 1 && value > 0) {
      shape.dv = value;
    } else if (std::sscanf(argv[i], "--seed=%lld", &value) == 1 && value >= 0) {
      seed = value;
    } else if (arg.rfind("--inputs=", 0) == 0 && arg.size() > 9) {
      inputs_path = arg.substr(9);
    } else if (arg == "--device=cuda" || arg == "--device=cpu") {
      device_name = arg.substr(9);
    } else if (arg == "--reference=chunked" || arg == "--reference=recurrent") {
      reference_form = arg == "--reference=recurrent" ? gdr::bench::CoreForm::kRecurrent
                                                      : gdr::bench::CoreForm::kChunked;
    } else if (arg.rfind("--paths=", 0) == 0) {
      paths.clear();
      std::stringstream items(arg.substr(8));
      std::string item;
      while (std::getline(items, item, ',')) {
        if (item != "bf16" && item != "fp32") {
          std::fprintf(stderr, "gdr_core_accuracy: --paths expects bf16 and/or fp32, got '%s'\n",
                       item.c_str());
          return 2;
        }
        paths.push_back(item);
      }
    } else if (std::sscanf(argv[i], "--check=%lf", &check) == 1 && check > 0) {
    } else {
      std::fprintf(stderr, "gdr_core_accuracy: unknown or invalid argument '%s' (see --help)\n",
                   argv[i]);
      return 2;
    }
  }
  shape.Hk = key_heads > 0 ? key_heads : shape.H;
  if (shape.H % shape.Hk != 0) {
    std::fprintf(stderr, "gdr_core_accuracy: --heads must be a multiple of --key_heads\n");
    return 2;
  }
  try {
    return run(shape, static_cast<uint64_t>(seed), inputs_path, c10::Device(device_name), paths,
               reference_form, check);
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "gdr_core_accuracy: %s\n", e.what_without_backtrace());
    return 1;
  }
}

namespace {

int run(const gdr::bench::AccuracyShape& shape, uint64_t seed, const std::string& inputs_path,
        const c10::Device& device, const std::vector<std::string>& paths,
        gdr::bench::CoreForm reference_form, double check) {
  const auto start = std::chrono::steady_clock::now();
  const gdr::bench::AccuracyInputs in = gdr::bench::make_accuracy_inputs(shape, seed);
  const gdr::bench::NamedResults reference =
      gdr::bench::run_gdr_core(in, at::kDouble, c10::Device(at::kCPU), reference_form);
  const std::string reference_name =
      std::string("gdr FP64 ") +
      (reference_form == gdr::bench::CoreForm::kChunked ? "chunked (composite)" : "recurrent") +
      " on the CPU";
  std::fprintf(stderr, "gdr_core_accuracy: reference (%s) in %.1f s\n", reference_name.c_str(),
               seconds_since(start));
  if (absl::Status s = gdr::bench::write_accuracy_file(
          inputs_path, in, shape, static_cast<uint64_t>(seed), reference, reference_name);
      !s.ok()) {
    std::fprintf(stderr, "gdr_core_accuracy: %s\n", std::string(s.message()).c_str());
    return 1;
  }
  std::fprintf(stderr, "gdr_core_accuracy: wrote %s\n", inputs_path.c_str());
  bool within = true;
  for (const std::string& path : paths) {
    const gdr::bench::NamedResults results =
        gdr::bench::run_gdr_core(in, path == "bf16" ? at::kBFloat16 : at::kFloat, device);
    for (size_t i = 0; i < results.size(); ++i) {
      const gdr::bench::ErrorFigures e =
          gdr::bench::error_of(results[i].second, reference[i].second);
      std::printf("%s\n",
                  gdr::bench::accuracy_line("gdr", path, results[i].first, shape, e).c_str());
      if (check > 0 && !(e.max_rel_err <= check)) within = false;
    }
    std::fflush(stdout);
  }
  std::fprintf(stderr, "gdr_core_accuracy: step 7 %s, prep %s (the last run); %.1f s in all\n",
               gdr::gdr_core_last_step7() == gdr::GdrCoreImpl::kKernel ? "kernel" : "composite",
               gdr::gdr_core_last_prep() == gdr::GdrCorePrep::kKernel ? "kernel" : "aten",
               seconds_since(start));
  if (!within) {
    std::fprintf(stderr, "gdr_core_accuracy: a max relative error is above --check=%g\n", check);
    return 1;
  }
  return 0;
}

}  // namespace
