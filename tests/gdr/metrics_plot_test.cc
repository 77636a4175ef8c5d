// gdr/metrics_plot: metrics.jsonl parsing (values, errors with FILE:LINE, non-finite
// values, repeated steps), the 1-2-5 axes and their labels, and the SVG's series and ticks.
#include "gdr/metrics_plot.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace gdr {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

// A training line as the trainer writes it, with the keys the plot ignores too.
std::string train_line(int step, const std::string& loss, const std::string& lr = "0.001",
                       const std::string& grad_norm = "1.5", bool skipped = false) {
  return absl::StrCat("{\"step\":", step, ",\"loss\":", loss,
                      ",\"microbatch_losses\":[5.3,5.5],\"lr\":", lr, ",\"grad_norm\":", grad_norm,
                      ",\"tokens\":512,\"tokens_per_s\":3000.5,\"step_time_s\":0.17,"
                      "\"reduce_time_s\":0.0,\"host_queue_s\":0.15,\"gpu_wait_s\":1.5e-05,"
                      "\"graph_replays\":0,\"skipped\":",
                      skipped ? "true" : "false", "}\n");
}

// The text of every element of `tag` with class `css_class` inside the group of `panel`.
std::vector<std::string> texts(const std::string& svg, const std::string& panel,
                               const std::string& css_class) {
  const size_t begin = svg.find(absl::StrCat("<g id=\"panel-", panel, "\">"));
  const size_t end = svg.find("</g>", begin);
  std::vector<std::string> out;
  if (begin == std::string::npos || end == std::string::npos) return out;
  const std::string group = svg.substr(begin, end - begin);
  const std::string open = absl::StrCat("class=\"", css_class, "\"");
  for (size_t at = group.find(open); at != std::string::npos; at = group.find(open, at + 1)) {
    const size_t text_begin = group.find('>', at) + 1;
    out.push_back(group.substr(text_begin, group.find('<', text_begin) - text_begin));
  }
  return out;
}

// The number of points of each polyline with class `css_class`, in document order.
std::vector<size_t> polyline_sizes(const std::string& svg, const std::string& css_class) {
  std::vector<size_t> sizes;
  const std::string open = absl::StrCat("<polyline class=\"", css_class, "\"");
  for (size_t at = svg.find(open); at != std::string::npos; at = svg.find(open, at + 1)) {
    const size_t points = svg.find("points=\"", at) + 8;
    const std::string list = svg.substr(points, svg.find('"', points) - points);
    sizes.push_back(std::vector<std::string>(absl::StrSplit(list, ' ')).size());
  }
  return sizes;
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

TEST(MetricsPlotParse, TrainAndInterleavedEvalLinesExactly) {
  const std::string text = train_line(1, "5.4", "0.0006", "2.25") +
                           train_line(2, "4.75", "0.0012", "1.125") +
                           "{\"step\":2,\"eval_loss\":4.875,\"eval_perplexity\":130.96}\n" +
                           train_line(3, "3.3", "0.003", "0.5");
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ(log->source, "m.jsonl");
  ASSERT_EQ(log->train.size(), 3u);
  const double loss[] = {5.4, 4.75, 3.3};
  const double lr[] = {0.0006, 0.0012, 0.003};
  const double grad_norm[] = {2.25, 1.125, 0.5};
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(log->train[i].step, i + 1);
    EXPECT_EQ(log->train[i].loss, loss[i]);
    EXPECT_EQ(log->train[i].lr, lr[i]);
    EXPECT_EQ(log->train[i].grad_norm, grad_norm[i]);
    EXPECT_EQ(log->train[i].tokens_per_s, 3000.5);
    EXPECT_FALSE(log->train[i].skipped);
  }
  ASSERT_EQ(log->eval.size(), 1u);
  EXPECT_EQ(log->eval[0].step, 2);
  EXPECT_EQ(log->eval[0].eval_loss, 4.875);
  EXPECT_EQ(log->eval[0].eval_perplexity, 130.96);
  EXPECT_TRUE(log->warnings.empty());
}

