// error_of: the message of the c10::Error a call throws, for tests that assert exact
// error messages (TORCH_CHECK text without the backtrace); "(no error)" when it throws none.
#pragma once

#include <c10/util/Exception.h>

#include <functional>
#include <string>

namespace gdr::test_support {

inline std::string error_of(const std::function<void()>& call) {
  try {
    call();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

}  // namespace gdr::test_support
