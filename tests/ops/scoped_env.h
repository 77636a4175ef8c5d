// ScopedEnv: sets one environment variable for its lifetime and restores the previous
// value (or unsets it) on destruction, for tests of the op layer's environment switches,
// which are read at every call.
#pragma once

#include <cstdlib>
#include <string>

namespace gdr::test_support {

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* previous = std::getenv(name);
    had_previous_ = previous != nullptr;
    if (had_previous_) previous_ = previous;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_previous_) {
      setenv(name_.c_str(), previous_.c_str(), 1);
    } else {
      unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  bool had_previous_ = false;
  std::string previous_;
};

// A tensor-core kernel switch of the op layer (GDR_CHUNK_SCAN_TC, GDR_CHUNK_PREP_TC,
// GDR_CHUNK_GEMM_TC: "1" tensor cores, "0" the other kernels) for its lifetime, or a value
// the op must refuse.
template <const char* kVariable>
class ScopedKernelSwitch : public ScopedEnv {
 public:
  explicit ScopedKernelSwitch(bool tensor_cores) : ScopedKernelSwitch(tensor_cores ? "1" : "0") {}
  explicit ScopedKernelSwitch(const char* value) : ScopedEnv(kVariable, value) {}
};

inline constexpr char kScanSwitch[] = "GDR_CHUNK_SCAN_TC";
inline constexpr char kPrepSwitch[] = "GDR_CHUNK_PREP_TC";
inline constexpr char kGemmSwitch[] = "GDR_CHUNK_GEMM_TC";
// Not a tensor-core switch: "1" runs the backward's dQd and dP GEMMs beside the scan on a
// side stream (the default), "0" in line.
inline constexpr char kGemmOverlapSwitch[] = "GDR_CHUNK_GEMM_OVERLAP";

}  // namespace gdr::test_support