TEST(MetricsPlotParse, SkippedMissingMeansFalseAndTrueIsKept) {
  absl::StatusOr<MetricsLog> log =
      parse_metrics("{\"step\":7,\"loss\":2,\"lr\":1,\"grad_norm\":3,\"tokens_per_s\":4}\n" +
                        train_line(8, "null", "0.001", "null", /*skipped=*/true),
                    "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  ASSERT_EQ(log->train.size(), 2u);
  EXPECT_FALSE(log->train[0].skipped);
  EXPECT_TRUE(log->train[1].skipped);
  EXPECT_TRUE(std::isnan(log->train[1].loss));
  EXPECT_TRUE(std::isnan(log->train[1].grad_norm));
}

// The trainer appends: a re-run or a resume repeats steps, the later line wins, one warning.
TEST(MetricsPlotParse, RepeatedStepsLaterLineWins) {
  const std::string text = train_line(1, "5") + train_line(2, "4") + train_line(1, "6") +
                           train_line(2, "3") + train_line(3, "2");
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  ASSERT_EQ(log->train.size(), 3u);
  EXPECT_EQ(log->train[0].loss, 6);
  EXPECT_EQ(log->train[1].loss, 3);
  EXPECT_EQ(log->train[2].loss, 2);
  ASSERT_EQ(log->warnings.size(), 1u);
  EXPECT_THAT(log->warnings[0],
              StartsWith("m.jsonl:3: step 1 appears again (and 1 more repeated steps)"));
}

TEST(MetricsPlotParse, MalformedLineNamesFileAndLine) {
  const std::string text =
      train_line(1, "5") + train_line(2, "4") + "{\"step\":3,\"loss\":\n" + train_line(4, "3");
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "runs/m.jsonl");
  ASSERT_FALSE(log.ok());
  EXPECT_EQ(log.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(log.status().message()),
              StartsWith("runs/m.jsonl:3: not valid JSON: parse error"));
}

TEST(MetricsPlotParse, ErrorsNameFileLineAndWhat) {
  struct Case {
    std::string line;
    std::string error;
  };
  const Case cases[] = {
      {"[1, 2]", "m.jsonl:2: expected a JSON object, got array"},
      {"{\"loss\": 3, \"lr\": 1, \"grad_norm\": 1, \"tokens_per_s\": 1}",
       "m.jsonl:2: missing \"step\""},
      {"{\"step\": 2, \"loss\": 3, \"grad_norm\": 1, \"tokens_per_s\": 1}",
       "m.jsonl:2: missing \"lr\" in a training line (a gdr metrics.jsonl line? see "
       "gdr/metrics_plot.h)"},
      {"{\"step\": 2, \"loss\": \"3.1\", \"lr\": 1, \"grad_norm\": 1, \"tokens_per_s\": 1}",
       "m.jsonl:2: \"loss\" is string, expected a number"},
      {"{\"step\": 2.5, \"loss\": 3}", "m.jsonl:2: \"step\" is 2.5, expected a whole number >= 0"},
      {"{\"step\": -1, \"loss\": 3}", "m.jsonl:2: \"step\" is -1 (< 0)"},
      {"{\"step\": \"2\", \"loss\": 3}", "m.jsonl:2: \"step\" is string, expected a whole number"},
      {"{\"step\": 2, \"loss\": 3, \"lr\": 1, \"grad_norm\": 1, \"tokens_per_s\": 1, "
       "\"skipped\": 0}",
       "m.jsonl:2: \"skipped\" is number, expected true or false"},
      {"{\"step\": 2, \"eval_loss\": [3]}", "m.jsonl:2: \"eval_loss\" is array, expected a number"},
  };
  for (const Case& c : cases) {
    absl::StatusOr<MetricsLog> log = parse_metrics(train_line(1, "5") + c.line + "\n", "m.jsonl");
    ASSERT_FALSE(log.ok()) << c.line;
    EXPECT_EQ(log.status().message(), c.error) << c.line;
  }
}

TEST(MetricsPlotParse, EmptyOrLinelessFileIsAnError) {
  for (const std::string text : {"", "\n  \n\n"}) {
    absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
    ASSERT_FALSE(log.ok());
    EXPECT_EQ(log.status().message(),
              "m.jsonl: empty (no metrics lines; was train.metrics_path set?)");
  }
  absl::StatusOr<MetricsLog> log = parse_metrics("{\"event\": \"start\"}\n", "m.jsonl");
  ASSERT_FALSE(log.ok());
  EXPECT_EQ(log.status().message(),
            "m.jsonl: no training or evaluation lines (no line has \"loss\" or \"eval_loss\")");
}

TEST(MetricsPlotParse, UnknownLinesAndAnIncompleteLastLineAreWarnings) {
  const std::string text = train_line(1, "5") + "{\"event\": \"checkpoint\"}\n" +
                           train_line(2, "4") + "{\"step\":3,\"lo";  // still being written
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  EXPECT_EQ(log->train.size(), 2u);
  EXPECT_THAT(log->warnings,
              ElementsAre("m.jsonl:4: incomplete last line (no newline at the end; a run still "
                          "writing?) skipped",
                          "m.jsonl:2: a line with neither \"loss\" nor \"eval_loss\" skipped"));
}

