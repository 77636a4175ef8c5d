// Reads a YAML (or JSON) file with yaml-cpp, turning its exceptions into absl::Status
// errors that name the file (and line:column for parse errors). Shared by every config
// loader so they report files the same way.
#pragma once

#include <yaml-cpp/yaml.h>

#include <optional>
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

// A mapping key as text: the key's scalar, or nullopt when the key is a list or a mapping
// (valid YAML and JSON-with-YAML-syntax, but never the name of a setting; `.as<std::string>()`
// would throw). The loaders refuse such a key with a message naming the file.
std::optional<std::string> yaml_key_text(const YAML::Node& key);

// Reads a plain scalar as T (an integer, number or bool type) into `out`. Returns the
// problem, "expected <expected> but got <node>" (describe_yaml_node), when the node is not
// a plain scalar or does not convert; nullopt when it read. The config loaders put their
// "<file>: <key>: " in front.
template <typename T>
std::optional<std::string> read_plain_yaml_scalar(const YAML::Node& node,
                                                  const std::string& expected, T* out) {
  const std::string problem = "expected " + expected + " but got " + describe_yaml_node(node);
  if (!is_plain_yaml_scalar(node)) return problem;
  try {
    *out = node.as<T>();
  } catch (const YAML::Exception&) {
    return problem;
  }
  return std::nullopt;
}

}  // namespace gdr::io
