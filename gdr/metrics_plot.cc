#include "gdr/metrics_plot.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace gdr {
namespace {

using nlohmann::json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// ---------------------------------------------------------------------------------------
// Parsing

// nlohmann-json follows RFC 8259, which has no NaN or Infinity; Python's json module
// writes them as bare words. Outside strings they become null, which this reader takes as
// "not finite" anyway.
std::string non_finite_literals_to_null(absl::string_view line) {
  if (!absl::StrContains(line, "NaN") && !absl::StrContains(line, "Infinity")) {
    return std::string(line);
  }
  std::string out;
  out.reserve(line.size());
  bool in_string = false;
  size_t i = 0;
  while (i < line.size()) {
    const char c = line[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < line.size()) {
        out += line[i + 1];
        i += 2;
        continue;
      }
      if (c == '"') in_string = false;
      ++i;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (absl::string_view literal : {"-Infinity", "Infinity", "NaN"}) {
      if (absl::StartsWith(line.substr(i), literal)) {
        out += "null";
        i += literal.size();
        replaced = true;
        break;
      }
    }
    if (!replaced) {
      out += c;
      ++i;
    }
  }
  return out;
}

// nlohmann's messages start with "[json.exception.parse_error.101] "; the rest says what.
std::string json_error_text(const std::exception& e) {
  absl::string_view text = e.what();
  if (absl::StartsWith(text, "[json.exception.")) {
    const size_t end = text.find("] ");
    if (end != absl::string_view::npos) text.remove_prefix(end + 2);
  }
  return std::string(text);
}

// Counts occurrences of one kind of warning and reports the first one with the count, so a
// re-run of 10,000 steps is one line, not 10,000.
struct WarningTally {
  std::string first;  // "FILE:LINE: ..." of the first occurrence
  int64_t count = 0;
  void add(const std::function<std::string()>& message) {
    if (count++ == 0) first = message();
  }
};

class LineReader {
 public:
  LineReader(absl::string_view file, int64_t line, const json& object)
      : where_(absl::StrCat(file, ":", line)), object_(object) {}

  const std::string& where() const { return where_; }
  bool has(const char* key) const { return object_.contains(key); }

  absl::Status error(absl::string_view message) const {
    return absl::InvalidArgumentError(absl::StrCat(where_, ": ", message));
  }

  // The step: a whole number >= 0 (an integral float such as 7.0 is accepted).
  absl::StatusOr<int64_t> step() const {
    if (!has("step")) return error("missing \"step\"");
    const json& v = object_.at("step");
    if (v.is_number_unsigned()) {
      if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return error("\"step\" is too large");
      }
      return static_cast<int64_t>(v.get<uint64_t>());
    }
    if (v.is_number_integer()) {
      if (v.get<int64_t>() < 0) return error(absl::StrCat("\"step\" is ", v.dump(), " (< 0)"));
      return v.get<int64_t>();
    }
    if (v.is_number_float()) {
      const double d = v.get<double>();
      if (std::isfinite(d) && d >= 0 && d < 9.0e18 && d == std::floor(d)) {
        return static_cast<int64_t>(d);
      }
      return error(absl::StrCat("\"step\" is ", v.dump(), ", expected a whole number >= 0"));
    }
    return error(absl::StrCat("\"step\" is ", v.type_name(), ", expected a whole number"));
  }

  // A number; NaN for null or a number that is not finite (counted in `non_finite`).
  absl::StatusOr<double> number(const char* key, const char* line_kind,
                                WarningTally* non_finite) const {
    if (!has(key)) {
      return error(absl::StrCat("missing \"", key, "\" in ", line_kind,
                                " (a gdr metrics.jsonl line? see gdr/metrics_plot.h)"));
    }
    const json& v = object_.at(key);
    double d = kNaN;
    if (v.is_number()) {
      d = v.get<double>();
    } else if (!v.is_null()) {
      return error(absl::StrCat("\"", key, "\" is ", v.type_name(), ", expected a number"));
    }
    if (!std::isfinite(d)) {
      non_finite->add([&] {
        return absl::StrCat(where_, ": \"", key, "\" is not finite (", v.dump(),
                            "); drawn as a gap");
      });
      return kNaN;
    }
    return d;
  }

