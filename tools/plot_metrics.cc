// plot_metrics: metrics.jsonl (train.metrics_path) -> one self-contained SVG with four
// stacked panels sharing the step axis: loss (train, and eval when present), learning
// rate, gradient norm, tokens/s.
//
//   bazel run //tools:plot_metrics -- --metrics=runs/tiny/metrics.jsonl
//   --output=runs/tiny/metrics.svg [--title=TEXT]
//
// Warnings (values drawn as gaps, repeated steps, an incomplete last line) go to stderr
// as "plot_metrics: warning: FILE:LINE: ...". Exit status: 0 written, 2 bad arguments or
// bad input (one line on stderr naming the file and line). See gdr/metrics_plot.h.
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "gdr/metrics_plot.h"
#include "io/file_util.h"

namespace {

constexpr char kUsage[] =
    "usage: plot_metrics --metrics=FILE --output=FILE.svg [--title=TEXT]\n"
    "\n"
    "Reads a metrics.jsonl written by train.metrics_path (one JSON object per step; eval\n"
    "lines with eval_loss may be interleaved) and writes one SVG: loss (+ eval loss),\n"
    "learning rate, gradient norm and tokens/s against the step. NaN/Inf values and\n"
    "skipped steps are drawn as gaps and counted in a note.\n"
    "  --metrics=FILE   the metrics.jsonl to read\n"
    "  --output=FILE    the SVG to write (replaced atomically)\n"
    "  --title=TEXT     the plot's title (default: \"training metrics: FILE\")\n"
    "Exit status: 0 written, 2 bad arguments or bad input.\n";

int fail(absl::string_view message) {
  std::cerr << "plot_metrics: error: " << message << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* wd = std::getenv("BUILD_WORKING_DIRECTORY"); wd != nullptr && *wd != '\0') {
    if (chdir(wd) != 0) return fail(std::string("cannot enter ") + wd);
  }
  std::string metrics_path, output_path;
  gdr::PlotOptions options;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (absl::ConsumePrefix(&arg, "--metrics=")) {
      metrics_path = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--output=")) {
      output_path = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--title=")) {
      options.title = std::string(arg);
    } else {
      return fail(std::string("unknown argument '") + argv[i] + "' (see --help)");
    }
  }
  if (metrics_path.empty() || output_path.empty()) {
    return fail("--metrics and --output are required (see --help)");
  }
  absl::StatusOr<gdr::MetricsLog> log = gdr::read_metrics_file(metrics_path);
  if (!log.ok()) return fail(log.status().message());
  for (const std::string& warning : log->warnings) {
    std::cerr << "plot_metrics: warning: " << warning << "\n";
  }
  const std::string svg = gdr::render_metrics_svg(*log, options);
  if (absl::Status s = gdr::io::write_file_atomically(output_path, svg); !s.ok()) {
    return fail(absl::StrCat("cannot write ", output_path, ": ", s.message()));
  }
  std::cout << "wrote " << output_path << ": " << log->train.size() << " training steps, "
            << log->eval.size() << " evaluations, " << svg.size() << " bytes\n";
  return 0;
}
