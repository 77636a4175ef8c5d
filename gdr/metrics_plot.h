// A picture of a run: metrics.jsonl (train.metrics_path, one JSON object per line, written
// by Trainer::run) -> one self-contained SVG of four stacked panels sharing the step axis:
// train loss (with eval loss when the file has evaluation lines), learning rate, gradient
// norm and tokens/s. No torch; the CLI is tools/plot_metrics.cc.
//
// Lines of the file:
//   training: {"step": N, "loss": x, "lr": x, "grad_norm": x, "tokens_per_s": x,
//              "skipped": bool, ...}; other keys (microbatch_losses, step_time_s, ...) are
//              ignored; "skipped" may be absent (false).
//   evaluation: {"step": N, "eval_loss": x, "eval_perplexity": x} (no "loss"), possibly
//              interleaved with training lines.
// A JSON number that is not finite is written as null by nlohmann-json (the trainer's
// writer); Python's bare NaN / Infinity / -Infinity are read the same way. Either is a
// non-finite value: kept as NaN, drawn as a gap in its series and counted in the plot's
// note, never an error.
//
// What is an error (one "FILE:LINE: ..." message, the CLI exits 2) and what is a warning:
//   errors: a file that cannot be read, a file without a single training or evaluation
//     line, a line that is not a JSON object, a training line without step / lr /
//     grad_norm / tokens_per_s, a value of the wrong type (a string where a number goes,
//     a fractional or negative step, a number beyond the range of a double such as 1e999,
//     which nlohmann-json refuses).
//   warnings (the line is skipped or kept, the plot is drawn): an unparseable LAST line
//     without a trailing newline (a run still writing it), a line with neither "loss" nor
//     "eval_loss" (a kind of line this reader does not know), a step that appears again
//     (the file is appended to, so a re-run or a resume from an earlier checkpoint repeats
//     steps: the later line wins, as it is the run that continued).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gdr {

// One training step's plotted values; non-finite ones are NaN.
struct TrainPoint {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double tokens_per_s = 0;
  bool skipped = false;  // the optimizer step was dropped (train.on_nonfinite: skip)
};

// One evaluation; non-finite values are NaN.
struct EvalPoint {
  int64_t step = 0;
  double eval_loss = 0;
  double eval_perplexity = 0;  // NaN when absent
};

struct MetricsLog {
  std::string source;             // the file name, for the plot's caption
  std::vector<TrainPoint> train;  // sorted by step, one point per step
  std::vector<EvalPoint> eval;    // sorted by step, one point per step
  // "FILE:LINE: ..." lines for the user, in file order (see the header comment).
  std::vector<std::string> warnings;
};

// Parses the text of a metrics file; `file_name` prefixes every message.
absl::StatusOr<MetricsLog> parse_metrics(absl::string_view text, absl::string_view file_name);

// Reads and parses `path`: NotFound / FailedPrecondition naming the file when it cannot be
// read, InvalidArgument for bad contents.
absl::StatusOr<MetricsLog> read_metrics_file(const std::string& path);

struct PlotOptions {
  std::string title;  // empty: "training metrics: <source>"
  int width = 900;    // SVG width in pixels; panels take the width less the margins
};

// The four-panel SVG document (UTF-8 text, no external references).
std::string render_metrics_svg(const MetricsLog& log, const PlotOptions& options = {});

// A "nice" axis over [lo, hi]: the smallest tick step of the form {1, 2, 5} x 10^k that
// covers the range in at most `max_intervals` intervals; the axis then runs from the
// tick at or below `lo` to the tick at or above `hi`. An empty range (lo == hi) is first
// widened by 5% of the value each way (by 1 at zero). Exposed for tests.
struct NiceAxis {
  double lo = 0;
  double hi = 1;
  double step = 1;
  std::vector<double> ticks;  // lo, lo + step, ..., hi (each computed as lo + i * step)
};
NiceAxis nice_axis(double lo, double hi, int max_intervals = 6);

// A tick label: as many decimals as the step needs ("3", "3.5"), thousands as "k" and
// millions as "M" ("12.5k"), and steps below 0.001 as mantissa + exponent ("1.5e-4").
std::string format_tick(double value, double step);

}  // namespace gdr