  absl::StatusOr<bool> flag(const char* key) const {
    if (!has(key)) return false;
    const json& v = object_.at(key);
    if (!v.is_boolean()) {
      return error(absl::StrCat("\"", key, "\" is ", v.type_name(), ", expected true or false"));
    }
    return v.get<bool>();
  }

 private:
  std::string where_;
  const json& object_;
};

}  // namespace

absl::StatusOr<MetricsLog> parse_metrics(absl::string_view text, absl::string_view file_name) {
  MetricsLog log;
  log.source = std::string(file_name);
  if (absl::StripAsciiWhitespace(text).empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(file_name, ": empty (no metrics lines; was train.metrics_path set?)"));
  }
  std::map<int64_t, TrainPoint> train;
  std::map<int64_t, EvalPoint> eval;
  // One tally per kind of warning (non-finite values: per key); reported after the loop.
  std::map<std::string, WarningTally> non_finite;
  WarningTally repeated_train, repeated_eval, unknown_lines, incomplete_last;

  const std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  for (size_t index = 0; index < lines.size(); ++index) {
    const int64_t line_number = static_cast<int64_t>(index) + 1;
    absl::string_view line = absl::StripSuffix(lines[index], "\r");
    if (absl::StripAsciiWhitespace(line).empty()) continue;
    // The last piece of a split has no '\n' after it: a line still being written when the
    // run is live, or cut short by a crash. Only that line may fail to parse harmlessly.
    const bool unterminated = index + 1 == lines.size();
    json object;
    try {
      object = json::parse(non_finite_literals_to_null(line));
    } catch (const json::exception& e) {
      if (unterminated) {
        incomplete_last.add([&] {
          return absl::StrCat(file_name, ":", line_number,
                              ": incomplete last line (no newline at the end; a run still "
                              "writing?) skipped");
        });
        continue;
      }
      return absl::InvalidArgumentError(
          absl::StrCat(file_name, ":", line_number, ": not valid JSON: ", json_error_text(e)));
    }
    if (!object.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(
          file_name, ":", line_number, ": expected a JSON object, got ", object.type_name()));
    }
    const LineReader reader(file_name, line_number, object);
    const bool is_train = reader.has("loss");
    const bool is_eval = reader.has("eval_loss");
    if (!is_train && !is_eval) {
      unknown_lines.add([&] {
        return absl::StrCat(reader.where(),
                            ": a line with neither \"loss\" nor \"eval_loss\" skipped");
      });
      continue;
    }
    absl::StatusOr<int64_t> step = reader.step();
    if (!step.ok()) return step.status();
    if (is_train) {
      TrainPoint p;
      p.step = *step;
      constexpr char kKind[] = "a training line";
      const std::initializer_list<std::pair<const char*, double*>> fields = {
          {"loss", &p.loss},
          {"lr", &p.lr},
          {"grad_norm", &p.grad_norm},
          {"tokens_per_s", &p.tokens_per_s}};
      for (auto [key, field] : fields) {
        absl::StatusOr<double> v = reader.number(key, kKind, &non_finite[key]);
        if (!v.ok()) return v.status();
        *field = *v;
      }
      absl::StatusOr<bool> skipped = reader.flag("skipped");
      if (!skipped.ok()) return skipped.status();
      p.skipped = *skipped;
      if (train.count(p.step) > 0) {
        repeated_train.add(
            [&] { return absl::StrCat(reader.where(), ": step ", p.step, " appears again"); });
      }
      train[p.step] = p;
    }
    if (is_eval) {
      EvalPoint p;
      p.step = *step;
      absl::StatusOr<double> loss =
          reader.number("eval_loss", "an evaluation line", &non_finite["eval_loss"]);
      if (!loss.ok()) return loss.status();
      p.eval_loss = *loss;
      if (reader.has("eval_perplexity")) {
        // Perplexity overflows to inf long before the loss does: not worth a warning.
        WarningTally ignored;
        absl::StatusOr<double> ppl =
            reader.number("eval_perplexity", "an evaluation line", &ignored);
        if (!ppl.ok()) return ppl.status();
        p.eval_perplexity = *ppl;
      } else {
        p.eval_perplexity = kNaN;
      }
      if (eval.count(p.step) > 0) {
        repeated_eval.add([&] {
          return absl::StrCat(reader.where(), ": evaluation at step ", p.step, " appears again");
        });
      }
      eval[p.step] = p;
    }
  }
  if (train.empty() && eval.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        file_name, ": no training or evaluation lines (no line has \"loss\" or \"eval_loss\")"));
  }
  for (auto& [step, p] : train) log.train.push_back(p);
  for (auto& [step, p] : eval) log.eval.push_back(p);

  auto report = [&](const WarningTally& tally, absl::string_view more) {
    if (tally.count == 0) return;
    std::string line = tally.first;
    if (tally.count > 1) absl::StrAppend(&line, " (and ", tally.count - 1, " more ", more, ")");
    log.warnings.push_back(std::move(line));
  };
  report(incomplete_last, "");
  report(unknown_lines, "such lines");
  const std::string replaced =
      "; the file is appended to, so a re-run or a resume repeats steps: later lines win";
  if (repeated_train.count > 0) {
    report(repeated_train, "repeated steps");
    log.warnings.back() += replaced;
  }
  if (repeated_eval.count > 0) {
    report(repeated_eval, "repeated evaluations");
    log.warnings.back() += replaced;
  }
  for (const char* key : {"loss", "lr", "grad_norm", "tokens_per_s", "eval_loss"}) {
    auto it = non_finite.find(key);
    if (it != non_finite.end()) report(it->second, absl::StrCat("non-finite \"", key, "\""));
  }
  return log;
}

