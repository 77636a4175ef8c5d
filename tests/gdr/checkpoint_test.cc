// Checkpoint directories: layout, SHA-256, and refusing corrupted or partial checkpoints
// with exact messages.
#include "gdr/checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "gdr/sha256.h"
#include "io/file_util.h"
#include "tests/gdr/trainer_test_util.h"

namespace gdr {
namespace {

using testing_util::make_trainer;
using testing_util::run_steps;
using testing_util::scratch_dir;
using testing_util::tiny_run_config;

TEST(Sha256Test, MatchesTheFipsVectors) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  EXPECT_EQ(sha256_hex(std::string(1000000, 'a')),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

// Files are hashed in 8 MiB pieces: sizes around the piece boundary give the digest of
// the whole contents, and a missing file is an error naming it.
TEST(Sha256Test, StreamedFileDigestEqualsTheDigestOfTheContents) {
  const std::string dir = scratch_dir("sha256_stream");
  std::filesystem::create_directories(dir);
  for (size_t size : {size_t{0}, size_t{1}, (size_t{8} << 20) - 1, size_t{8} << 20,
                      (size_t{8} << 20) + 65, (size_t{17} << 20) + 3}) {
    std::string contents(size, '\0');
    for (size_t i = 0; i < size; ++i) contents[i] = static_cast<char>((i * 2654435761u) >> 13);
    const std::string path = dir + "/f" + std::to_string(size);
    std::ofstream(path, std::ios::binary).write(contents.data(), contents.size());
    absl::StatusOr<std::string> streamed = sha256_file_hex(path);
    ASSERT_TRUE(streamed.ok()) << streamed.status();
    EXPECT_EQ(*streamed, sha256_hex(contents)) << size;
  }
  const absl::StatusOr<std::string> missing = sha256_file_hex(dir + "/absent");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find(dir + "/absent"), absl::string_view::npos);
}

void flip_byte(const std::string& path, int64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c ^= 0x01;
  f.seekp(offset);
  f.write(&c, 1);
}

// One trainer after one step, shared by the suite (training is the slow part).
class CheckpointTest : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    trainer_ = make_trainer(tiny_run_config()).release();
    run_steps(*trainer_, 1);
  }
  static void TearDownTestSuite() { delete trainer_; }
  std::string save(const std::string& name) {
    const std::string dir = checkpoint_step_dir(scratch_dir(name), 1);
    EXPECT_TRUE(trainer_->save_checkpoint(dir).ok());
    return dir;
  }
  static Trainer* trainer_;
};
Trainer* CheckpointTest::trainer_ = nullptr;

TEST_F(CheckpointTest, WritesTheDocumentedLayout) {
  const std::string dir = save("layout");
  for (const char* f : {"model.safetensors", "optimizer.safetensors", "state.json", "COMPLETE"}) {
    EXPECT_TRUE(std::filesystem::exists(io::join_path(dir, f))) << f;
  }
  EXPECT_FALSE(std::filesystem::exists(scratch_dir("layout/.step_1.partial")));
  absl::StatusOr<Checkpoint> c = read_checkpoint(dir);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->state.step, 1);
  EXPECT_EQ(c->state.data_position, trainer_->data_position());
  EXPECT_EQ(c->model.size(), trainer_->master_parameters().size());
  EXPECT_EQ(c->model[0].first, "model.embed_tokens.weight");
  EXPECT_EQ(c->optimizer[0].first, "model.embed_tokens.weight.exp_avg");
  EXPECT_EQ(c->optimizer[0].second.scalar_type(), at::kFloat);
  // Saving the same step again replaces it.
  EXPECT_TRUE(trainer_->save_checkpoint(dir).ok());
  EXPECT_TRUE(read_checkpoint(dir).ok());
}

TEST_F(CheckpointTest, RefusesAFlippedByteInTheModelFile) {
  const std::string dir = save("corrupt");
  const std::string model = io::join_path(dir, "model.safetensors");
  const std::string good = *sha256_file_hex(model);
  flip_byte(model, std::filesystem::file_size(model) - 5);
  const std::string bad = *sha256_file_hex(model);
  std::unique_ptr<Trainer> fresh = make_trainer(tiny_run_config());
  const absl::Status s = fresh->resume(dir);
  EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(s.message(), model + ": checksum mismatch: expected sha256 " + good +
                             " but the file has " + bad +
                             "; the checkpoint is corrupted, refusing to load it");
  EXPECT_EQ(fresh->step(), 0);
}

TEST_F(CheckpointTest, RefusesAnEditedStateFile) {
  const std::string dir = save("edited_state");
  const std::string state = io::join_path(dir, "state.json");
  const std::string good = *sha256_file_hex(state);
  flip_byte(state, 20);
  EXPECT_EQ(read_checkpoint(dir).status().message(),
            state + ": checksum mismatch: expected sha256 " + good + " but the file has " +
                *sha256_file_hex(state) + "; the checkpoint is corrupted, refusing to load it");
}

TEST_F(CheckpointTest, RefusesACheckpointWithoutTheCompleteMarker) {
  const std::string dir = save("partial");
  std::filesystem::remove(io::join_path(dir, "COMPLETE"));
  const absl::StatusOr<Checkpoint> c = read_checkpoint(dir);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(c.status().message(), dir +
                                      ": incomplete checkpoint: the COMPLETE marker is missing "
                                      "(the save did not finish); refusing to load it");
  // A checkpoint_dir whose only step is partial has nothing to resume from.
  EXPECT_EQ(
      resolve_checkpoint_dir(scratch_dir("partial")).status().message(),
      scratch_dir("partial") + ": no complete checkpoint (step_<N>/COMPLETE) in this directory");
}

TEST_F(CheckpointTest, ResolvesTheLatestCompleteStep) {
  const std::string root = scratch_dir("latest");
  ASSERT_TRUE(trainer_->save_checkpoint(checkpoint_step_dir(root, 1)).ok());
  ASSERT_TRUE(trainer_->save_checkpoint(checkpoint_step_dir(root, 2)).ok());
  std::filesystem::create_directories(checkpoint_step_dir(root, 3));  // no COMPLETE
  EXPECT_EQ(*resolve_checkpoint_dir(root), checkpoint_step_dir(root, 2));
  EXPECT_EQ(*resolve_checkpoint_dir(checkpoint_step_dir(root, 1)), checkpoint_step_dir(root, 1));
}

TEST_F(CheckpointTest, LeftoversOfACrashedSaveAreIgnoredAndReplaced) {
  // A save killed half-way leaves only the hidden .step_<N>.partial directory.
  const std::string root = scratch_dir("crashed");
  std::filesystem::create_directories(root + "/.step_2.partial");
  std::ofstream(root + "/.step_2.partial/model.safetensors") << "half";
  ASSERT_TRUE(trainer_->save_checkpoint(checkpoint_step_dir(root, 1)).ok());
  EXPECT_EQ(*resolve_checkpoint_dir(root), checkpoint_step_dir(root, 1));
  ASSERT_TRUE(trainer_->save_checkpoint(checkpoint_step_dir(root, 2)).ok());
  EXPECT_FALSE(std::filesystem::exists(root + "/.step_2.partial"));
  EXPECT_TRUE(read_checkpoint(checkpoint_step_dir(root, 2)).ok());
}

TEST(CheckpointErrorsTest, MissingDirectoryIsNotFound) {
  const absl::StatusOr<Checkpoint> c = read_checkpoint("/nonexistent/step_1");
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(c.status().message(), "/nonexistent/step_1: no such checkpoint directory");
}

}  // namespace
}  // namespace gdr
