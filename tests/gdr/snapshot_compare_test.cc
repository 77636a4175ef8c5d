// The snapshot comparer: equal for identical directories, flags a single flipped bit with
// its ULP distance, and reports missing evidence; plus the trainer's snapshots themselves.
#include "gdr/snapshot_compare.h"

#include <ATen/ATen.h>

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "io/file_util.h"
#include "io/safetensors.h"
#include "tests/gdr/trainer_test_util.h"

namespace gdr {
namespace {

namespace fs = std::filesystem;
using testing_util::make_trainer;
using testing_util::run_steps;
using testing_util::scratch_dir;
using testing_util::tiny_run_config;

class SnapshotCompareTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    std::unique_ptr<Trainer> t = make_trainer(tiny_run_config());
    for (int i = 0; i < 2; ++i) {
      run_steps(*t, 1);
      ASSERT_TRUE(t->write_snapshot(reference_dir()).ok());
    }
  }
  static std::string reference_dir() { return scratch_dir("snap_ref"); }

  std::string copy_of_reference(const std::string& name) {
    const std::string dir = scratch_dir(name);
    fs::remove_all(dir);
    fs::copy(reference_dir(), dir, fs::copy_options::recursive);
    return dir;
  }
};

TEST_F(SnapshotCompareTest, IdenticalDirectoriesAreEqual) {
  const std::string copy = copy_of_reference("snap_copy");
  const SnapshotComparison c = compare_snapshot_dirs(reference_dir(), copy);
  EXPECT_EQ(c.outcome(), CompareOutcome::kEqual) << c.report(false);
  EXPECT_EQ(c.num_different(), 0);
  EXPECT_TRUE(c.problems.empty());
  EXPECT_GT(c.items.size(), 100u);
}

TEST_F(SnapshotCompareTest, SnapshotsHoldTheDocumentedTensors) {
  absl::StatusOr<io::SafetensorsContents> s =
      io::read_safetensors(reference_dir() + "/step_2/snapshot.safetensors");
  ASSERT_TRUE(s.ok()) << s.status();
  for (const char* name :
       {"loss/microbatch", "loss/mean", "param/model.norm.weight", "grad/model.norm.weight",
        "adam/model.norm.weight.exp_avg", "adam/model.norm.weight.exp_avg_sq",
        "adam/model.norm.weight.step", "rng/cpu", "data/position"}) {
    EXPECT_NE(s->find(name), nullptr) << name;
  }
  EXPECT_EQ(s->find("loss/microbatch")->numel(), 2);  // grad_accum
  EXPECT_EQ(s->find("adam/model.norm.weight.step")->item<int64_t>(), 2);
  EXPECT_EQ(s->find("data/position")->data_ptr<int64_t>()[1], 16);  // 2 steps x 2 x 4 windows
}

TEST_F(SnapshotCompareTest, FlagsASingleFlippedBit) {
  const std::string copy = copy_of_reference("snap_flip");
  const std::string file = copy + "/step_2/snapshot.safetensors";
  absl::StatusOr<io::SafetensorsHeader> header = io::read_safetensors_header(file);
  ASSERT_TRUE(header.ok()) << header.status();
  uint64_t offset = 0;
  for (const auto& e : header->entries) {
    if (e.name == "param/model.norm.weight") offset = header->data_start + e.data_begin + 4 * 7;
  }
  ASSERT_GT(offset, 0u);
  {
    std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(offset);
    char c = 0;
    f.read(&c, 1);
    c ^= 0x01;  // lowest mantissa bit of element 7 (little-endian)
    f.seekp(offset);
    f.write(&c, 1);
  }
  const SnapshotComparison c = compare_snapshot_dirs(reference_dir(), copy);
  EXPECT_EQ(c.outcome(), CompareOutcome::kDifferent);
  ASSERT_EQ(c.num_different(), 1) << c.report(false);
  for (const TensorComparison& t : c.items) {
    if (t.equal) continue;
    EXPECT_EQ(t.file, "step_2/snapshot.safetensors");
    EXPECT_EQ(t.name, "param/model.norm.weight");
    EXPECT_EQ(t.differing, 1);
    EXPECT_EQ(t.numel, 64);
    EXPECT_EQ(t.max_ulp_diff, 1u);
    EXPECT_GT(t.max_abs_diff, 0);
    EXPECT_LT(t.max_abs_diff, 1e-6);
  }
  EXPECT_NE(c.report(false).find("DIFF  step_2/snapshot.safetensors param/model.norm.weight "
                                 "F32 [64]: 1 of 64 elements differ"),
            std::string::npos)
      << c.report(false);
}

TEST_F(SnapshotCompareTest, MissingOrUnreadableEvidenceIsReportedAsSuch) {
  const std::string copy = copy_of_reference("snap_missing");
  fs::remove(copy + "/step_1/snapshot.json");
  SnapshotComparison c = compare_snapshot_dirs(reference_dir(), copy);
  EXPECT_EQ(c.outcome(), CompareOutcome::kMissing);
  ASSERT_EQ(c.problems.size(), 1u);
  EXPECT_EQ(c.problems[0], "step_1/snapshot.json: missing from " + copy);

  std::ofstream(copy + "/step_2/snapshot.safetensors", std::ios::trunc) << "garbage";
  c = compare_snapshot_dirs(reference_dir(), copy);
  EXPECT_EQ(c.outcome(), CompareOutcome::kMissing);
  EXPECT_EQ(compare_snapshot_dirs(reference_dir(), scratch_dir("nope")).outcome(),
            CompareOutcome::kMissing);
}

TEST(UlpTest, CountsUlpsAcrossZeroAndForBf16) {
  const std::string a = scratch_dir("ulp_a"), b = scratch_dir("ulp_b");
  fs::create_directories(a);
  fs::create_directories(b);
  const float neg_tiny = -1.4e-45f;  // the smallest negative denormal
  ASSERT_TRUE(io::write_safetensors(a + "/t.safetensors",
                                    {{"f", at::tensor({0.0f, 1.0f, neg_tiny})},
                                     {"h", at::tensor({1.0f, 2.0f}).to(at::kBFloat16)}})
                  .ok());
  ASSERT_TRUE(
      io::write_safetensors(b + "/t.safetensors",
                            {{"f", at::tensor({1.4e-45f, 1.0f, 1.4e-45f})},
                             {"h", at::tensor({1.0f, 2.03125f}).to(at::kBFloat16)}})  // 2 + 2 ulp
          .ok());
  const SnapshotComparison c = compare_snapshot_dirs(a, b);
  ASSERT_EQ(c.items.size(), 2u);
  EXPECT_EQ(c.items[0].differing, 2);
  EXPECT_EQ(c.items[0].max_ulp_diff, 2u);  // -denorm .. +denorm crosses zero
  EXPECT_EQ(c.items[1].differing, 1);
  EXPECT_EQ(c.items[1].max_ulp_diff, 2u);
  EXPECT_DOUBLE_EQ(c.items[1].max_abs_diff, 0.03125);  // BF16 ulp at 2 is 2^-6
}

}  // namespace
}  // namespace gdr