absl::StatusOr<MetricsLog> read_metrics_file(const std::string& path) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) {
    return absl::FailedPreconditionError(absl::StrCat(path, ": is a directory, not a file"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int err = errno;
    const std::string reason = err != 0 ? std::strerror(err) : "cannot open";
    if (err == ENOENT) {
      return absl::NotFoundError(absl::StrCat(path, ": cannot open: ", reason));
    }
    return absl::FailedPreconditionError(absl::StrCat(path, ": cannot open: ", reason));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read failed"));
  return parse_metrics(text.str(), path);
}

// ---------------------------------------------------------------------------------------
// Axes

namespace {

// 10^k as exactly as a double allows: 10^-3 computed as 1 / 1000, not 10 * 10^-4.
double power_of_ten(int k) { return k >= 0 ? std::pow(10.0, k) : 1.0 / std::pow(10.0, -k); }

// i * m * 10^k with a single rounding, so tick 3 of step 0.1 is 0.3, not 0.30000000000000004.
double tick_value(int64_t i, int m, int k) {
  return k >= 0 ? static_cast<double>(i * m) * power_of_ten(k)
                : static_cast<double>(i * m) / power_of_ten(-k);
}

// Removes trailing zeros after a decimal point, and the point itself ("3.50" -> "3.5").
std::string trim_decimals(std::string s) {
  if (s.find('.') != std::string::npos) {
    while (!s.empty() && s.back() == '0') s.pop_back();
    if (!s.empty() && s.back() == '.') s.pop_back();
  }
  if (s == "-0") s = "0";
  return s;
}

// The exponent k of a tick step m * 10^k (m in 1, 2, 5).
int step_exponent(double step) { return static_cast<int>(std::floor(std::log10(step) + 1e-9)); }

}  // namespace

NiceAxis nice_axis(double lo, double hi, int max_intervals) {
  if (!std::isfinite(lo) || !std::isfinite(hi)) lo = 0, hi = 1;
  if (lo > hi) std::swap(lo, hi);
  if (max_intervals < 1) max_intervals = 1;
  if (lo == hi) {
    const double half = lo == 0 ? 1.0 : std::fabs(lo) * 0.05;
    lo -= half;
    hi += half;
  }
  // The smallest k whose 10^k step could do: one decade below range / max_intervals. The
  // range of two finite doubles can overflow; the largest double stands in for it.
  double range = hi - lo;
  if (!std::isfinite(range)) range = std::numeric_limits<double>::max();
  int k = static_cast<int>(std::floor(std::log10(range / max_intervals))) - 1;
  for (; k < 308; ++k) {
    for (int m : {1, 2, 5}) {
      const double step = tick_value(1, m, k);
      // A relative tolerance keeps 4.5 / 0.5 from counting as 9.000000000000002 -> 10.
      const double first = std::floor(lo / step + 1e-9);
      const double last = std::ceil(hi / step - 1e-9);
      if (last - first > max_intervals) continue;
      // Tick indices stay far from int64 overflow (values of 1e300 with a range of 1).
      if (std::fabs(first) > 1e15 || std::fabs(last) > 1e15) continue;
      NiceAxis axis;
      axis.step = step;
      for (int64_t i = static_cast<int64_t>(first); i <= static_cast<int64_t>(last); ++i) {
        axis.ticks.push_back(tick_value(i, m, k));
      }
      axis.lo = axis.ticks.front();
      axis.hi = axis.ticks.back();
      if (axis.ticks.size() == 1) {  // lo == hi on a tick: show the neighbours too
        axis.lo -= step;
        axis.hi += step;
        axis.ticks = {axis.lo, axis.ticks[0], axis.hi};
      }
      return axis;
    }
  }
  // Only for ranges near the largest doubles: the two ends, unrounded.
  NiceAxis axis;
  axis.lo = lo;
  axis.hi = hi;
  axis.step = range;
  axis.ticks = {lo, hi};
  return axis;
}

std::string format_tick(double value, double step) {
  if (std::fabs(value) < step * 1e-6) return "0";
  int k = step_exponent(step);
  if (k < -3) {
    // Mantissa and exponent of the value itself, with the digits the step needs.
    int e = static_cast<int>(std::floor(std::log10(std::fabs(value)) + 1e-9));
    const int decimals = std::max(0, e - k);
    std::string mantissa =
        trim_decimals(absl::StrFormat("%.*f", decimals, value / power_of_ten(e)));
    return absl::StrCat(mantissa, "e", e);
  }
  const char* suffix = "";
  if (k >= 6) {
    value /= 1e6;
    k -= 6;
    suffix = "M";
  } else if (k >= 3) {
    value /= 1e3;
    k -= 3;
    suffix = "k";
  }
  return absl::StrCat(trim_decimals(absl::StrFormat("%.*f", std::max(0, -k), value)), suffix);
}

// ---------------------------------------------------------------------------------------
// SVG

namespace {

std::string escape_xml(absl::string_view text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') {
          out += '?';
        } else {
          out += c;
        }
    }
  }
  return out;
}

