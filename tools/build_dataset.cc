// build_dataset: text file -> Megatron indexed dataset (PREFIX.bin + PREFIX.idx), byte-level
// tokens (each byte one token id 0..255), one document per blank-line-separated paragraph.
//
//   bazel run //tools:build_dataset -- --input=data/corpus.txt --output=runs/corpus
//   [--dtype=uint16]
//
// The result is read by the trainer with data.source: indexed, data.path: PREFIX.
// Exit status: 0 done, 2 bad input (one line on stderr).
#include <unistd.h>

#include <cstdlib>
#include <iostream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "io/indexed_dataset.h"

namespace {

constexpr char kUsage[] =
    "usage: build_dataset --input=TEXT --output=PREFIX [--dtype=uint8|uint16]\n"
    "Writes PREFIX.bin and PREFIX.idx (Megatron MMIDIDX format) from a text file: byte-level\n"
    "tokens, one document per blank-line-separated paragraph.\n";

int fail(absl::string_view message) {
  std::cerr << "build_dataset: error: " << message << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  if (const char* wd = std::getenv("BUILD_WORKING_DIRECTORY"); wd != nullptr && *wd != '\0') {
    if (chdir(wd) != 0) return fail(std::string("cannot enter ") + wd);
  }
  std::string input, output;
  gdr::io::TokenDType dtype = gdr::io::TokenDType::kUInt8;
  for (int i = 1; i < argc; ++i) {
    absl::string_view arg = argv[i];
    if (arg == "--help") {
      std::cout << kUsage;
      return 0;
    }
    if (absl::ConsumePrefix(&arg, "--input=")) {
      input = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--output=")) {
      output = std::string(arg);
    } else if (absl::ConsumePrefix(&arg, "--dtype=")) {
      if (arg == "uint8") {
        dtype = gdr::io::TokenDType::kUInt8;
      } else if (arg == "uint16") {
        dtype = gdr::io::TokenDType::kUInt16;
      } else {
        return fail("--dtype expects uint8 or uint16, got '" + std::string(arg) + "'");
      }
    } else {
      return fail(std::string("unknown argument '") + argv[i] + "' (see --help)");
    }
  }
  if (input.empty() || output.empty())
    return fail("--input and --output are required (see --help)");
  auto stats = gdr::io::build_indexed_dataset_from_text(input, output, dtype);
  if (!stats.ok()) return fail(stats.status().message());
  std::cout << "wrote " << output << ".bin/.idx: " << stats->num_documents << " documents, "
            << stats->num_tokens << " tokens\n";
  return 0;
}
