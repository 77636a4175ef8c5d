// Shared helpers for the trainer tests: the tiny config with a few overrides, byte-exact
// tensor-set equality, and a scratch directory.
#pragma once

#include <ATen/core/Tensor.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "gdr/run_config.h"
#include "gdr/trainer.h"
#include "io/safetensors.h"

namespace gdr::testing_util {

inline RunConfig tiny_run_config(std::vector<ConfigOverride> overrides = {}) {
  absl::StatusOr<RunConfig> c = load_run_config("configs/train_tiny.yaml", overrides);
  EXPECT_TRUE(c.ok()) << c.status();
  return *c;
}

inline std::unique_ptr<Trainer> make_trainer(const RunConfig& config) {
  absl::StatusOr<std::unique_ptr<Trainer>> t = Trainer::create(config);
  EXPECT_TRUE(t.ok()) << t.status();
  return std::move(*t);
}

inline void run_steps(Trainer& trainer, int n) {
  for (int i = 0; i < n; ++i) {
    absl::StatusOr<StepStats> s = trainer.train_step();
    ASSERT_TRUE(s.ok()) << s.status();
  }
}

// Same names in the same order, same dtypes and shapes, and the same bytes.
inline ::testing::AssertionResult bytes_equal(const io::NamedTensors& a,
                                              const io::NamedTensors& b) {
  if (a.size() != b.size()) {
    return ::testing::AssertionFailure() << a.size() << " vs " << b.size() << " tensors";
  }
  for (size_t i = 0; i < a.size(); ++i) {
    const at::Tensor x = a[i].second.cpu().contiguous(), y = b[i].second.cpu().contiguous();
    if (a[i].first != b[i].first || x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes() ||
        std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) {
      return ::testing::AssertionFailure()
             << "tensor " << i << " " << a[i].first << " vs " << b[i].first << " differs";
    }
  }
  return ::testing::AssertionSuccess();
}

inline std::string scratch_dir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  return std::string(tmp != nullptr ? tmp : "/tmp") + "/" + name;
}

}  // namespace gdr::testing_util
