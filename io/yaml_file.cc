#include "io/yaml_file.h"

#include "absl/strings/str_cat.h"

namespace gdr::io {

absl::StatusOr<YAML::Node> load_yaml_file(const std::string& path) {
  try {
    return YAML::LoadFile(path);
  } catch (const YAML::BadFile&) {
    return absl::NotFoundError(absl::StrCat(path, ": cannot open the config file"));
  } catch (const YAML::ParserException& e) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ":", e.mark.line + 1, ":", e.mark.column + 1, ": parse error: ", e.msg));
  }
}

std::string describe_yaml_node(const YAML::Node& node) {
  if (!node.IsDefined() || node.IsNull()) return "null";
  if (node.IsSequence()) return "a list";
  if (node.IsMap()) return "a mapping";
  return absl::StrCat("'", node.Scalar(), "'");
}

bool is_plain_yaml_scalar(const YAML::Node& node) {
  return node.IsDefined() && node.IsScalar() && node.Tag() != "!";
}

std::optional<std::string> yaml_key_text(const YAML::Node& key) {
  if (!key.IsDefined() || !key.IsScalar()) return std::nullopt;
  return key.Scalar();
}

}  // namespace gdr::io