// A value for the captions: 4 significant digits, whole numbers from 10^4 on ("48917",
// not "4.892e+04").
std::string short_number(double v) {
  if (std::fabs(v) >= 1e4 && std::fabs(v) < 1e15) return absl::StrFormat("%.0f", v);
  return absl::StrFormat("%.4g", v);
}

struct Point {
  double x;
  double y;
};

// One panel's series: a value per training step (NaN for gaps).
struct Series {
  const char* name;   // panel title
  const char* key;    // the JSON key, also the polyline's class
  const char* color;  // stroke
  std::vector<std::pair<int64_t, double>> values;
};

constexpr char kTrainColor[] = "#1f77b4";
constexpr char kEvalColor[] = "#ff7f0e";
constexpr char kSkipColor[] = "#d62728";
constexpr char kGridColor[] = "#e6e6e6";
constexpr char kTextColor[] = "#333333";
constexpr char kMutedColor[] = "#777777";

constexpr int kMarginLeft = 64;
constexpr int kMarginRight = 20;
constexpr int kHeaderHeight = 56;
constexpr int kPanelTitleHeight = 22;
constexpr int kPanelPlotHeight = 140;
constexpr int kPanelGap = 14;
constexpr int kXAxisHeight = 40;
constexpr int kNoteLineHeight = 16;

