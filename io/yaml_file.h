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

// How a node reads in an error message: "null", "a list", "a mapping" or "'<scalar>'".
std::string describe_yaml_node(const YAML::Node& node);

// A plain (unquoted) scalar. A quoted scalar ("64") carries the non-specific tag "!": it is
// a string, not a number or a bool, even though yaml-cpp would convert it.
bool is_plain_yaml_scalar(const YAML::Node& node);

}  // namespace gdr::io