// nlohmann-json writes NaN / Inf as null; Python writes bare NaN / Infinity. All are gaps.
TEST(MetricsPlotParse, NonFiniteValuesAreNaNWithOneWarningPerKey) {
  const std::string text =
      train_line(1, "5") + train_line(2, "null") + train_line(3, "NaN") +
      train_line(4, "Infinity", "0.001", "-Infinity") + train_line(5, "-Infinity") +
      "{\"step\":5,\"eval_loss\":NaN,\"note\":\"NaN Infinity\"}\n" + train_line(6, "4");
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  ASSERT_EQ(log->train.size(), 6u);
  EXPECT_EQ(log->train[0].loss, 5);
  for (int i = 1; i <= 4; ++i) EXPECT_TRUE(std::isnan(log->train[i].loss)) << i;
  EXPECT_TRUE(std::isnan(log->train[3].grad_norm));
  EXPECT_EQ(log->train[5].loss, 4);
  ASSERT_EQ(log->eval.size(), 1u);
  EXPECT_TRUE(std::isnan(log->eval[0].eval_loss));
  EXPECT_TRUE(std::isnan(log->eval[0].eval_perplexity));  // absent
  EXPECT_THAT(log->warnings,
              ElementsAre("m.jsonl:2: \"loss\" is not finite (null); drawn as a gap (and 3 more "
                          "non-finite \"loss\")",
                          "m.jsonl:4: \"grad_norm\" is not finite (null); drawn as a gap",
                          "m.jsonl:6: \"eval_loss\" is not finite (null); drawn as a gap"));
}

// nlohmann-json refuses a number beyond the double range rather than making it Inf; no
// writer of metrics files produces one, so it stays an error naming the line.
TEST(MetricsPlotParse, NumberOverflowIsAnError) {
  absl::StatusOr<MetricsLog> log = parse_metrics(train_line(1, "5") + train_line(2, "1e999"), "m");
  ASSERT_FALSE(log.ok());
  EXPECT_EQ(log.status().message(), "m:2: not valid JSON: number overflow parsing '1e999'");
}

