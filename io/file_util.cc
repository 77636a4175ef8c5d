#include "io/file_util.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"

namespace gdr::io {
namespace {

// Appends below this size are gathered so that writing many small tensors or token
// sequences costs few syscalls.
constexpr size_t kWriteBufferBytes = size_t{1} << 20;

absl::Status errno_status(int err, const std::string& path, absl::string_view operation) {
  std::string message = absl::StrCat(path, ": ", operation, " failed: ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

// write(2) may write fewer bytes than asked (signals, pipes, quotas); loop until done.
absl::Status write_all(int fd, const std::string& path, const void* data, size_t size) {
  const char* p = static_cast<const char*>(data);
  while (size > 0) {
    ssize_t n = ::write(fd, p, size);
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, path, "write");
    }
    p += n;
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status fsync_directory(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, dir, "open directory");
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return errno_status(err, dir, "fsync directory");
  return absl::OkStatus();
}

absl::StatusOr<std::pair<int, uint64_t>> open_regular_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_status(errno, path, "open");
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return errno_status(err, path, "stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat(path, ": not a regular file"));
  }
  return std::make_pair(fd, static_cast<uint64_t>(st.st_size));
}

}  // namespace

// ---------------------------------------------------------------------------- ReadOnlyFile

ReadOnlyFile::ReadOnlyFile(std::string path, int fd, uint64_t size)
    : path_(std::move(path)), fd_(fd), size_(size) {}

ReadOnlyFile::ReadOnlyFile(ReadOnlyFile&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)), size_(other.size_) {}

ReadOnlyFile& ReadOnlyFile::operator=(ReadOnlyFile&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(other.path_);
    fd_ = std::exchange(other.fd_, -1);
    size_ = other.size_;
  }
  return *this;
}

ReadOnlyFile::~ReadOnlyFile() {
  if (fd_ >= 0) ::close(fd_);
}

absl::StatusOr<ReadOnlyFile> ReadOnlyFile::open(const std::string& path) {
  auto opened = open_regular_file(path);
  if (!opened.ok()) return opened.status();
  return ReadOnlyFile(path, opened->first, opened->second);
}

absl::Status ReadOnlyFile::read_at(uint64_t offset, void* dst, size_t size) const {
  if (offset > size_ || size > size_ - offset) {
    return absl::DataLossError(absl::StrCat(path_, ": read of ", size, " bytes at offset ", offset,
                                            " runs past the end of the file (", size_, " bytes)"));
  }
  char* p = static_cast<char*>(dst);
  while (size > 0) {
    ssize_t n = ::pread(fd_, p, size, static_cast<off_t>(offset));
    if (n < 0) {
      if (errno == EINTR) continue;
      return errno_status(errno, path_, "read");
    }
    if (n == 0) {
      // The file shrank after open: someone is rewriting it in place.
      return absl::DataLossError(
          absl::StrCat(path_, ": file ended early at offset ", offset, " while reading"));
    }
    p += n;
    offset += static_cast<uint64_t>(n);
    size -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

// ------------------------------------------------------------------------------ MappedFile

MappedFile::MappedFile(std::string path, const uint8_t* data, size_t size)
    : path_(std::move(path)), data_(data), size_(size) {}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<uint8_t*>(data_), size_);
}

absl::StatusOr<std::shared_ptr<const MappedFile>> MappedFile::open(const std::string& path) {
  auto opened = open_regular_file(path);
  if (!opened.ok()) return opened.status();
  auto [fd, size] = *opened;
  const uint8_t* data = nullptr;
  if (size > 0) {
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return errno_status(err, path, "mmap");
    }
    data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
  return std::shared_ptr<const MappedFile>(new MappedFile(path, data, size));
}

// ------------------------------------------------------------------------ AtomicFileWriter

AtomicFileWriter::AtomicFileWriter(std::string path, std::string temp_path, int fd)
    : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      temp_path_(std::move(other.temp_path_)),
      fd_(std::exchange(other.fd_, -1)),
      buffer_(std::move(other.buffer_)),
      bytes_written_(other.bytes_written_) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    abandon();
    path_ = std::move(other.path_);
    temp_path_ = std::move(other.temp_path_);
    fd_ = std::exchange(other.fd_, -1);
    buffer_ = std::move(other.buffer_);
    bytes_written_ = other.bytes_written_;
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { abandon(); }

void AtomicFileWriter::abandon() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(temp_path_.c_str());
  fd_ = -1;
}

absl::StatusOr<AtomicFileWriter> AtomicFileWriter::create(const std::string& path) {
  // pid + a process-wide counter keep concurrent writers (threads or ranks sharing a file
  // system) from colliding on the temporary name; O_EXCL catches anything left over.
  static std::atomic<uint64_t> counter{0};
  std::string temp_path = absl::StrCat(path, ".tmp.", ::getpid(), ".", counter.fetch_add(1));
  int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status(errno, temp_path, "create");
  return AtomicFileWriter(path, std::move(temp_path), fd);
}

absl::Status AtomicFileWriter::flush_buffer() {
  if (buffer_.empty()) return absl::OkStatus();
  absl::Status status = write_all(fd_, temp_path_, buffer_.data(), buffer_.size());
  buffer_.clear();
  return status;
}

absl::Status AtomicFileWriter::append(const void* data, size_t size) {
  if (fd_ < 0) {
    return absl::FailedPreconditionError(absl::StrCat(path_, ": append after commit"));
  }
  bytes_written_ += size;
  if (buffer_.size() + size <= kWriteBufferBytes) {
    buffer_.append(static_cast<const char*>(data), size);
    return absl::OkStatus();
  }
  if (absl::Status s = flush_buffer(); !s.ok()) return s;
  if (size >= kWriteBufferBytes) return write_all(fd_, temp_path_, data, size);
  buffer_.append(static_cast<const char*>(data), size);
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::commit() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat(path_, ": committed twice"));
  if (absl::Status s = flush_buffer(); !s.ok()) return s;
  if (::fsync(fd_) != 0) return errno_status(errno, temp_path_, "fsync");
  int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0) {
    int err = errno;
    ::unlink(temp_path_.c_str());
    return errno_status(err, temp_path_, "close");
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    int err = errno;
    ::unlink(temp_path_.c_str());
    return errno_status(err, path_, "rename");
  }
  return fsync_directory(dirname_of(path_));
}

// ------------------------------------------------------------------------- whole files

absl::StatusOr<std::string> read_file(const std::string& path) {
  auto file = ReadOnlyFile::open(path);
  if (!file.ok()) return file.status();
  std::string contents(file->size(), '\0');
  if (absl::Status s = file->read_at(0, contents.data(), contents.size()); !s.ok()) return s;
  return contents;
}

absl::Status write_file_atomically(const std::string& path, absl::string_view contents) {
  auto writer = AtomicFileWriter::create(path);
  if (!writer.ok()) return writer.status();
  if (absl::Status s = writer->append(contents); !s.ok()) return s;
  return writer->commit();
}

std::string dirname_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string join_path(const std::string& dir, const std::string& name) {
  if (dir.empty()) return name;
  if (dir.back() == '/') return dir + name;
  return dir + "/" + name;
}

}  // namespace gdr::io
