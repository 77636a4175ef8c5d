// Comparing two snapshot (or checkpoint) directories tensor by tensor: the checker of the
// state-equality protocol (see Note [State snapshots] in gdr/trainer.cc and
// /work/shared/design/determinism.md).
//
// Every regular file under either directory is paired by its relative path.
//   *.safetensors: paired tensor by tensor by name; for each pair: bytes equal or not, the
//     count of differing elements, the max abs difference (float and integer dtypes, as a
//     double) and the max ULP difference (F32, BF16, F16: distance in the ordered integer
//     encoding, so +0 and -0 are 0 apart; a NaN against anything else counts as the
//     largest distance). Different dtype or shape is a difference, not a comparison.
//   any other file: bytes equal or not.
// Outcome: kEqual when every pair is byte-equal; kDifferent when something differs;
// kMissing when a file or tensor exists on one side only or a file cannot be read
// (evidence missing beats evidence different). Exit codes: 0, 1, 2 respectively.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace gdr {

struct TensorComparison {
  std::string file;   // relative path
  std::string name;   // tensor name; empty for a non-tensor file
  std::string spec;   // "F32 [4, 8]" (both sides', when they differ: "F32 [4] vs BF16 [4]")
  bool equal = true;  // byte-equal
  int64_t numel = 0;
  int64_t differing = 0;
  double max_abs_diff = 0;
  uint64_t max_ulp_diff = 0;
  bool has_ulp = false;  // a float dtype
};

enum class CompareOutcome { kEqual = 0, kDifferent = 1, kMissing = 2 };

struct SnapshotComparison {
  std::vector<TensorComparison> items;
  std::vector<std::string> problems;  // missing / unreadable evidence, one line each

  CompareOutcome outcome() const;
  int64_t num_different() const;
  // One line per differing item (all items when `verbose`), the problems, then a summary.
  std::string report(bool verbose) const;
};

SnapshotComparison compare_snapshot_dirs(const std::string& dir_a, const std::string& dir_b);

}  // namespace gdr
