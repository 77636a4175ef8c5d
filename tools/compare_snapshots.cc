// compare_snapshots: are two snapshot (or checkpoint) directories the same state?
//
//   bazel run //tools:compare_snapshots -- DIR_A DIR_B [--verbose]
//
// Prints one line per differing tensor (bytes, differing elements, max abs and ULP diff)
// and a summary. Exit status: 0 equal, 1 different, 2 evidence missing or unreadable (or
// bad arguments). See gdr/snapshot_compare.h.
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "gdr/snapshot_compare.h"

namespace {

constexpr char kUsage[] =
    "usage: compare_snapshots DIR_A DIR_B [--verbose]\n"
    "\n"
    "Compares every file under DIR_A and DIR_B by relative path; safetensors files tensor\n"
    "by tensor (bytes equal, differing elements, max abs diff, max ULP diff).\n"
    "  --verbose   also list equal items\n"
    "Exit status: 0 equal, 1 different, 2 missing/unreadable evidence or bad arguments.\n";

}  // namespace

int main(int argc, char** argv) {
  if (const char* wd = std::getenv("BUILD_WORKING_DIRECTORY"); wd != nullptr && *wd != '\0') {
    if (chdir(wd) != 0) {
      std::cerr << "compare_snapshots: error: cannot enter " << wd << "\n";
      return 2;
    }
  }
  std::vector<std::string> dirs;
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      std::cout << kUsage;
      return 0;
    }
    if (arg == "--verbose") {
      verbose = true;
    } else if (arg.rfind("--", 0) == 0) {
      std::cerr << "compare_snapshots: error: unknown flag '" << arg << "' (see --help)\n";
      return 2;
    } else {
      dirs.push_back(arg);
    }
  }
  if (dirs.size() != 2) {
    std::cerr << "compare_snapshots: error: expected two directories but got " << dirs.size()
              << " (see --help)\n";
    return 2;
  }
  const gdr::SnapshotComparison result = gdr::compare_snapshot_dirs(dirs[0], dirs[1]);
  std::cout << result.report(verbose);
  return static_cast<int>(result.outcome());
}
