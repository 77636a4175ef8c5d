// Command-line pieces the benchmarks share: the --dtypes=bf16,f16,f32 list.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

namespace gdr::bench {

// Parses a comma-separated dtype list ("bf16", "f16" when allow_f16, "f32") into `out`.
// On a bad or missing item prints "<program>: --dtypes expects <names>, got '<item>'" to
// stderr and returns false.
inline bool parse_dtype_list(const char* program, const std::string& list, bool allow_f16,
                             std::vector<at::ScalarType>& out) {
  const char* names = allow_f16 ? "bf16, f16 or f32" : "bf16 or f32";
  out.clear();
  std::stringstream items(list);
  std::string item;
  while (std::getline(items, item, ',')) {
    if (item == "bf16") {
      out.push_back(at::kBFloat16);
    } else if (item == "f16" && allow_f16) {
      out.push_back(at::kHalf);
    } else if (item == "f32") {
      out.push_back(at::kFloat);
    } else {
      std::fprintf(stderr, "%s: --dtypes expects %s, got '%s'\n", program, names, item.c_str());
      return false;
    }
  }
  if (out.empty()) {
    std::fprintf(stderr, "%s: --dtypes expects %s, got an empty list\n", program, names);
    return false;
  }
  return true;
}

}  // namespace gdr::bench
