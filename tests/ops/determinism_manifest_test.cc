// Keeps ops/policy/determinism_manifest.txt honest: every kernel that uses an atomic is listed,
// every listed kernel exists, and every replay test named there is a real test target.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "ops/policy/determinism_manifest.h"

namespace gdr {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

std::vector<ManifestEntry> manifest() {
  auto entries = parse_determinism_manifest(read_text("ops/policy/determinism_manifest.txt"),
                                            "ops/policy/determinism_manifest.txt");
  EXPECT_TRUE(entries.ok()) << entries.status();
  return entries.ok() ? *entries : std::vector<ManifestEntry>{};
}

// Every .cu / .cuh under kernels/ (the kernel families' folders), as paths relative to the
// workspace root ("kernels/gdr_core/chunk_state.cu"), the form the manifest uses.
std::vector<std::string> cuda_sources() {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(
           "kernels", std::filesystem::directory_options::follow_directory_symlink)) {
    const std::string ext = entry.path().extension().string();
    if (ext == ".cu" || ext == ".cuh") files.push_back(entry.path().generic_string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

TEST(DeterminismManifest, ListsEveryKernelThatUsesAnAtomic) {
  const std::vector<ManifestEntry> entries = manifest();
  const std::vector<std::string> files = cuda_sources();
  ASSERT_FALSE(files.empty()) << "no CUDA sources found under kernels/";
  for (const std::string& file : files) {
    for (const std::string& kernel : kernels_using_atomics(read_text(file))) {
      bool listed = false;
      for (const ManifestEntry& e : entries) listed |= e.file == file && e.kernel == kernel;
      EXPECT_TRUE(listed)
          << file << ": kernel " << kernel
          << " uses an atomic but has no line in ops/policy/determinism_manifest.txt "
             "(add its deterministic path and replay test)";
    }
  }
}

TEST(DeterminismManifest, EveryLineNamesARealKernelAndARealTestTarget) {
  for (const ManifestEntry& e : manifest()) {
    const std::set<std::string> kernels = kernel_names(read_text(e.file));
    EXPECT_TRUE(kernels.count(e.kernel)) << e.file << " has no __global__ " << e.kernel;
    const std::string package = e.replay_test.substr(2, e.replay_test.find(':') - 2);
    const std::string target = e.replay_test.substr(e.replay_test.find(':') + 1);
    const std::string build = read_text(package + "/BUILD");
    EXPECT_NE(build.find("name = \"" + target + "\""), std::string::npos)
        << e.replay_test << " is not a target in " << package << "/BUILD";
    EXPECT_TRUE(build.find("gdr_test(") != std::string::npos ||
                build.find("cc_test(") != std::string::npos)
        << package << "/BUILD defines no test";
  }
}

TEST(DeterminismManifest, CheckerFindsAPlantedAtomicAndItsKernel) {
  const std::string source = R"(
__global__ void clean_kernel(float* out) { out[threadIdx.x] = 1.0f; }
template <typename T>
__global__ void __launch_bounds__(256) sneaky_sum(const T* in, float* out) {
  float v = in[threadIdx.x];
  atomicAdd(out, v);
}
__global__ void ptx_reduce(float* out) { asm volatile("red.global.add.f32 [%0], %1;" :: "l"(out), "f"(1.0f)); }
__global__ void libcu_ticket(unsigned* counter) {
  cuda::atomic_ref<unsigned, cuda::thread_scope_device> ticket(*counter);
  ticket.fetch_add(1u);
}
)";
  EXPECT_EQ(kernel_names(source),
            (std::set<std::string>{"clean_kernel", "sneaky_sum", "ptx_reduce", "libcu_ticket"}));
  EXPECT_EQ(kernels_using_atomics(source),
            (std::set<std::string>{"sneaky_sum", "ptx_reduce", "libcu_ticket"}));
}

TEST(DeterminismManifest, MalformedLinesAreRefusedWithTheirLineNumber) {
  auto bad = parse_determinism_manifest("# header\na.cu | k | r | p\n", "m.txt");
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(),
            "m.txt:2: expected 5 '|'-separated fields (file | kernel | reduction | deterministic "
            "path | replay test), got 4");
  auto no_label = parse_determinism_manifest("a.cu | k | r | p | tests/foo\n", "m.txt");
  ASSERT_FALSE(no_label.ok());
  EXPECT_EQ(no_label.status().message(),
            "m.txt:1: replay test must be a Bazel label //package:target, got 'tests/foo'");
}

}  // namespace
}  // namespace gdr