// A run of consecutive drawable points as a polyline's "points" text. With more points than
// pixel columns, each column keeps its first, lowest, highest and last point, in order, so a
// long run stays a few thousand points and spikes stay visible.
std::string polyline_points(const std::vector<Point>& points, int width_px) {
  std::vector<Point> kept;
  if (static_cast<int>(points.size()) <= width_px) {
    kept = points;
  } else {
    size_t begin = 0;
    while (begin < points.size()) {
      const long column = std::lround(points[begin].x);
      size_t end = begin;
      size_t lo = begin, hi = begin;
      while (end < points.size() && std::lround(points[end].x) == column) {
        // SVG y grows downwards: the lowest value has the largest y.
        if (points[end].y > points[lo].y) lo = end;
        if (points[end].y < points[hi].y) hi = end;
        ++end;
      }
      std::vector<size_t> picks = {begin, lo, hi, end - 1};
      std::sort(picks.begin(), picks.end());
      picks.erase(std::unique(picks.begin(), picks.end()), picks.end());
      for (size_t i : picks) kept.push_back(points[i]);
      begin = end;
    }
  }
  std::vector<std::string> parts;
  parts.reserve(kept.size());
  for (const Point& p : kept) parts.push_back(absl::StrFormat("%.1f,%.1f", p.x, p.y));
  return absl::StrJoin(parts, " ");
}

class SvgPanel {
 public:
  SvgPanel(std::string* out, int top, int width, const NiceAxis& x_axis)
      : out_(out), top_(top + kPanelTitleHeight), width_(width), x_axis_(x_axis) {}

  double x(double step) const {
    return kMarginLeft + (step - x_axis_.lo) / (x_axis_.hi - x_axis_.lo) * plot_width();
  }
  double y(double v) const {
    return top_ + kPanelPlotHeight -
           (v - y_axis_.lo) / (y_axis_.hi - y_axis_.lo) * kPanelPlotHeight;
  }
  int plot_width() const { return width_ - kMarginLeft - kMarginRight; }
  int plot_bottom() const { return top_ + kPanelPlotHeight; }

  void set_y_axis(const NiceAxis& axis) { y_axis_ = axis; }

  // Title on the left above the plot, `stats` on the right.
  void title(const std::string& title_svg, const std::string& stats) {
    absl::StrAppend(out_, "<text x=\"", kMarginLeft, "\" y=\"", top_ - 7,
                    "\" font-size=\"13\" font-weight=\"bold\" fill=\"", kTextColor, "\">",
                    title_svg, "</text>\n");
    absl::StrAppend(out_, "<text x=\"", width_ - kMarginRight, "\" y=\"", top_ - 7,
                    "\" font-size=\"11\" text-anchor=\"end\" fill=\"", kMutedColor, "\">",
                    escape_xml(stats), "</text>\n");
  }

  // Frame, grid lines, y tick labels; x tick labels when `x_labels`.
  void axes(bool x_labels) {
    for (double t : y_axis_.ticks) {
      const double ty = y(t);
      absl::StrAppend(out_,
                      absl::StrFormat("<line x1=\"%d\" y1=\"%.1f\" x2=\"%d\" y2=\"%.1f\" "
                                      "stroke=\"%s\"/>\n",
                                      kMarginLeft, ty, width_ - kMarginRight, ty, kGridColor));
      absl::StrAppend(
          out_, absl::StrFormat("<text class=\"ytick\" x=\"%d\" y=\"%.1f\" font-size=\"11\" "
                                "text-anchor=\"end\" fill=\"%s\">%s</text>\n",
                                kMarginLeft - 6, ty + 4, kTextColor, format_tick(t, y_axis_.step)));
    }
    for (double t : x_axis_.ticks) {
      const double tx = x(t);
      absl::StrAppend(out_, absl::StrFormat("<line x1=\"%.1f\" y1=\"%d\" x2=\"%.1f\" y2=\"%d\" "
                                            "stroke=\"%s\"/>\n",
                                            tx, top_, tx, plot_bottom(), kGridColor));
      if (x_labels) {
        absl::StrAppend(out_, absl::StrFormat("<text class=\"xtick\" x=\"%.1f\" y=\"%d\" "
                                              "font-size=\"11\" text-anchor=\"middle\" "
                                              "fill=\"%s\">%s</text>\n",
                                              tx, plot_bottom() + 15, kTextColor,
                                              format_tick(t, x_axis_.step)));
      }
    }
    absl::StrAppend(out_, "<rect x=\"", kMarginLeft, "\" y=\"", top_, "\" width=\"", plot_width(),
                    "\" height=\"", kPanelPlotHeight, "\" fill=\"none\" stroke=\"#999999\"/>\n");
  }

