// Small POSIX file helpers shared by the io/ formats: positioned reads, read-only memory
// maps, and crash-safe writes.
//
// Note [Atomic file writes]: a file that io/ writes either appears complete under its final
// name or not at all. AtomicFileWriter writes to a temporary file in the same directory
// (so rename(2) cannot cross a file system), fsyncs it, renames it over the target and then
// fsyncs the directory so the rename itself survives a crash. A reader therefore never sees
// a half-written checkpoint, even if the trainer is killed mid-save. Multi-file formats
// (sharded safetensors, .bin + .idx) commit the file that points at the others last.
//
// Every error names the file and the failing operation; errors are values (absl::Status),
// never exceptions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gdr::io {

// A file opened for reading, with its size taken at open time.
class ReadOnlyFile {
 public:
  // NotFound when the file does not exist, FailedPrecondition for a directory.
  static absl::StatusOr<ReadOnlyFile> open(const std::string& path);

  ReadOnlyFile(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile& operator=(ReadOnlyFile&& other) noexcept;
  ReadOnlyFile(const ReadOnlyFile&) = delete;
  ReadOnlyFile& operator=(const ReadOnlyFile&) = delete;
  ~ReadOnlyFile();

  const std::string& path() const { return path_; }
  uint64_t size() const { return size_; }

  // Reads exactly `size` bytes at `offset` into `dst` (retrying short reads); DataLoss when
  // the range runs past the end of the file.
  absl::Status read_at(uint64_t offset, void* dst, size_t size) const;

 private:
  ReadOnlyFile(std::string path, int fd, uint64_t size);
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// A whole file mapped read-only. An empty file maps to data() == nullptr, size() == 0.
class MappedFile {
 public:
  static absl::StatusOr<std::shared_ptr<const MappedFile>> open(const std::string& path);

  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  const std::string& path() const { return path_; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size);
  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Writes a file under a temporary name and publishes it with commit().
// See Note [Atomic file writes]. Appends are buffered. If the writer is destroyed without
// a successful commit(), the temporary file is removed and the target is left untouched.
class AtomicFileWriter {
 public:
  static absl::StatusOr<AtomicFileWriter> create(const std::string& path);

  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  const std::string& path() const { return path_; }
  uint64_t bytes_written() const { return bytes_written_; }

  absl::Status append(const void* data, size_t size);
  absl::Status append(absl::string_view bytes) { return append(bytes.data(), bytes.size()); }

  // Flushes, fsyncs, renames over path() and fsyncs the directory. At most once.
  absl::Status commit();

 private:
  AtomicFileWriter(std::string path, std::string temp_path, int fd);
  absl::Status flush_buffer();
  void abandon();

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  std::string buffer_;
  uint64_t bytes_written_ = 0;
};

// Whole-file conveniences built on the classes above.
absl::StatusOr<std::string> read_file(const std::string& path);
absl::Status write_file_atomically(const std::string& path, absl::string_view contents);

// The directory part of `path` ("." when it has none) and `dir`/`name` joined.
std::string dirname_of(const std::string& path);
std::string join_path(const std::string& dir, const std::string& name);

}  // namespace gdr::io
