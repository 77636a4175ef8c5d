// SHA-256 (FIPS 180-4), for checkpoint integrity checks. Hand-written because no hashing
// library is among our dependencies; checked against the FIPS test vectors in tests/gdr.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gdr {

// Lower-case hex digest of `bytes`.
std::string sha256_hex(absl::string_view bytes);

// Lower-case hex digest of the file at `path` (errors name the file).
absl::StatusOr<std::string> sha256_file_hex(const std::string& path);

}  // namespace gdr
