// Reads a YAML (or JSON) file with yaml-cpp, turning its exceptions into absl::Status
// errors that name the file (and line:column for parse errors). Shared by every config
// loader so they report files the same way.
#pragma once

#include <yaml-cpp/yaml.h>

#include <string>

#include "absl/status/statusor.h"

namespace gdr::io {

// NotFound "<path>: cannot open the config file", or InvalidArgument
// "<path>:<line>:<column>: parse error: <what>".
absl::StatusOr<YAML::Node> load_yaml_file(const std::string& path);

}  // namespace gdr::io
