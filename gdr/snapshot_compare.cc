#include "gdr/snapshot_compare.h"

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "io/file_util.h"
#include "io/safetensors.h"

namespace gdr {
namespace fs = std::filesystem;
namespace {

std::set<std::string> regular_files(const std::string& root, std::vector<std::string>* problems) {
  std::set<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) {
    problems->push_back(absl::StrCat(root, ": not a directory"));
    return out;
  }
  for (auto it = fs::recursive_directory_iterator(root, ec); !ec && it != fs::end(it);
       it.increment(ec)) {
    if (it->is_regular_file()) out.insert(fs::relative(it->path(), root).string());
  }
  if (ec) problems->push_back(absl::StrCat(root, ": ", ec.message()));
  return out;
}

// Float bits -> an integer whose order is the float order: negative floats are mirrored
// below zero, so +0 and -0 meet and neighbouring floats are 1 apart.
int64_t ordered_bits(uint64_t bits, int width) {
  const uint64_t sign = uint64_t{1} << (width - 1);
  const int64_t magnitude = static_cast<int64_t>(bits & (sign - 1));
  return (bits & sign) ? -magnitude : magnitude;
}

double element_value(const uint8_t* p, at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble: {
      double v;
      std::memcpy(&v, p, 8);
      return v;
    }
    case at::kFloat: {
      float v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case at::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      uint32_t u = uint32_t{b} << 16;
      float v;
      std::memcpy(&v, &u, 4);
      return v;
    }
    case at::kHalf: {
      c10::Half h;
      std::memcpy(&h, p, 2);
      return static_cast<float>(h);
    }
    case at::kLong: {
      int64_t v;
      std::memcpy(&v, p, 8);
      return static_cast<double>(v);
    }
    case at::kInt: {
      int32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case at::kShort: {
      int16_t v;
      std::memcpy(&v, p, 2);
      return v;
    }
    case at::kChar: return static_cast<int8_t>(*p);
    default: return *p;  // U8, BOOL
  }
}

bool is_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf || t == at::kDouble;
}

TensorComparison compare_tensors(const std::string& file, const std::string& name,
                                 const at::Tensor& a, const at::Tensor& b) {
  TensorComparison c;
  c.file = file;
  c.name = name;
  const std::string spec_a = io::describe_spec(io::spec_of(a));
  const std::string spec_b = io::describe_spec(io::spec_of(b));
  c.spec = spec_a == spec_b ? spec_a : absl::StrCat(spec_a, " vs ", spec_b);
  c.numel = a.numel();
  if (spec_a != spec_b) {
    c.equal = false;
    c.differing = std::max(a.numel(), b.numel());
    return c;
  }
  const at::ScalarType dtype = a.scalar_type();
  const int64_t size = static_cast<int64_t>(a.element_size());
  const auto* pa = static_cast<const uint8_t*>(a.data_ptr());
  const auto* pb = static_cast<const uint8_t*>(b.data_ptr());
  c.has_ulp = is_float(dtype);
  // Equal tensors are the common case (a passing protocol reads ~26 GB per 0.8B step): one
  // memcmp of the whole buffer, and the per-element walk only for tensors that differ.
  if (std::memcmp(pa, pb, static_cast<size_t>(c.numel * size)) == 0) return c;
  for (int64_t i = 0; i < c.numel; ++i) {
    const uint8_t* ea = pa + i * size;
    const uint8_t* eb = pb + i * size;
    if (std::memcmp(ea, eb, size) == 0) continue;
    c.equal = false;
    ++c.differing;
    const double va = element_value(ea, dtype), vb = element_value(eb, dtype);
    const bool nan = std::isnan(va) || std::isnan(vb);
    c.max_abs_diff = nan ? NAN : std::max(c.max_abs_diff, std::fabs(va - vb));
    if (c.has_ulp) {
      uint64_t ba = 0, bb = 0;
      std::memcpy(&ba, ea, size);
      std::memcpy(&bb, eb, size);
      const int64_t oa = ordered_bits(ba, 8 * size), ob = ordered_bits(bb, 8 * size);
      const uint64_t ulp = nan ? UINT64_MAX : static_cast<uint64_t>(std::llabs(oa - ob));
      c.max_ulp_diff = std::max(c.max_ulp_diff, ulp);
    }
  }
  return c;
}

