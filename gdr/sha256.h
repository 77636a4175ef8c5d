// SHA-256 for checkpoint integrity checks, through OpenSSL's libcrypto (Debian libssl-dev:
// SHA-NI / AVX2 code paths, several times faster than a portable loop on the checkpoints'
// gigabytes; measured: docs/benchmarks.md, Decisions). Checked against the FIPS 180-4 test
// vectors in tests/gdr.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace gdr {

// Lower-case hex digest of `bytes`.
std::string sha256_hex(absl::string_view bytes);

// Lower-case hex digest of the file at `path`, read in chunks (the file is never held in
// memory whole). Errors name the file.
absl::StatusOr<std::string> sha256_file_hex(const std::string& path);

}  // namespace gdr
