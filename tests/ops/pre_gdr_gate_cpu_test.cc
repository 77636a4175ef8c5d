// The CPU registry of the pre-GDR gate: every (dtype x shape x mode x override) case
// checked without a GPU: tile selection, scratch sizing, launch-parameter derivation,
// reference math against libtorch autograd of the unfused formulas, and the exact error
// messages for bad input.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "kernels/pre_gdr_gate/pre_gdr_gate.h"
#include "ops/autotune/autotune.h"
#include "ops/policy/determinism.h"
#include "ops/policy/execution_policy.h"
#include "ops/pre_gdr_gate/pre_gdr_gate_op.h"
#include "tests/ops/error_of.h"
#include "tests/ops/policy_for_test.h"

namespace gdr {
namespace {

using kernels::GateShape;
using kernels::GateTile;

// A policy that differs from the defaults in the gate backward's fixed tile only.
ExecutionPolicy with_gate_tile(std::optional<GateTile> tile) {
  ExecutionPolicy policy;
  policy.gate_tile = tile;
  return policy;
}

struct ShapeCase {
  const char* name;
  int64_t dim0, dim1, heads;
};

const std::vector<ShapeCase>& shape_cases() {
  static const std::vector<ShapeCase> cases = {
      {"one_token_one_head", 1, 1, 1},   {"tail_37x5", 2, 37, 5},
      {"qwen0p8b_8192x16", 1, 8192, 16}, {"tail_513x33", 1, 513, 33},
      {"batch4_100x48", 4, 100, 48},     {"large_65536x64", 8, 8192, 64},
  };
  return cases;
}

// ---------------------------------------------------------------------------
// Selection, sizing and launch parameters.

struct SelectionCase {
  ShapeCase shape;
  std::string dtype_key;
  bool deterministic;
  std::optional<GateTile> override_tile;
};

std::string selection_case_name(const testing::TestParamInfo<SelectionCase>& info) {
  const SelectionCase& c = info.param;
  std::string name =
      std::string(c.shape.name) + "_" + c.dtype_key + "_" +
      (c.deterministic ? "deterministic" : "default") + "_" +
      (c.override_tile ? "override_" + kernels::to_string(*c.override_tile) : "no_override");
  for (char& ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  return name;
}

std::vector<SelectionCase> all_selection_cases() {
  std::vector<SelectionCase> cases;
  for (const ShapeCase& shape : shape_cases()) {
    for (const char* dtype : {"in_f32_param_f32", "in_bf16_param_f32", "in_f16_param_bf16"}) {
      for (bool deterministic : {false, true}) {
        for (std::optional<GateTile> tile :
             {std::optional<GateTile>{}, std::optional<GateTile>{GateTile{64, 16, 128}},
              std::optional<GateTile>{GateTile{100, 32, 256}}}) {
          cases.push_back({shape, dtype, deterministic, tile});
        }
      }
    }
  }
  return cases;
}

class GateSelectionTest : public testing::TestWithParam<SelectionCase> {
 protected:
  void SetUp() override { clear_autotune_cache(); }
};

TEST_P(GateSelectionTest, PicksTheTileTheRulesSayAndSizesEverythingFromIt) {
  const SelectionCase& c = GetParam();
  const GateShape shape{c.shape.dim0, c.shape.dim1, c.shape.heads};
  const ExecutionPolicyGuard policy(with_gate_tile(c.override_tile));
  const auto& candidates = kernels::pre_gdr_gate_candidate_tiles();

  // Fake timings that prefer one specific candidate, so the timed choice is known.
  const size_t fastest =
      (static_cast<size_t>(shape.tokens()) * 7 + shape.heads) % candidates.size();
  std::map<std::string, int> timed;
  auto time_ms = [&](const GateTile& tile) {
    ++timed[kernels::to_string(tile)];
    return tile == candidates[fastest] ? 0.5 : 1.0 + 0.01 * tile.block_t;
  };

  const TileSelection<GateTile> first =
      select_pre_gdr_gate_tile(shape, c.dtype_key, 0, c.deterministic, time_ms);
  const TileSelection<GateTile> second =
      select_pre_gdr_gate_tile(shape, c.dtype_key, 0, c.deterministic, time_ms);
  EXPECT_EQ(first.config, second.config);

  if (c.override_tile) {
    EXPECT_EQ(first.config, *c.override_tile);
    EXPECT_EQ(first.source, SelectionSource::kOverride);
    EXPECT_TRUE(timed.empty()) << "an override must not time anything";
  } else if (c.deterministic) {
    // Pure function of the shape: the minimum of the static cost, no timing at all.
    size_t best = 0;
    for (size_t i = 1; i < candidates.size(); ++i) {
      if (kernels::gate_tile_static_cost(candidates[i], shape) <
          kernels::gate_tile_static_cost(candidates[best], shape)) {
        best = i;
      }
    }
    EXPECT_EQ(first.config, candidates[best]);
    EXPECT_EQ(first.source, SelectionSource::kStaticCost);
    EXPECT_TRUE(timed.empty()) << "deterministic mode must not time candidates";
    EXPECT_EQ(autotune_cache_size(), 0) << "deterministic mode must not touch the tuned table";
  } else {
    EXPECT_EQ(first.config, candidates[fastest]);
    EXPECT_EQ(first.source, SelectionSource::kAutotuneTimed);
    EXPECT_EQ(second.source, SelectionSource::kAutotuneCache);
    EXPECT_EQ(timed.size(), candidates.size()) << "every candidate is timed once";
    for (const auto& [tile, count] : timed) EXPECT_EQ(count, 1) << tile;
  }

  // Note [Gate tile decides everything]: grid, rows, shared memory and scratch.
  const GateTile& tile = first.config;
  ASSERT_EQ(kernels::validate_gate_tile(tile), "");
  const kernels::GateBackwardLaunch launch = kernels::derive_gate_backward_launch(tile, shape);
  EXPECT_GE(launch.programs_t * tile.block_t, shape.tokens());
  EXPECT_LT((launch.programs_t - 1) * tile.block_t, shape.tokens());
  EXPECT_GE(launch.programs_h * tile.block_h, shape.heads);
  EXPECT_LT((launch.programs_h - 1) * tile.block_h, shape.heads);
  EXPECT_EQ(launch.rows * tile.block_h, tile.threads);
  // See Note [Gate backward virtual rows]: kGateVirtualRowsPerRow virtual rows per token row,
  // which are exactly the vectorised pass's thread rows (kGateVirtualRowsPerRow heads
  // per thread), and two FP32 sums per virtual row and head in shared memory.
  EXPECT_EQ(launch.virtual_rows, kernels::kGateVirtualRowsPerRow * launch.rows);
  if (tile.block_h % kernels::kGateVirtualRowsPerRow == 0) {
    EXPECT_EQ(launch.virtual_rows * (tile.block_h / kernels::kGateVirtualRowsPerRow), tile.threads);
  }
  EXPECT_EQ(launch.shared_bytes, 2 * launch.virtual_rows * tile.block_h * 4);
  EXPECT_EQ(launch.scratch_floats, launch.programs_t * 2 * shape.heads);
}

INSTANTIATE_TEST_SUITE_P(Registry, GateSelectionTest, testing::ValuesIn(all_selection_cases()),
                         selection_case_name);

TEST(GateSelection, KeysSeparateShapesDtypesAndDevices) {
  clear_autotune_cache();
  int calls = 0;
  auto time_ms = [&](const GateTile&) { return static_cast<double>(++calls); };
  select_pre_gdr_gate_tile({1, 8192, 16}, "in_bf16", 0, false, time_ms);
  select_pre_gdr_gate_tile({1, 8000, 16}, "in_bf16", 0, false, time_ms);  // same bucket
  EXPECT_EQ(autotune_cache_size(), 1);
  select_pre_gdr_gate_tile({1, 8192, 32}, "in_bf16", 0, false, time_ms);
  select_pre_gdr_gate_tile({1, 8192, 16}, "in_f32", 0, false, time_ms);
  select_pre_gdr_gate_tile({1, 8192, 16}, "in_bf16", 1, false, time_ms);
  EXPECT_EQ(autotune_cache_size(), 4);
  EXPECT_EQ(calls, 4 * static_cast<int>(kernels::pre_gdr_gate_candidate_tiles().size()));
}

TEST(GateSelection, DeterministicRuleAvoidsWastedLanesAndTinyTilesAtScale) {
  // Hv = 16 must not pick block_h 64 (three quarters of the lanes idle).
  for (const ShapeCase& c : shape_cases()) {
    const GateShape shape{c.dim0, c.dim1, c.heads};
    const TileSelection<GateTile> pick =
        select_pre_gdr_gate_tile(shape, "k", 0, /*deterministic=*/true, nullptr);
    EXPECT_LE(pick.config.block_h, std::max<int64_t>(16, c.heads)) << c.name;
    const auto launch = kernels::derive_gate_backward_launch(pick.config, shape);
    EXPECT_LE(launch.programs_t, 2048) << c.name << " picks " << kernels::to_string(pick.config);
  }
}

TEST(GateSelection, SinglePassIsPreferredForSmallEagerProblemsOnly) {
  // Both ordered variants give the same bits; the rule trades the single pass's
  // one-block tail against the host cost of a second launch, which only eager calls pay
  // (kernels/pre_gdr_gate/pre_gdr_gate.h). Up to 2^19 elements with at most 256 programs per head
  // column: single pass when eager, two pass under graph capture. Larger: two pass.
  auto preferred = [](int64_t tokens, int64_t heads, bool capturing) {
    const kernels::GateShape shape{1, tokens, heads};
    const kernels::GateTile tile =
        select_pre_gdr_gate_tile(shape, "bf16", 0, /*deterministic=*/true, nullptr, 2).config;
    return kernels::gate_single_pass_preferred(
        tile, kernels::derive_gate_backward_launch(tile, shape), shape, capturing);
  };
  EXPECT_TRUE(preferred(8192, 16, /*capturing=*/false)) << "0.8B shape: 256 programs";
  EXPECT_FALSE(preferred(8192, 16, /*capturing=*/true)) << "graphs take the two pass";
  EXPECT_TRUE(preferred(16384, 32, false)) << "2^19 elements, two columns of 256 programs";
  EXPECT_FALSE(preferred(32768, 48, false)) << "more than 2^19 elements";
  EXPECT_FALSE(preferred(65536, 64, false));
  const kernels::GateShape small{1, 1024, 16};
  const kernels::GateTile narrow{64, 16, 128};
  EXPECT_FALSE(kernels::gate_single_pass_preferred(
      narrow, kernels::derive_gate_backward_launch(narrow, small), small, false))
      << "a 128-thread tile cannot run the single-pass tail";
  const kernels::GateTile wide{64, 16, 256};
  EXPECT_TRUE(kernels::gate_single_pass_preferred(
      wide, kernels::derive_gate_backward_launch(wide, small), small, false));
  const kernels::GateShape long_few_heads{1, 1 << 15, 16};  // 2^19 elements, 1024 programs
  const kernels::GateTile short_tile{32, 16, 256};
  EXPECT_FALSE(kernels::gate_single_pass_preferred(
      short_tile, kernels::derive_gate_backward_launch(short_tile, long_few_heads), long_few_heads,
      false))
      << "more than one tail round";
}

TEST(GateSelection, SinglePassSaysWhyItCannotRun) {
  const kernels::GateShape shape{1, 1000, 16};
  const kernels::GateTile narrow{64, 16, 128};
  EXPECT_EQ(kernels::gate_single_pass_unsupported_reason(
                narrow, kernels::derive_gate_backward_launch(narrow, shape)),
            "needs a tile of at least 256 threads (got 64x16x128)");
  // 200 heads in 16-head columns: 13 columns, one ticket counter each, 8 per slot.
  const kernels::GateShape many_heads{1, 1000, 200};
  const kernels::GateTile tile{64, 16, 256};
  EXPECT_EQ(kernels::gate_single_pass_unsupported_reason(
                tile, kernels::derive_gate_backward_launch(tile, many_heads)),
            "needs at most 8 head columns of programs (got 13 with tile 64x16x256)");
  EXPECT_TRUE(kernels::gate_single_pass_supported(
      kernels::GateTile{64, 32, 256},
      kernels::derive_gate_backward_launch(kernels::GateTile{64, 32, 256}, many_heads)))
      << "32-head columns: 7";
  // 2^31 partial sums: 2^30 tokens in 32-token programs x 2 x 64 heads.
  const kernels::GateShape huge{1, int64_t{1} << 30, 64};
  const kernels::GateTile fine{32, 64, 256};
  EXPECT_EQ(kernels::gate_single_pass_unsupported_reason(
                fine, kernels::derive_gate_backward_launch(fine, huge)),
            "needs fewer than 2^31 partial sums (got 4294967296)");
}

TEST(GateSelection, TheStaticRulePicksTheSweptBestOrderedTilesAtTheLargeShape) {
  // bench/pre_gdr_gate_bench --tiles on the H200 (docs/benchmarks.md): at 65536 x 64 the
  // fastest ordered tiles were 256x32x256 class for BF16 and 128x64x256 for FP32.
  const kernels::GateShape large{1, 65536, 64};
  EXPECT_EQ(select_pre_gdr_gate_tile(large, "bf16", 0, /*deterministic=*/true, nullptr, 2).config,
            (kernels::GateTile{256, 32, 256}));
  EXPECT_EQ(select_pre_gdr_gate_tile(large, "f32", 0, /*deterministic=*/true, nullptr, 4).config,
            (kernels::GateTile{128, 64, 256}));
  const kernels::GateShape small{1, 8192, 16};
  EXPECT_EQ(select_pre_gdr_gate_tile(small, "f32", 0, /*deterministic=*/true, nullptr, 4).config,
            (kernels::GateTile{32, 16, 256}));
}

TEST(GateSelection, WithoutTimingACacheMissTakesTheStaticRuleAndDoesNotCacheIt) {
  // What the CUDA op does while a stream captures a CUDA graph.
  clear_autotune_cache();
  const GateShape shape{1, 8192, 16};
  const TileSelection<GateTile> untimed = select_pre_gdr_gate_tile(shape, "k", 0, false, nullptr);
  EXPECT_EQ(untimed.source, SelectionSource::kStaticCost);
  EXPECT_EQ(untimed.config, select_pre_gdr_gate_tile(shape, "k", 0, true, nullptr).config);
  EXPECT_EQ(autotune_cache_size(), 0);
  const auto& candidates = kernels::pre_gdr_gate_candidate_tiles();
  auto time_ms = [&](const GateTile& tile) { return tile == candidates.back() ? 0.1 : 1.0; };
  EXPECT_EQ(select_pre_gdr_gate_tile(shape, "k", 0, false, time_ms).config, candidates.back());
  const TileSelection<GateTile> cached = select_pre_gdr_gate_tile(shape, "k", 0, false, nullptr);
  EXPECT_EQ(cached.source, SelectionSource::kAutotuneCache);
  EXPECT_EQ(cached.config, candidates.back());
}

TEST(GateSelection, Fp32ActivationsAimAtFewerLargerProgramsThanBf16) {
  // Twice the bytes per element: the rule's program target drops from 640 to 448.
  const GateShape shape{1, 32768, 48};
  const GateTile bf16 = select_pre_gdr_gate_tile(shape, "k", 0, true, nullptr, 2).config;
  const GateTile fp32 = select_pre_gdr_gate_tile(shape, "k", 0, true, nullptr, 4).config;
  EXPECT_EQ(bf16, (GateTile{128, 16, 256}));
  EXPECT_EQ(fp32, (GateTile{256, 16, 256}));
}

// See Note [Gate per-shape tile cache]: the CUDA op's hot-path selection.
struct CachedSelectionProbe {
  int timer_factories = 0, timings = 0, dtype_keys = 0;
  bool can_time = true;
  TileSelection<GateTile> select(const GateShape& shape, bool deterministic, int bytes = 2) {
    GateSelectionKey key;
    key.shape = shape;
    key.input_dtype = bytes == 2 ? 15 : 6;
    key.param_dtype = 6;
    key.input_element_bytes = bytes;
    const auto& candidates = kernels::pre_gdr_gate_candidate_tiles();
    return select_pre_gdr_gate_tile_cached(
        key, deterministic,
        [&] {
          ++dtype_keys;
          return std::string("probe_bytes=") + std::to_string(bytes);
        },
        [&]() -> std::function<double(const GateTile&)> {
          ++timer_factories;
          if (!can_time) return nullptr;
          return [&](const GateTile& tile) {
            ++timings;
            return tile == candidates[3] ? 0.1 : 1.0;
          };
        });
  }
};

TEST(GateCachedSelection, DeterministicModeCachesTheStaticRulePerExactShapeWithoutTiming) {
  clear_autotune_cache();
  CachedSelectionProbe probe;
  for (const ShapeCase& c : shape_cases()) {
    const GateShape shape{c.dim0, c.dim1, c.heads};
    for (int bytes : {2, 4}) {
      const auto first = probe.select(shape, true, bytes);
      const auto second = probe.select(shape, true, bytes);
      const auto slow = select_pre_gdr_gate_tile(shape, "k", 0, true, nullptr, bytes);
      EXPECT_EQ(first.config, slow.config) << c.name;
      EXPECT_EQ(second.config, slow.config) << c.name;
      EXPECT_EQ(first.source, SelectionSource::kStaticCost);
      EXPECT_EQ(second.source, SelectionSource::kStaticCost);
    }
  }
  EXPECT_EQ(probe.timer_factories, 0) << "deterministic mode never times";
  EXPECT_EQ(probe.timings, 0);
  EXPECT_EQ(probe.dtype_keys, 2 * static_cast<int>(shape_cases().size()))
      << "one miss per shape and dtype, then the cache answers";
  EXPECT_EQ(autotune_cache_size(), 0) << "deterministic mode must not touch the tuned table";
  // A token count in the same power-of-two bucket is still a different shape to the rule.
  const auto other = probe.select({1, 8000, 16}, true);
  EXPECT_EQ(other.config, select_pre_gdr_gate_tile({1, 8000, 16}, "k", 0, true, nullptr).config);
}

TEST(GateCachedSelection, DefaultModeTimesOncePerBucketAndForgetsWithTheAutotuneCache) {
  clear_autotune_cache();
  CachedSelectionProbe probe;
  const auto& candidates = kernels::pre_gdr_gate_candidate_tiles();
  const auto first = probe.select({1, 8192, 16}, false);
  EXPECT_EQ(first.config, candidates[3]);
  EXPECT_EQ(first.source, SelectionSource::kAutotuneTimed);
  EXPECT_EQ(probe.timings, static_cast<int>(candidates.size()));
  const auto again = probe.select({1, 8000, 16}, false);  // same bucket
  EXPECT_EQ(again.config, candidates[3]);
  EXPECT_EQ(again.source, SelectionSource::kAutotuneCache);
  EXPECT_EQ(probe.timer_factories, 1);
  EXPECT_EQ(probe.dtype_keys, 1) << "a hit builds no string key";
  clear_autotune_cache();
  EXPECT_EQ(probe.select({1, 8192, 16}, false).source, SelectionSource::kAutotuneTimed);
  EXPECT_EQ(probe.timer_factories, 2);
}

TEST(GateCachedSelection, AnUntimedChoiceIsNotCachedAndTheOverrideAlwaysWins) {
  clear_autotune_cache();
  CachedSelectionProbe probe;
  probe.can_time = false;  // as during CUDA graph capture
  const GateShape shape{1, 4096, 32};
  EXPECT_EQ(probe.select(shape, false).source, SelectionSource::kStaticCost);
  EXPECT_EQ(probe.select(shape, false).source, SelectionSource::kStaticCost);
  EXPECT_EQ(probe.timer_factories, 2) << "the untimed choice must not be cached";
  probe.can_time = true;
  EXPECT_EQ(probe.select(shape, false).source, SelectionSource::kAutotuneTimed);
  {
    const ExecutionPolicyGuard pinned_tile(with_gate_tile(GateTile{64, 32, 128}));
    for (bool deterministic : {false, true}) {
      const auto pinned = probe.select(shape, deterministic);
      EXPECT_EQ(pinned.config, (GateTile{64, 32, 128}));
      EXPECT_EQ(pinned.source, SelectionSource::kOverride);
    }
  }
  EXPECT_EQ(probe.select(shape, false).source, SelectionSource::kAutotuneCache);
}

TEST(GateAutograd, WithoutGradientsTheForwardSkipsTheAutogradNodeAndGivesTheSameBits) {
  at::manual_seed(3);
  const at::Tensor a = at::randn({2, 50, 12}), b = at::randn({2, 50, 12});
  const at::Tensor A_log = at::randn({12}), dt_bias = at::randn({12});
  auto [g_plain, beta_plain] = pre_gdr_gate(a, b, A_log, dt_bias);
  EXPECT_FALSE(g_plain.grad_fn());
  const at::Tensor a_req = a.detach().requires_grad_(true);
  auto [g_graph, beta_graph] = pre_gdr_gate(a_req, b, A_log, dt_bias);
  EXPECT_TRUE(g_graph.grad_fn() != nullptr);
  {
    c10::NoGradGuard no_grad;
    auto [g_nograd, beta_nograd] = pre_gdr_gate(a_req, b, A_log, dt_bias);
    EXPECT_FALSE(g_nograd.grad_fn());
    EXPECT_TRUE(at::equal(g_nograd, g_graph));
  }
  EXPECT_TRUE(at::equal(g_plain, g_graph.detach()));
  EXPECT_TRUE(at::equal(beta_plain, beta_graph.detach()));
}

TEST(GateTileOverride, ParsesTheEnvironmentFormat) {
  const test_support::PolicyForTest policy("GDR_PRE_GDR_GATE_TILE", "128x16x256");
  EXPECT_EQ(current_execution_policy().gate_tile, (GateTile{128, 16, 256}));
}

using test_support::error_of;
using test_support::policy_error;

TEST(GateTileOverride, RefusesImpossibleTilesWithAClearMessage) {
  EXPECT_EQ(policy_error("GDR_PRE_GDR_GATE_TILE", "128x16"),
            "GDR_PRE_GDR_GATE_TILE: expected auto or a tile BLOCK_TxBLOCK_HxTHREADS of positive "
            "integers (e.g. 128x16x256), but got '128x16'");
  EXPECT_EQ(policy_error("GDR_PRE_GDR_GATE_TILE", "128xAx256"),
            "GDR_PRE_GDR_GATE_TILE: expected auto or a tile BLOCK_TxBLOCK_HxTHREADS of positive "
            "integers (e.g. 128x16x256), but got '128xAx256'");
  EXPECT_EQ(policy_error("GDR_PRE_GDR_GATE_TILE", "128x16x100"),
            "GDR_PRE_GDR_GATE_TILE: tile 128x16x100 cannot be launched: threads must be a "
            "multiple of 32 in [32, 1024], got 100");
  EXPECT_EQ(policy_error("GDR_PRE_GDR_GATE_TILE", "128x48x256"),
            "GDR_PRE_GDR_GATE_TILE: tile 128x48x256 cannot be launched: block_h must divide "
            "threads (256), got 48");
  // A policy built in code may hold any tile: the backward's tile choice refuses it.
  const ExecutionPolicyGuard policy(with_gate_tile(GateTile{4, 16, 256}));
  EXPECT_EQ(error_of([] {
              select_pre_gdr_gate_tile({1, 64, 16}, "in_f32_param_f32", 0, false,
                                       [](const GateTile&) { return 1.0; });
            }),
            "pre_gdr_gate_backward: the execution policy's pre_gdr_gate_tile 4x16x256 cannot be "
            "launched: block_t must be in [threads / block_h = 16, 65536], got 4");
}

TEST(GateTileOverride, EnvironmentVariableIsReadAndValidated) {
  {
    const test_support::PolicyForTest policy("GDR_PRE_GDR_GATE_TILE", "256x32x128");
    EXPECT_EQ(current_execution_policy().gate_tile, (GateTile{256, 32, 128}));
    EXPECT_EQ(policy_error("GDR_PRE_GDR_GATE_TILE", "0x16x128"),
              "GDR_PRE_GDR_GATE_TILE: expected auto or a tile BLOCK_TxBLOCK_HxTHREADS of positive "
              "integers (e.g. 128x16x256), but got '0x16x128'");
    const ExecutionPolicyGuard inner(with_gate_tile(GateTile{32, 16, 128}));  // the inner one wins
    EXPECT_EQ(current_execution_policy().gate_tile, (GateTile{32, 16, 128}));
  }
  EXPECT_EQ(current_execution_policy().gate_tile, std::nullopt);
}

// ---------------------------------------------------------------------------
// Deterministic-mode resolution.

TEST(DeterministicMode, OverrideThenEnvironmentThenPyTorchSwitch) {
  unsetenv("GDR_DETERMINISTIC");
  at::globalContext().setDeterministicAlgorithms(false, false);
  EXPECT_FALSE(use_deterministic_mode());
  at::globalContext().setDeterministicAlgorithms(true, false);
  EXPECT_TRUE(use_deterministic_mode());
  setenv("GDR_DETERMINISTIC", "0", 1);
  EXPECT_FALSE(use_deterministic_mode());
  {
    DeterministicModeGuard guard(true);
    EXPECT_TRUE(use_deterministic_mode());
  }
  EXPECT_FALSE(use_deterministic_mode());
  setenv("GDR_DETERMINISTIC", "maybe", 1);
  EXPECT_EQ(error_of([] { use_deterministic_mode(); }),
            "environment variable GDR_DETERMINISTIC must be a boolean (1/true/on/yes or "
            "0/false/off/no), but got 'maybe'");
  unsetenv("GDR_DETERMINISTIC");
  at::globalContext().setDeterministicAlgorithms(false, false);
}

// ---------------------------------------------------------------------------
// Reference math: the CPU op against libtorch autograd of the unfused formulas.

struct MathCase {
  ShapeCase shape;
  at::ScalarType input_dtype;
  at::ScalarType param_dtype;
  const char* regime;  // "normal", "large_pre" (pre > 20), "very_negative_pre"
};

std::string math_case_name(const testing::TestParamInfo<MathCase>& info) {
  const MathCase& c = info.param;
  return std::string(c.shape.name) + "_" + c10::toString(c.input_dtype) + "_param" +
         c10::toString(c.param_dtype) + "_" + c.regime;
}

std::vector<MathCase> all_math_cases() {
  std::vector<MathCase> cases;
  for (const ShapeCase& shape : shape_cases()) {
    if (shape.dim0 * shape.dim1 * shape.heads > 200000) continue;  // keep CPU time small
    for (at::ScalarType in : {at::kFloat, at::kHalf, at::kBFloat16}) {
      for (at::ScalarType param : {at::kFloat, at::kBFloat16}) {
        for (const char* regime : {"normal", "large_pre", "very_negative_pre"}) {
          cases.push_back({shape, in, param, regime});
        }
      }
    }
  }
  return cases;
}

class GateMathTest : public testing::TestWithParam<MathCase> {};

TEST_P(GateMathTest, CpuOpMatchesAutogradOfTheUnfusedFormulas) {
  const MathCase& c = GetParam();
  at::manual_seed(1234);
  const double offset = std::string(c.regime) == "large_pre"           ? 24.0
                        : std::string(c.regime) == "very_negative_pre" ? -40.0
                                                                       : 0.0;
  at::Tensor a =
      (at::randn({c.shape.dim0, c.shape.dim1, c.shape.heads}) * 2 + offset).to(c.input_dtype);
  at::Tensor b = (at::randn({c.shape.dim0, c.shape.dim1, c.shape.heads}) * 3).to(c.input_dtype);
  at::Tensor A_log = at::log(at::rand({c.shape.heads}) * 15.99 + 0.01).to(c.param_dtype);
  at::Tensor dt_bias = (at::randn({c.shape.heads}) * 0.5 + 1).to(c.param_dtype);
  at::Tensor grad_g = at::randn({c.shape.dim0, c.shape.dim1, c.shape.heads});
  at::Tensor grad_beta = at::randn({c.shape.dim0, c.shape.dim1, c.shape.heads});

  auto run = [&](bool fused) {
    at::Tensor a_ = a.detach().requires_grad_(true), b_ = b.detach().requires_grad_(true);
    at::Tensor A_ = A_log.detach().requires_grad_(true),
               dt_ = dt_bias.detach().requires_grad_(true);
    auto [g, beta] =
        fused ? pre_gdr_gate(a_, b_, A_, dt_) : pre_gdr_gate_composite(a_, b_, A_, dt_);
    auto grads = torch::autograd::grad({g, beta}, {a_, b_, A_, dt_}, {grad_g, grad_beta});
    return std::vector<at::Tensor>{g, beta, grads[0], grads[1], grads[2], grads[3]};
  };
  const auto fused = run(true);
  const auto reference = run(false);
  const char* names[] = {"g", "beta", "da", "db", "dA_log", "ddt_bias"};
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(fused[i].scalar_type(), reference[i].scalar_type()) << names[i];
    EXPECT_EQ(fused[i].sizes(), reference[i].sizes()) << names[i];
  }
  EXPECT_EQ(fused[0].scalar_type(), at::kFloat);
  EXPECT_EQ(fused[1].scalar_type(), at::kFloat);
  EXPECT_TRUE((fused[0] <= 0).all().item<bool>()) << "g must never be positive";
  // Elementwise outputs: FP32 math on both sides, a few ulps apart (libm vs ATen's
  // vectorised exp/log1p). Gradients in a low-precision dtype differ by one rounding.
  const double elem_rtol = c.input_dtype == at::kFloat ? 1e-5 : 1e-2;
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(at::allclose(fused[i].to(at::kFloat), reference[i].to(at::kFloat),
                             i < 2 ? 1e-5 : elem_rtol, 1e-6))
        << names[i] << " max abs diff "
        << (fused[i].to(at::kFloat) - reference[i].to(at::kFloat)).abs().max().item<float>();
  }
  // Per-head sums: ours accumulates in FP64, ATen's sum in FP32 (pairwise).
  const double sum_rtol = c.param_dtype == at::kFloat ? 1e-4 : 1e-2;
  for (int i = 4; i < 6; ++i) {
    const at::Tensor x = fused[i].to(at::kDouble), y = reference[i].to(at::kDouble);
    const double scale = y.abs().max().item<double>() + 1e-6;
    EXPECT_LE((x - y).abs().max().item<double>(), sum_rtol * scale) << names[i];
  }
}

INSTANTIATE_TEST_SUITE_P(Registry, GateMathTest, testing::ValuesIn(all_math_cases()),
                         math_case_name);

TEST(GateMath, IndependentCheckFromTheSpecInDouble) {
  // Written from the spec's formulas, not from the op (the one independent check).
  at::Tensor a = at::tensor({-50.0f, -1.0f, 0.0f, 0.5f, 19.5f, 21.0f}).reshape({3, 2});
  at::Tensor b = at::tensor({-3.0f, 0.0f, 1.0f, 2.0f, -0.5f, 4.0f}).reshape({3, 2});
  at::Tensor A_log = at::tensor({0.3f, -1.2f});
  at::Tensor dt_bias = at::tensor({1.0f, -0.25f});
  auto [g, beta] = pre_gdr_gate(a, b, A_log, dt_bias);
  for (int t = 0; t < 3; ++t) {
    for (int h = 0; h < 2; ++h) {
      const double pre = a[t][h].item<double>() + dt_bias[h].item<double>();
      const double sp = pre > 20 ? pre : std::log1p(std::exp(pre));
      const double expect_g = -std::exp(A_log[h].item<double>()) * sp;
      const double expect_beta = 1.0 / (1.0 + std::exp(-b[t][h].item<double>()));
      EXPECT_NEAR(g[t][h].item<double>(), expect_g, 1e-6 * std::max(1.0, std::abs(expect_g)));
      EXPECT_NEAR(beta[t][h].item<double>(), expect_beta, 1e-7);
    }
  }
}

// Note [Gate FP64 on the CPU]: Double inputs run FP64 math and give FP64 outputs and
// gradients, within FP64 rounding of the composite's autograd in every softplus regime and
// of the spec's formulas.
TEST(GateMath, DoubleInputsOnTheCpuComputeInFp64) {
  at::manual_seed(4321);
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  for (const double offset : {0.0, 24.0, -40.0}) {
    const at::Tensor a = at::randn({2, 37, 4}, f64) * 2 + offset;
    const at::Tensor b = at::randn({2, 37, 4}, f64) * 3;
    const at::Tensor A_log = at::log(at::rand({4}, f64) * 15.99 + 0.01);
    const at::Tensor dt_bias = at::randn({4}, f64) * 0.5 + 1;
    const at::Tensor grad_g = at::randn({2, 37, 4}, f64), grad_beta = at::randn({2, 37, 4}, f64);
    auto run = [&](bool fused) {
      at::Tensor a_ = a.detach().requires_grad_(true), b_ = b.detach().requires_grad_(true);
      at::Tensor A_ = A_log.detach().requires_grad_(true),
                 dt_ = dt_bias.detach().requires_grad_(true);
      auto [g, beta] =
          fused ? pre_gdr_gate(a_, b_, A_, dt_) : pre_gdr_gate_composite(a_, b_, A_, dt_);
      auto grads = torch::autograd::grad({g, beta}, {a_, b_, A_, dt_}, {grad_g, grad_beta});
      return std::vector<at::Tensor>{g, beta, grads[0], grads[1], grads[2], grads[3]};
    };
    const auto fused = run(true);
    const auto reference = run(false);
    const char* names[] = {"g", "beta", "da", "db", "dA_log", "ddt_bias"};
    for (int i = 0; i < 6; ++i) {
      EXPECT_EQ(fused[i].scalar_type(), at::kDouble) << names[i];
      EXPECT_EQ(reference[i].scalar_type(), at::kDouble) << names[i];
      const double scale = reference[i].abs().max().item<double>() + 1e-300;
      // A few FP64 ulps (libm vs ATen's vectorised exp / log1p; sums of 74 terms).
      EXPECT_LE((fused[i] - reference[i]).abs().max().item<double>(), 1e-14 * scale)
          << names[i] << " at offset " << offset;
    }
  }
  // And the spec's formulas in FP64, element by element.
  const at::Tensor a = at::tensor({-50.0, -1.0, 0.0, 0.5, 19.5, 21.0}, f64).reshape({3, 2});
  const at::Tensor b = at::tensor({-3.0, 0.0, 1.0, 2.0, -0.5, 4.0}, f64).reshape({3, 2});
  const at::Tensor A_log = at::tensor({0.3, -1.2}, f64), dt_bias = at::tensor({1.0, -0.25}, f64);
  auto [g, beta] = pre_gdr_gate(a, b, A_log, dt_bias);
  for (int t = 0; t < 3; ++t) {
    for (int h = 0; h < 2; ++h) {
      const double pre = a[t][h].item<double>() + dt_bias[h].item<double>();
      const double sp = pre > 20 ? pre : std::log1p(std::exp(pre));
      const double expect_g = -std::exp(A_log[h].item<double>()) * sp;
      const double expect_beta = 1.0 / (1.0 + std::exp(-b[t][h].item<double>()));
      EXPECT_NEAR(g[t][h].item<double>(), expect_g, 1e-15 * std::max(1.0, std::abs(expect_g)));
      EXPECT_NEAR(beta[t][h].item<double>(), expect_beta, 1e-16);
    }
  }
}

// ---------------------------------------------------------------------------
// Error messages at the op boundary.

struct ErrorCase {
  const char* name;
  std::function<void()> call;
  std::string message;
};

TEST(GateErrors, BadInputsAreRefusedWithMessagesNamingTheArgument) {
  const at::Tensor a = at::zeros({2, 3, 4});
  const at::Tensor A = at::zeros({4});
  const at::Tensor g = at::zeros({2, 3, 4});
  const std::vector<ErrorCase> cases = {
      {"double input, float params",
       [&] { pre_gdr_gate(a.to(at::kDouble), a.to(at::kDouble), A, A); },
       "pre_gdr_gate: expected a of dtype Float, Half or BFloat16 (A_log is Float; a Double a "
       "needs Double A_log and dt_bias), but got Double"},
      {"double params, float input",
       [&] { pre_gdr_gate(a, a, A.to(at::kDouble), A.to(at::kDouble)); },
       "pre_gdr_gate: expected a of dtype Double (A_log is Double: an FP64 gate takes all four "
       "inputs in Double), but got Float"},
      {"mixed a/b dtype", [&] { pre_gdr_gate(a, a.to(at::kBFloat16), A, A); },
       "pre_gdr_gate: expected b of dtype Float (same as a), but got BFloat16"},
      {"int params", [&] { pre_gdr_gate(a, a, A.to(at::kInt), A.to(at::kInt)); },
       "pre_gdr_gate: expected A_log of dtype Float, Half or BFloat16 (or Double on the CPU), but "
       "got Int"},
      {"mixed param dtype", [&] { pre_gdr_gate(a, a, A, A.to(at::kBFloat16)); },
       "pre_gdr_gate: expected dt_bias of dtype Float (same as A_log), but got BFloat16"},
      {"4-D a", [&] { pre_gdr_gate(a.unsqueeze(0), a.unsqueeze(0), A, A); },
       "pre_gdr_gate: expected a of shape [B, S, Hv] or [T, Hv], but got 4 dimensions [1, 2, 3, "
       "4]"},
      {"mismatched Hv",
       [&] {
         pre_gdr_gate(at::zeros({2, 3, 5}), at::zeros({2, 3, 5}), A, A);
       },
       "pre_gdr_gate: a has 5 heads in its last dimension but A_log has 4 (expected Hv = "
       "A_log.size(0)); a.shape = [2, 3, 5]"},
      {"b shape",
       [&] {
         pre_gdr_gate(a, at::zeros({2, 2, 4}), A, A);
       },
       "pre_gdr_gate: expected b of shape [2, 3, 4] (same as a), but got [2, 2, 4]"},
      {"2-D A_log", [&] { pre_gdr_gate(a, a, A.unsqueeze(0), A); },
       "pre_gdr_gate: expected A_log of shape [Hv], but got shape [1, 4]"},
      {"dt_bias shape", [&] { pre_gdr_gate(a, a, A, at::zeros({3})); },
       "pre_gdr_gate: expected dt_bias of shape [4] (same as A_log), but got [3]"},
      {"empty tokens",
       [&] {
         pre_gdr_gate(at::zeros({0, 3, 4}), at::zeros({0, 3, 4}), A, A);
       },
       "pre_gdr_gate: a has no tokens (shape [0, 3, 4]); expected at least one token"},
      {"no heads",
       [&] {
         pre_gdr_gate(at::zeros({2, 0}), at::zeros({2, 0}), at::zeros({0}), at::zeros({0}));
       },
       "pre_gdr_gate: A_log is empty; expected Hv >= 1 heads"},
      {"device mismatch", [&] { pre_gdr_gate_composite(a.to(at::kMeta), a.to(at::kMeta), A, A); },
       "pre_gdr_gate: a is on meta but A_log is on cpu; expected all tensors on one device"},
      {"grad dtype", [&] { pre_gdr_gate_backward(g.to(at::kBFloat16), g, a, a, A, A); },
       "pre_gdr_gate_backward: expected grad_g of dtype Float (the outputs are FP32), but got "
       "BFloat16"},
      {"float grad of double inputs",
       [&] {
         const at::Tensor ad = a.to(at::kDouble), Ad = A.to(at::kDouble);
         pre_gdr_gate_backward(g, g.to(at::kDouble), ad, ad, Ad, Ad);
       },
       "pre_gdr_gate_backward: expected grad_g of dtype Double (the outputs of Double inputs are "
       "FP64), but got Float"},
      {"grad shape",
       [&] {
         pre_gdr_gate_backward(g, at::zeros({6, 4}), a, a, A, A);
       },
       "pre_gdr_gate_backward: expected grad_beta of shape [2, 3, 4] (same as a), but got [6, 4]"},
  };
  for (const ErrorCase& c : cases) {
    EXPECT_EQ(error_of(c.call), c.message) << c.name;
  }
}

}  // namespace
}  // namespace gdr
