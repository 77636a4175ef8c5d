// The determinism manifest (ops/policy/determinism_manifest.txt) and the check that keeps it
// honest: every kernel whose source uses an atomic must be listed with its
// deterministic path and the Bazel target of its bit-exact replay test.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace gdr {

struct ManifestEntry {
  std::string file;    // e.g. kernels/pre_gdr_gate/pre_gdr_gate.cu
  std::string kernel;  // __global__ function name
  std::string reduction;
  std::string deterministic_path;
  std::string replay_test;  // Bazel label, e.g. //tests/ops:pre_gdr_gate_gpu_test
};

// Parses the manifest text; `origin` names the file in errors.
absl::StatusOr<std::vector<ManifestEntry>> parse_determinism_manifest(const std::string& text,
                                                                      const std::string& origin);

// Names of the __global__ functions in `source`.
std::set<std::string> kernel_names(const std::string& source);

// Names of the __global__ functions in `source` whose bodies use an atomic.
std::set<std::string> kernels_using_atomics(const std::string& source);

}  // namespace gdr
