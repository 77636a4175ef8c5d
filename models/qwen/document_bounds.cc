#include "models/qwen/document_bounds.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace gdr {

absl::StatusOr<DocumentBounds> DocumentBounds::create(std::vector<std::vector<int64_t>> starts,
                                                      int64_t length) {
  if (length < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("document bounds: expected a row length >= 1 but got ", length));
  }
  if (starts.empty()) {
    return absl::InvalidArgumentError("document bounds: expected at least one row but got none");
  }
  DocumentBounds bounds;
  bounds.length_ = length;
  for (size_t r = 0; r < starts.size(); ++r) {
    const std::vector<int64_t>& row = starts[r];
    bool valid = !row.empty() && row.front() == 0 && row.back() < length;
    for (size_t i = 1; valid && i < row.size(); ++i) valid = row[i] > row[i - 1];
    if (!valid) {
      return absl::InvalidArgumentError(absl::StrCat(
          "document bounds: row ", r, ": expected strictly increasing document starts in [0, ",
          length, ") beginning with 0 but got [", absl::StrJoin(row, ", "), "]"));
    }
    const int64_t base = static_cast<int64_t>(r) * length;
    for (int64_t s : row) bounds.cu_seqlens_.push_back(base + s);
    if (row.size() > 1) bounds.single_documents_ = false;
  }
  bounds.cu_seqlens_.push_back(static_cast<int64_t>(starts.size()) * length);
  bounds.starts_ = std::move(starts);
  return bounds;
}

std::vector<int64_t> DocumentBounds::flat_starts_after_the_first() const {
  std::vector<int64_t> positions;
  for (size_t r = 0; r < starts_.size(); ++r) {
    for (size_t i = 1; i < starts_[r].size(); ++i) {
      positions.push_back(static_cast<int64_t>(r) * length_ + starts_[r][i]);
    }
  }
  return positions;
}

}  // namespace gdr
