// Tests for io/file_util: atomic publication, positioned reads and their error messages.
#include "io/file_util.h"
#include "tests/io/test_files.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

namespace gdr::io {
namespace {

int count_files(const std::string& dir) {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    (void)entry;
    ++n;
  }
  return n;
}

TEST(AtomicFileWriter, NothingIsVisibleUntilCommit) {
  const std::string dir = test_dir();
  const std::string path = dir + "/out.bin";
  auto writer = AtomicFileWriter::create(path);
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE(writer->append("hello ").ok());
  EXPECT_FALSE(std::filesystem::exists(path));
  ASSERT_TRUE(writer->append("world").ok());
  EXPECT_EQ(writer->bytes_written(), 11u);
  ASSERT_TRUE(writer->commit().ok());
  EXPECT_EQ(*read_file(path), "hello world");
  EXPECT_EQ(count_files(dir), 1);
  EXPECT_EQ(writer->commit().message(), path + ": committed twice");
  EXPECT_EQ(writer->append("x").message(), path + ": append after commit");
}

TEST(AtomicFileWriter, AbandonedWriterRemovesItsTemporaryFileAndKeepsTheOldContents) {
  const std::string dir = test_dir();
  const std::string path = dir + "/out.bin";
  ASSERT_TRUE(write_file_atomically(path, "old").ok());
  {
    auto writer = AtomicFileWriter::create(path);
    ASSERT_TRUE(writer.ok());
    ASSERT_TRUE(writer->append("new contents").ok());
    EXPECT_EQ(count_files(dir), 2);  // the target and the temporary file
  }
  EXPECT_EQ(*read_file(path), "old");
  EXPECT_EQ(count_files(dir), 1);
}

TEST(AtomicFileWriter, LargeAndSmallAppendsKeepTheirOrder) {
  const std::string path = test_dir() + "/big.bin";
  std::string expected;
  auto writer = AtomicFileWriter::create(path);
  ASSERT_TRUE(writer.ok());
  for (int i = 0; i < 5; ++i) {
    // Alternate small appends (buffered) with ones above the 1 MiB buffer (written through).
    std::string chunk(i % 2 == 0 ? 1000 : (3 << 19), static_cast<char>('a' + i));
    expected += chunk;
    ASSERT_TRUE(writer->append(chunk).ok());
  }
  ASSERT_TRUE(writer->commit().ok());
  EXPECT_EQ(*read_file(path), expected);
}

TEST(AtomicFileWriter, MissingDirectoryIsNotFound) {
  const std::string path = test_dir() + "/no/such/dir/file";
  auto writer = AtomicFileWriter::create(path);
  EXPECT_EQ(writer.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(writer.status().message().substr(0, path.size()), path);
}

TEST(ReadOnlyFile, ReadsRangesAndRefusesToReadPastTheEnd) {
  const std::string path = test_dir() + "/f";
  ASSERT_TRUE(write_file_atomically(path, "0123456789").ok());
  auto file = ReadOnlyFile::open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_EQ(file->size(), 10u);
  char buf[4];
  ASSERT_TRUE(file->read_at(3, buf, 4).ok());
  EXPECT_EQ(std::string(buf, 4), "3456");
  EXPECT_EQ(file->read_at(8, buf, 4).message(),
            path + ": read of 4 bytes at offset 8 runs past the end of the file (10 bytes)");
}

TEST(ReadOnlyFile, MissingFileAndDirectoryAreReported) {
  const std::string dir = test_dir();
  EXPECT_EQ(ReadOnlyFile::open(dir + "/absent").status().message(),
            dir + "/absent: open failed: No such file or directory");
  EXPECT_EQ(ReadOnlyFile::open(dir).status().message(), dir + ": not a regular file");
}

TEST(MappedFile, MapsContentsAndEmptyFiles) {
  const std::string dir = test_dir();
  ASSERT_TRUE(write_file_atomically(dir + "/a", "abc").ok());
  ASSERT_TRUE(write_file_atomically(dir + "/empty", "").ok());
  auto a = MappedFile::open(dir + "/a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>((*a)->data()), (*a)->size()), "abc");
  auto empty = MappedFile::open(dir + "/empty");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ((*empty)->size(), 0u);
  EXPECT_EQ((*empty)->data(), nullptr);
}

TEST(Paths, DirnameAndJoin) {
  EXPECT_EQ(dirname_of("a/b/c.json"), "a/b");
  EXPECT_EQ(dirname_of("c.json"), ".");
  EXPECT_EQ(dirname_of("/c.json"), "/");
  EXPECT_EQ(join_path("a/b", "c"), "a/b/c");
  EXPECT_EQ(join_path("a/b/", "c"), "a/b/c");
  EXPECT_EQ(join_path("", "c"), "c");
}

}  // namespace
}  // namespace gdr::io