  // A red vertical line at each skipped step.
  void skipped_marks(const std::vector<int64_t>& steps) {
    for (int64_t s : steps) {
      absl::StrAppend(out_, absl::StrFormat("<line class=\"skipped\" x1=\"%.1f\" y1=\"%d\" "
                                            "x2=\"%.1f\" y2=\"%d\" stroke=\"%s\" "
                                            "stroke-opacity=\"0.6\" stroke-dasharray=\"3,2\"/>\n",
                                            x(s), top_, x(s), plot_bottom(), kSkipColor));
    }
  }

  // The series as polylines broken at NaN values (a lone point between gaps is a dot).
  void line(const std::vector<std::pair<int64_t, double>>& values, const char* css_class,
            const char* color, const char* extra = "") {
    std::vector<Point> run;
    auto flush = [&] {
      if (run.size() == 1) {
        absl::StrAppend(out_, absl::StrFormat("<circle class=\"%s\" cx=\"%.1f\" cy=\"%.1f\" "
                                              "r=\"1.8\" fill=\"%s\"/>\n",
                                              css_class, run[0].x, run[0].y, color));
      } else if (run.size() > 1) {
        absl::StrAppend(out_, "<polyline class=\"", css_class, "\" fill=\"none\" stroke=\"", color,
                        "\" stroke-width=\"1.5\" stroke-linejoin=\"round\"", extra, " points=\"",
                        polyline_points(run, plot_width()), "\"/>\n");
      }
      run.clear();
    };
    for (const auto& [step, v] : values) {
      if (std::isnan(v)) {
        flush();
      } else {
        run.push_back({x(static_cast<double>(step)), y(v)});
      }
    }
    flush();
  }

  void markers(const std::vector<std::pair<int64_t, double>>& values, const char* css_class,
               const char* color) {
    for (const auto& [step, v] : values) {
      if (std::isnan(v)) continue;
      absl::StrAppend(out_, absl::StrFormat("<circle class=\"%s\" cx=\"%.1f\" cy=\"%.1f\" r=\"3\" "
                                            "fill=\"%s\" stroke=\"white\"/>\n",
                                            css_class, x(static_cast<double>(step)), y(v), color));
    }
  }

  void centered_text(const std::string& text) {
    absl::StrAppend(out_,
                    absl::StrFormat("<text x=\"%.1f\" y=\"%d\" font-size=\"12\" "
                                    "text-anchor=\"middle\" fill=\"%s\">%s</text>\n",
                                    kMarginLeft + plot_width() / 2.0, top_ + kPanelPlotHeight / 2,
                                    kMutedColor, escape_xml(text)));
  }

 private:
  std::string* out_;
  int top_;  // the plot area's top
  int width_;
  NiceAxis x_axis_;
  NiceAxis y_axis_;
};

// "min 3.312 @ 58 · max 5.401 @ 1 · last 3.35" over the finite values.
std::string stats_text(const std::vector<std::pair<int64_t, double>>& values) {
  const std::pair<int64_t, double>* min = nullptr;
  const std::pair<int64_t, double>* max = nullptr;
  const std::pair<int64_t, double>* last = nullptr;
  for (const auto& sv : values) {
    if (std::isnan(sv.second)) continue;
    if (min == nullptr || sv.second < min->second) min = &sv;
    if (max == nullptr || sv.second > max->second) max = &sv;
    last = &sv;
  }
  if (last == nullptr) return "";
  return absl::StrCat("min ", short_number(min->second), " @ step ", min->first, "  \xC2\xB7  max ",
                      short_number(max->second), " @ step ", max->first, "  \xC2\xB7  last ",
                      short_number(last->second));
}

