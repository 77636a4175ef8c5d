#include "gdr/sha256.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "io/file_util.h"

namespace gdr {
namespace {

struct DigestContextDeleter {
  void operator()(EVP_MD_CTX* ctx) const { EVP_MD_CTX_free(ctx); }
};
using DigestContext = std::unique_ptr<EVP_MD_CTX, DigestContextDeleter>;

std::string to_hex(const unsigned char* digest, unsigned int length) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * length);
  for (unsigned int i = 0; i < length; ++i) {
    out.push_back(kHex[digest[i] >> 4]);
    out.push_back(kHex[digest[i] & 0xf]);
  }
  return out;
}

// Runs `feed(update)` through one SHA-256 context; feed calls update(data, size) for each
// piece and returns false to abandon (its own error already recorded).
template <typename Feed>
absl::StatusOr<std::string> digest_of(Feed feed) {
  DigestContext ctx(EVP_MD_CTX_new());
  if (ctx == nullptr || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) {
    return absl::InternalError("sha256: OpenSSL could not start a digest");
  }
  bool update_ok = true;
  const bool fed = feed([&](const void* data, size_t size) {
    update_ok = update_ok && EVP_DigestUpdate(ctx.get(), data, size) == 1;
  });
  if (!update_ok) return absl::InternalError("sha256: OpenSSL digest update failed");
  if (!fed) return absl::InternalError("sha256: input not read");
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  if (EVP_DigestFinal_ex(ctx.get(), digest, &length) != 1) {
    return absl::InternalError("sha256: OpenSSL could not finish the digest");
  }
  return to_hex(digest, length);
}

}  // namespace

std::string sha256_hex(absl::string_view bytes) {
  absl::StatusOr<std::string> hex = digest_of([&](auto update) {
    update(bytes.data(), bytes.size());
    return true;
  });
  // Only an OpenSSL internal failure (e.g. out of memory) gets here; there is no
  // meaningful digest to return, and a wrong one would defeat the check.
  if (!hex.ok()) {
    std::fprintf(stderr, "%s\n", std::string(hex.status().message()).c_str());
    std::abort();
  }
  return *hex;
}

absl::StatusOr<std::string> sha256_file_hex(const std::string& path) {
  absl::StatusOr<io::ReadOnlyFile> file = io::ReadOnlyFile::open(path);
  if (!file.ok()) return file.status();
  absl::Status read_status;
  absl::StatusOr<std::string> hex = digest_of([&](auto update) {
    std::vector<char> buffer(size_t{8} << 20);
    for (uint64_t offset = 0; offset < file->size(); offset += buffer.size()) {
      const size_t n =
          static_cast<size_t>(std::min<uint64_t>(buffer.size(), file->size() - offset));
      read_status = file->read_at(offset, buffer.data(), n);
      if (!read_status.ok()) return false;
      update(buffer.data(), n);
    }
    return true;
  });
  if (!read_status.ok()) return read_status;
  if (!hex.ok()) return absl::InternalError(absl::StrCat(path, ": ", hex.status().message()));
  return hex;
}

}  // namespace gdr
