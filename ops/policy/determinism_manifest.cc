#include "ops/policy/determinism_manifest.h"

#include <regex>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace gdr {
namespace {

std::string trim(const std::string& s) {
  const size_t begin = s.find_first_not_of(" \t\r");
  if (begin == std::string::npos) return "";
  const size_t end = s.find_last_not_of(" \t\r");
  return s.substr(begin, end - begin + 1);
}

struct KernelSpan {
  std::string name;
  size_t begin;  // offset of `__global__`
};

// After each `__global__`, the kernel's name is the first identifier directly followed
// by '(' other than `__launch_bounds__`, whose argument list is skipped.
std::vector<KernelSpan> kernel_spans(const std::string& source) {
  static const std::regex kCall(R"(\b([A-Za-z_][A-Za-z0-9_]*)\s*\()");
  std::vector<KernelSpan> spans;
  size_t at = source.find("__global__");
  while (at != std::string::npos) {
    size_t cursor = at + 10;
    std::smatch match;
    while (std::regex_search(source.begin() + cursor, source.end(), match, kCall)) {
      const size_t name_end = cursor + match.position(0) + match.length(0);
      if (match[1].str() != "__launch_bounds__") {
        spans.push_back({match[1].str(), at});
        break;
      }
      const size_t close = source.find(')', name_end);
      if (close == std::string::npos) break;
      cursor = close + 1;
    }
    at = source.find("__global__", at + 10);
  }
  return spans;
}

}  // namespace

absl::StatusOr<std::vector<ManifestEntry>> parse_determinism_manifest(const std::string& text,
                                                                      const std::string& origin) {
  std::vector<ManifestEntry> entries;
  std::istringstream lines(text);
  std::string line;
  int number = 0;
  while (std::getline(lines, line)) {
    ++number;
    const std::string stripped = trim(line);
    if (stripped.empty() || stripped[0] == '#') continue;
    std::vector<std::string> fields = absl::StrSplit(stripped, '|');
    if (fields.size() != 5) {
      return absl::InvalidArgumentError(
          absl::StrCat(origin, ":", number,
                       ": expected 5 '|'-separated fields (file | kernel | reduction | "
                       "deterministic path | replay test), got ",
                       fields.size()));
    }
    for (std::string& f : fields) f = trim(f);
    for (size_t i = 0; i < fields.size(); ++i) {
      if (fields[i].empty()) {
        return absl::InvalidArgumentError(
            absl::StrCat(origin, ":", number, ": field ", i + 1, " is empty"));
      }
    }
    if (fields[4].rfind("//", 0) != 0 || fields[4].find(':') == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          origin, ":", number, ": replay test must be a Bazel label //package:target, got '",
          fields[4], "'"));
    }
    entries.push_back({fields[0], fields[1], fields[2], fields[3], fields[4]});
  }
  return entries;
}

std::set<std::string> kernel_names(const std::string& source) {
  std::set<std::string> names;
  for (const KernelSpan& span : kernel_spans(source)) names.insert(span.name);
  return names;
}

std::set<std::string> kernels_using_atomics(const std::string& source) {
  // CUDA atomic intrinsics (atomicAdd, atomicAdd_block, atomicCAS, ...), libcu++ atomics
  // (cuda::atomic_ref, cuda::atomic) and inline PTX reductions/atomics.
  static const std::regex kAtomic(
      R"(\batomic[A-Z][A-Za-z_]*\s*\(|\batomic_ref\b|\bcuda::atomic\b|\bred\.|\batom\.)");
  const std::vector<KernelSpan> spans = kernel_spans(source);
  std::set<std::string> users;
  for (auto it = std::sregex_iterator(source.begin(), source.end(), kAtomic);
       it != std::sregex_iterator(); ++it) {
    const size_t at = static_cast<size_t>(it->position(0));
    const KernelSpan* owner = nullptr;
    for (const KernelSpan& span : spans) {
      if (span.begin <= at) owner = &span;
    }
    users.insert(owner != nullptr ? owner->name : "<outside any kernel>");
  }
  return users;
}

}  // namespace gdr