void compare_safetensors(const std::string& rel, const std::string& pa, const std::string& pb,
                         SnapshotComparison* out) {
  absl::StatusOr<io::SafetensorsContents> a = io::read_safetensors(pa);
  absl::StatusOr<io::SafetensorsContents> b = io::read_safetensors(pb);
  for (const auto* r : {&a, &b}) {
    if (!r->ok()) out->problems.push_back(std::string(r->status().message()));
  }
  if (!a.ok() || !b.ok()) return;
  std::map<std::string, const at::Tensor*> tb;
  for (const auto& [name, t] : b->tensors) tb[name] = &t;
  std::set<std::string> seen;
  for (const auto& [name, t] : a->tensors) {
    seen.insert(name);
    auto it = tb.find(name);
    if (it == tb.end()) {
      out->problems.push_back(absl::StrCat(rel, ": tensor ", name, " missing from ", pb));
      continue;
    }
    out->items.push_back(compare_tensors(rel, name, t, *it->second));
  }
  for (const auto& [name, t] : b->tensors) {
    if (!seen.count(name)) {
      out->problems.push_back(absl::StrCat(rel, ": tensor ", name, " missing from ", pa));
    }
  }
}

}  // namespace

CompareOutcome SnapshotComparison::outcome() const {
  if (!problems.empty()) return CompareOutcome::kMissing;
  return num_different() > 0 ? CompareOutcome::kDifferent : CompareOutcome::kEqual;
}

int64_t SnapshotComparison::num_different() const {
  return std::count_if(items.begin(), items.end(), [](const auto& c) { return !c.equal; });
}

std::string SnapshotComparison::report(bool verbose) const {
  std::string out;
  for (const TensorComparison& c : items) {
    if (c.equal && !verbose) continue;
    absl::StrAppend(&out, c.equal ? "EQUAL " : "DIFF  ", c.file);
    if (!c.name.empty()) absl::StrAppend(&out, " ", c.name, " ", c.spec);
    if (!c.equal && !c.name.empty()) {
      absl::StrAppend(&out, ": ", c.differing, " of ", c.numel, " elements differ, max abs diff ",
                      c.max_abs_diff);
      if (c.has_ulp) absl::StrAppend(&out, ", max ULP diff ", c.max_ulp_diff);
    } else if (!c.equal) {
      absl::StrAppend(&out, ": bytes differ");
    }
    absl::StrAppend(&out, "\n");
  }
  for (const std::string& p : problems) absl::StrAppend(&out, "MISSING ", p, "\n");
  const char* verdict = outcome() == CompareOutcome::kEqual       ? "equal"
                        : outcome() == CompareOutcome::kDifferent ? "different"
                                                                  : "evidence missing";
  absl::StrAppend(&out, "compared ", items.size(), " items: ", num_different(), " differ, ",
                  problems.size(), " missing or unreadable: ", verdict, "\n");
  return out;
}

SnapshotComparison compare_snapshot_dirs(const std::string& dir_a, const std::string& dir_b) {
  SnapshotComparison out;
  const std::set<std::string> files_a = regular_files(dir_a, &out.problems);
  const std::set<std::string> files_b = regular_files(dir_b, &out.problems);
  for (const std::string& rel : files_a) {
    if (!files_b.count(rel)) out.problems.push_back(absl::StrCat(rel, ": missing from ", dir_b));
  }
  for (const std::string& rel : files_b) {
    if (!files_a.count(rel)) out.problems.push_back(absl::StrCat(rel, ": missing from ", dir_a));
  }
  for (const std::string& rel : files_a) {
    if (!files_b.count(rel)) continue;
    const std::string pa = io::join_path(dir_a, rel), pb = io::join_path(dir_b, rel);
    if (absl::EndsWith(rel, ".safetensors")) {
      compare_safetensors(rel, pa, pb, &out);
      continue;
    }
    absl::StatusOr<std::string> a = io::read_file(pa), b = io::read_file(pb);
    if (!a.ok() || !b.ok()) {
      out.problems.push_back(std::string((!a.ok() ? a : b).status().message()));
      continue;
    }
    TensorComparison c;
    c.file = rel;
    c.equal = *a == *b;
    out.items.push_back(c);
  }
  return out;
}

}  // namespace gdr