// [min, max] of the finite values of the given series; false when there are none.
bool value_range(const std::vector<const std::vector<std::pair<int64_t, double>>*>& series,
                 double* lo, double* hi) {
  bool any = false;
  for (const auto* values : series) {
    for (const auto& [step, v] : *values) {
      if (std::isnan(v)) continue;
      *lo = any ? std::min(*lo, v) : v;
      *hi = any ? std::max(*hi, v) : v;
      any = true;
    }
  }
  return any;
}

}  // namespace

std::string render_metrics_svg(const MetricsLog& log, const PlotOptions& options) {
  const int width = std::max(options.width, 320);
  // The drawn values: a skipped step's values are not part of the trajectory (its gradients
  // were dropped), so they are gaps like non-finite ones; red lines mark where.
  Series panels[] = {
      {"loss", "loss", kTrainColor, {}},
      {"learning rate", "lr", kTrainColor, {}},
      {"gradient norm", "grad_norm", kTrainColor, {}},
      {"tokens/s", "tokens_per_s", kTrainColor, {}},
  };
  std::vector<int64_t> skipped;
  int64_t non_finite[4] = {0, 0, 0, 0};
  for (const TrainPoint& p : log.train) {
    const double values[4] = {p.loss, p.lr, p.grad_norm, p.tokens_per_s};
    for (int i = 0; i < 4; ++i) {
      if (!std::isfinite(values[i])) ++non_finite[i];
      panels[i].values.emplace_back(p.step, p.skipped ? kNaN : values[i]);
    }
    if (p.skipped) skipped.push_back(p.step);
  }
  std::vector<std::pair<int64_t, double>> eval_loss;
  int64_t eval_non_finite = 0;
  for (const EvalPoint& p : log.eval) {
    eval_loss.emplace_back(p.step, p.eval_loss);
    if (!std::isfinite(p.eval_loss)) ++eval_non_finite;
  }

  // The shared step axis covers training and evaluation steps.
  int64_t first_step = std::numeric_limits<int64_t>::max(), last_step = 0;
  for (const TrainPoint& p : log.train) {
    first_step = std::min(first_step, p.step);
    last_step = std::max(last_step, p.step);
  }
  for (const EvalPoint& p : log.eval) {
    first_step = std::min(first_step, p.step);
    last_step = std::max(last_step, p.step);
  }
  if (log.train.empty() && log.eval.empty()) first_step = last_step = 0;
  const NiceAxis x_axis =
      nice_axis(static_cast<double>(first_step), static_cast<double>(last_step), 10);

  // Notes under the plot: what is not drawn, and why.
  std::vector<std::string> notes;
  for (int i = 0; i < 4; ++i) {
    if (non_finite[i] > 0) {
      notes.push_back(absl::StrCat(non_finite[i], " non-finite ", panels[i].key,
                                   non_finite[i] == 1 ? " value" : " values",
                                   " (NaN/Inf) drawn as gaps"));
    }
  }
  if (eval_non_finite > 0) {
    notes.push_back(absl::StrCat(eval_non_finite, " non-finite eval_loss ",
                                 eval_non_finite == 1 ? "value" : "values", " left out"));
  }
  if (!skipped.empty()) {
    notes.push_back(absl::StrCat(
        skipped.size(), skipped.size() == 1 ? " skipped step" : " skipped steps",
        " (non-finite loss or gradient norm, update dropped): gaps, marked by red dashed lines"));
  }

  const int panel_height = kPanelTitleHeight + kPanelPlotHeight + kPanelGap;
  const int height = kHeaderHeight + 4 * panel_height + kXAxisHeight +
                     static_cast<int>(notes.size()) * kNoteLineHeight + 8;
  std::string out;
  const std::string title =
      options.title.empty() ? absl::StrCat("training metrics: ", log.source) : options.title;
  absl::StrAppend(&out, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n",
                  "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"", width, "\" height=\"",
                  height, "\" viewBox=\"0 0 ", width, " ", height,
                  "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n");
  absl::StrAppend(&out, "<title>", escape_xml(title), "</title>\n");
  absl::StrAppend(&out, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n");
  absl::StrAppend(&out, "<text x=\"", kMarginLeft, "\" y=\"24\" font-size=\"17\" fill=\"",
                  kTextColor, "\">", escape_xml(title), "</text>\n");
  std::string subtitle = absl::StrCat(log.train.size(), " training steps");
  if (!log.train.empty()) {
    absl::StrAppend(&subtitle, " (", log.train.front().step, "..", log.train.back().step, ")");
  }
  if (!log.eval.empty()) absl::StrAppend(&subtitle, ", ", log.eval.size(), " evaluations");
  absl::StrAppend(&subtitle, "  \xC2\xB7  ", log.source);
  absl::StrAppend(&out, "<text x=\"", kMarginLeft, "\" y=\"42\" font-size=\"11\" fill=\"",
                  kMutedColor, "\">", escape_xml(subtitle), "</text>\n");

  for (int i = 0; i < 4; ++i) {
    const Series& series = panels[i];
    // One group per panel, so a reader (or a test) can pick a panel by its key.
    absl::StrAppend(&out, "<g id=\"panel-", series.key, "\">\n");
    SvgPanel panel(&out, kHeaderHeight + i * panel_height, width, x_axis);
    const bool with_eval = i == 0 && !eval_loss.empty();
    double lo = 0, hi = 1;
    const bool any = with_eval ? value_range({&series.values, &eval_loss}, &lo, &hi)
                               : value_range({&series.values}, &lo, &hi);
    panel.set_y_axis(nice_axis(lo, hi));
    std::string title_svg = escape_xml(series.name);
    if (i == 0) {
      title_svg = absl::StrCat("<tspan fill=\"", kTrainColor, "\">train loss</tspan>");
      if (with_eval) {
        std::string eval_stats = stats_text(eval_loss);
        const size_t last = eval_stats.rfind("last ");
        absl::StrAppend(&title_svg, "<tspan dx=\"14\" fill=\"", kEvalColor,
                        "\">\xE2\x97\x8F eval loss",
                        last == std::string::npos
                            ? ""
                            : escape_xml(absl::StrCat(" (", eval_stats.substr(last), ")")),
                        "</tspan>");
      }
    }
    panel.title(title_svg, stats_text(series.values));
    panel.axes(/*x_labels=*/i == 3);
    panel.skipped_marks(skipped);
    if (!any) {
      panel.centered_text("no finite values");
    } else {
      panel.line(series.values, series.key, series.color);
    }
    if (with_eval) {
      panel.line(eval_loss, "eval_loss", kEvalColor,
                 " stroke-dasharray=\"4,3\" stroke-opacity=\"0.7\"");
      panel.markers(eval_loss, "eval_loss_marker", kEvalColor);
    }
    out += "</g>\n";
  }
  const int x_axis_top = kHeaderHeight + 4 * panel_height - kPanelGap;
  absl::StrAppend(&out, "<text x=\"", kMarginLeft + (width - kMarginLeft - kMarginRight) / 2,
                  "\" y=\"", x_axis_top + 32, "\" font-size=\"12\" text-anchor=\"middle\" fill=\"",
                  kTextColor, "\">step</text>\n");
  for (size_t i = 0; i < notes.size(); ++i) {
    absl::StrAppend(&out, "<text class=\"note\" x=\"", kMarginLeft, "\" y=\"",
                    x_axis_top + kXAxisHeight + 10 + static_cast<int>(i) * kNoteLineHeight,
                    "\" font-size=\"11\" fill=\"", kSkipColor, "\">note: ", escape_xml(notes[i]),
                    "</text>\n");
  }
  out += "</svg>\n";
  return out;
}

}  // namespace gdr