TEST(MetricsPlotRead, MissingFileAndDirectoryAreErrorsNamingThePath) {
  const std::string dir = ::testing::TempDir();
  const std::string missing = dir + "/no_such_metrics.jsonl";
  absl::StatusOr<MetricsLog> log = read_metrics_file(missing);
  ASSERT_FALSE(log.ok());
  EXPECT_EQ(log.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(log.status().message(), missing + ": cannot open: No such file or directory");

  log = read_metrics_file(dir);
  ASSERT_FALSE(log.ok());
  EXPECT_EQ(log.status().message(), dir + ": is a directory, not a file");

  const std::string path = dir + "/metrics_plot_test.jsonl";
  std::ofstream(path) << train_line(1, "5") << train_line(2, "4") << "oops\n";
  log = read_metrics_file(path);
  ASSERT_FALSE(log.ok());
  EXPECT_THAT(std::string(log.status().message()), StartsWith(path + ":3: not valid JSON: "));
  std::remove(path.c_str());
}

TEST(NiceAxis, OneTwoFiveSteps) {
  NiceAxis axis = nice_axis(3.3, 5.4);  // 2.1 / 0.2 = 11 intervals > 6; 0.5 gives 5
  EXPECT_EQ(axis.step, 0.5);
  EXPECT_THAT(axis.ticks, ElementsAre(3, 3.5, 4, 4.5, 5, 5.5));
  EXPECT_EQ(axis.lo, 3);
  EXPECT_EQ(axis.hi, 5.5);

  axis = nice_axis(1, 60, 10);
  EXPECT_THAT(axis.ticks, ElementsAre(0, 10, 20, 30, 40, 50, 60));

  axis = nice_axis(0.0006, 0.003);
  EXPECT_EQ(axis.step, 0.0005);
  EXPECT_THAT(axis.ticks, ElementsAre(0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003));

  axis = nice_axis(0.1, 0.7);  // ticks are i * m / 10^k, not accumulated sums
  EXPECT_THAT(axis.ticks, ElementsAre(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7));

  axis = nice_axis(1234, 48917);
  EXPECT_EQ(axis.step, 10000);
  EXPECT_THAT(axis.ticks, ElementsAre(0, 10000, 20000, 30000, 40000, 50000));

  axis = nice_axis(-2.5, 1.5);
  EXPECT_THAT(axis.ticks, ElementsAre(-3, -2, -1, 0, 1, 2));
}

TEST(NiceAxis, DegenerateAndExtremeRanges) {
  NiceAxis axis = nice_axis(2, 2);  // widened to 1.9 .. 2.1
  EXPECT_THAT(axis.ticks, ElementsAre(1.9, 1.95, 2, 2.05, 2.1));

  axis = nice_axis(0, 0);
  EXPECT_THAT(axis.ticks, ElementsAre(-1, -0.5, 0, 0.5, 1));

  // No hang, no overflow: ticks exist, are finite and increase.
  for (auto [lo, hi] : {std::pair<double, double>{-1e308, 1e308},
                        {1e300, 1e300},
                        {1e300, 1.0000001e300},
                        {5e-320, 6e-320},
                        {NAN, 1},
                        {7, 3}}) {
    axis = nice_axis(lo, hi);
    ASSERT_GE(axis.ticks.size(), 2u) << lo << " " << hi;
    EXPECT_LT(axis.lo, axis.hi) << lo << " " << hi;
    for (double t : axis.ticks) EXPECT_TRUE(std::isfinite(t)) << lo << " " << hi;
  }
}

TEST(FormatTick, LabelsHaveTheDigitsTheStepNeeds) {
  EXPECT_EQ(format_tick(3, 0.5), "3");
  EXPECT_EQ(format_tick(3.5, 0.5), "3.5");
  EXPECT_EQ(format_tick(0.3, 0.1), "0.3");
  EXPECT_EQ(format_tick(0.25, 0.05), "0.25");
  EXPECT_EQ(format_tick(0.002, 0.001), "0.002");
  EXPECT_EQ(format_tick(0.0015, 0.0005), "1.5e-3");
  EXPECT_EQ(format_tick(0.0005, 0.0005), "5e-4");
  EXPECT_EQ(format_tick(0, 0.0005), "0");
  EXPECT_EQ(format_tick(-2, 1), "-2");
  EXPECT_EQ(format_tick(600, 200), "600");
  EXPECT_EQ(format_tick(12000, 2000), "12k");
  EXPECT_EQ(format_tick(12500, 500), "12500");
  EXPECT_EQ(format_tick(2500000, 500000), "2500k");
  EXPECT_EQ(format_tick(3000000, 1000000), "3M");
}

TEST(MetricsPlotSvg, PolylinesTicksAndTitle) {
  // Loss 5.4 .. 3.3 over steps 1..8.
  const char* losses[] = {"5.4", "5.1", "4.7", "4.4", "4", "3.8", "3.5", "3.3"};
  std::string text;
  for (int i = 0; i < 8; ++i) text += train_line(i + 1, losses[i], "0.001", "1.5");
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  PlotOptions options;
  options.title = "tiny <run> & co";
  const std::string svg = render_metrics_svg(*log, options);

  EXPECT_THAT(svg, StartsWith("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg "));
  EXPECT_THAT(svg, HasSubstr("</svg>\n"));
  EXPECT_THAT(svg, HasSubstr("<title>tiny &lt;run&gt; &amp; co</title>"));
  for (const char* key : {"loss", "lr", "grad_norm", "tokens_per_s"}) {
    EXPECT_THAT(polyline_sizes(svg, key), ElementsAre(8u)) << key;
  }
  EXPECT_THAT(texts(svg, "loss", "ytick"), ElementsAre("3", "3.5", "4", "4.5", "5", "5.5"));
  // A constant series: the axis is widened by 5% around it.
  EXPECT_THAT(texts(svg, "grad_norm", "ytick"), ElementsAre("1.4", "1.45", "1.5", "1.55", "1.6"));
  // The step axis is labelled under the last panel only.
  EXPECT_THAT(texts(svg, "tokens_per_s", "xtick"),
              ElementsAre("1", "2", "3", "4", "5", "6", "7", "8"));
  EXPECT_TRUE(texts(svg, "loss", "xtick").empty());
  EXPECT_THAT(svg, HasSubstr("min 3.3 @ step 8  \xC2\xB7  max 5.4 @ step 1  \xC2\xB7  last 3.3"));
  EXPECT_THAT(svg, Not(HasSubstr("note:")));
}

TEST(MetricsPlotSvg, NaNAndSkippedStepsAreGapsAndCounted) {
  std::string text;
  for (int step = 1; step <= 10; ++step) {
    if (step == 4) {
      text += train_line(step, "NaN");  // a gap in loss only
    } else if (step == 7) {
      text += train_line(step, "null", "0.001", "null", /*skipped=*/true);  // a gap everywhere
    } else {
      text += train_line(step, absl::StrCat(5 - 0.1 * step), "0.001", absl::StrCat(step));
    }
  }
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  const std::string svg = render_metrics_svg(*log);
  // loss: 1-3 | 5-6 | 8-10; grad_norm and the others: 1-6 | 8-10.
  EXPECT_THAT(polyline_sizes(svg, "loss"), ElementsAre(3u, 2u, 3u));
  EXPECT_THAT(polyline_sizes(svg, "grad_norm"), ElementsAre(6u, 3u));
  EXPECT_THAT(polyline_sizes(svg, "lr"), ElementsAre(6u, 3u));
  EXPECT_EQ(count(svg, "class=\"skipped\""), 4u);  // one red line per panel
  EXPECT_THAT(texts(svg, "loss", "ytick"), ElementsAre("4", "4.2", "4.4", "4.6", "4.8", "5"));
  EXPECT_THAT(svg, HasSubstr("note: 2 non-finite loss values (NaN/Inf) drawn as gaps"));
  EXPECT_THAT(svg, HasSubstr("note: 1 non-finite grad_norm value (NaN/Inf) drawn as gaps"));
  EXPECT_THAT(svg, HasSubstr("note: 1 skipped step ("));
  EXPECT_THAT(svg, Not(HasSubstr("nan")));
  EXPECT_THAT(svg, Not(HasSubstr("inf")));
}

TEST(MetricsPlotSvg, EvalLossBesideTrainLoss) {
  std::string text;
  for (int step = 1; step <= 6; ++step) {
    text += train_line(step, absl::StrCat(5 - 0.25 * step));
    if (step % 3 == 0)
      text += absl::StrCat("{\"step\":", step, ",\"eval_loss\":", 6 - 0.5 * step,
                           ",\"eval_perplexity\":1}\n");
  }
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  const std::string svg = render_metrics_svg(*log);
  EXPECT_THAT(polyline_sizes(svg, "loss"), ElementsAre(6u));
  EXPECT_THAT(polyline_sizes(svg, "eval_loss"), ElementsAre(2u));
  EXPECT_EQ(count(svg, "class=\"eval_loss_marker\""), 2u);
  // The loss axis covers both series: train 3.5 .. 4.75, eval 3 .. 4.5.
  EXPECT_THAT(texts(svg, "loss", "ytick"), ElementsAre("3", "3.5", "4", "4.5", "5"));
  EXPECT_THAT(svg, HasSubstr("eval loss (last 3)"));
}

TEST(MetricsPlotSvg, EvalOnlyAndAllNaNStillDraw) {
  absl::StatusOr<MetricsLog> log =
      parse_metrics("{\"step\":10,\"eval_loss\":3.5}\n{\"step\":20,\"eval_loss\":3.25}\n", "m");
  ASSERT_TRUE(log.ok()) << log.status();
  std::string svg = render_metrics_svg(*log);
  EXPECT_THAT(polyline_sizes(svg, "eval_loss"), ElementsAre(2u));
  EXPECT_EQ(count(svg, "no finite values"), 3u);  // lr, grad_norm, tokens/s

  log = parse_metrics(train_line(1, "NaN") + train_line(2, "null"), "m");
  ASSERT_TRUE(log.ok()) << log.status();
  svg = render_metrics_svg(*log);
  EXPECT_TRUE(polyline_sizes(svg, "loss").empty());
  EXPECT_EQ(count(svg, "no finite values"), 1u);
}

// A long run: at most four points per pixel column, and the spike survives.
TEST(MetricsPlotSvg, LongRunsAreThinnedKeepingExtremes) {
  std::string text;
  for (int step = 1; step <= 20000; ++step) {
    text += train_line(step, step == 12345 ? "9.75" : "2.5");
  }
  absl::StatusOr<MetricsLog> log = parse_metrics(text, "m.jsonl");
  ASSERT_TRUE(log.ok()) << log.status();
  const std::string svg = render_metrics_svg(*log);
  const std::vector<size_t> sizes = polyline_sizes(svg, "loss");
  ASSERT_EQ(sizes.size(), 1u);
  EXPECT_LE(sizes[0], 4u * 900u);
  EXPECT_GE(sizes[0], 800u);
  EXPECT_THAT(svg, HasSubstr("max 9.75 @ step 12345"));
  EXPECT_THAT(texts(svg, "loss", "ytick"), ElementsAre("2", "4", "6", "8", "10"));
  EXPECT_LT(svg.size(), 150u * 1024u);
}

}  // namespace
}  // namespace gdr
