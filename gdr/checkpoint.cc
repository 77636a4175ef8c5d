#include "gdr/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "gdr/sha256.h"
#include "io/file_util.h"

namespace gdr {
namespace fs = std::filesystem;
namespace {

constexpr const char* kTensorFiles[] = {"model.safetensors", "optimizer.safetensors"};
constexpr char kStateFile[] = "state.json";

absl::Status fsync_dir(const std::string& dir) {
  const int fd = open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return absl::InternalError(absl::StrCat(dir, ": cannot open directory to fsync"));
  const int rc = fsync(fd);
  close(fd);
  if (rc != 0) return absl::InternalError(absl::StrCat(dir, ": fsync failed"));
  return absl::OkStatus();
}

absl::Status fs_error(const std::string& what, const std::error_code& ec) {
  return absl::InternalError(absl::StrCat(what, ": ", ec.message()));
}

std::string strip_trailing_slashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

absl::Status verify_digest(const std::string& path, const std::string& expected) {
  absl::StatusOr<std::string> actual = sha256_file_hex(path);
  if (!actual.ok()) return actual.status();
  if (*actual != expected) {
    return absl::DataLossError(absl::StrCat(path, ": checksum mismatch: expected sha256 ", expected,
                                            " but the file has ", *actual,
                                            "; the checkpoint is corrupted, refusing to load it"));
  }
  return absl::OkStatus();
}

}  // namespace

std::string checkpoint_step_dir(const std::string& checkpoint_dir, int64_t step) {
  return io::join_path(strip_trailing_slashes(checkpoint_dir), absl::StrCat("step_", step));
}

absl::Status write_checkpoint(const std::string& step_dir_in, const Checkpoint& checkpoint) {
  const std::string step_dir = strip_trailing_slashes(step_dir_in);
  const std::string parent = io::dirname_of(step_dir);
  const std::string base = fs::path(step_dir).filename().string();
  const std::string partial = io::join_path(parent, absl::StrCat(".", base, ".partial"));
  std::error_code ec;
  fs::create_directories(parent, ec);
  if (ec) return fs_error(parent, ec);
  fs::remove_all(partial, ec);
  if (ec) return fs_error(partial, ec);
  fs::create_directory(partial, ec);
  if (ec) return fs_error(partial, ec);

  nlohmann::ordered_json files = nlohmann::ordered_json::object();
  const io::NamedTensors* sets[] = {&checkpoint.model, &checkpoint.optimizer};
  for (int i = 0; i < 2; ++i) {
    const std::string path = io::join_path(partial, kTensorFiles[i]);
    if (absl::Status s = io::write_safetensors(path, *sets[i]); !s.ok()) return s;
    // Digest what is on disk, not what we meant to write (streamed: a 0.8B optimizer file
    // is 6.4 GB).
    absl::StatusOr<std::string> digest = sha256_file_hex(path);
    if (!digest.ok()) return digest.status();
    std::error_code size_error;
    const uintmax_t bytes = fs::file_size(path, size_error);
    if (size_error) return fs_error(path, size_error);
    files[kTensorFiles[i]] = {{"sha256", *digest}, {"bytes", bytes}};
  }
  const TrainingState& st = checkpoint.state;
  nlohmann::ordered_json state = {
      {"format", kCheckpointFormat},
      {"step", st.step},
      {"data_position", {{"epoch", st.data_position.epoch}, {"index", st.data_position.index}}},
      {"rng_cpu", st.rng_cpu_hex},
      {"config", st.config_text},
      {"execution_policy", st.execution_policy},
      {"files", files},
  };
  const std::string state_text = state.dump(2) + "\n";
  if (absl::Status s = io::write_file_atomically(io::join_path(partial, kStateFile), state_text);
      !s.ok()) {
    return s;
  }
  if (absl::Status s =
          io::write_file_atomically(io::join_path(partial, kCompleteMarker),
                                    absl::StrCat("sha256 ", sha256_hex(state_text), "\n"));
      !s.ok()) {
    return s;
  }
  if (absl::Status s = fsync_dir(partial); !s.ok()) return s;

  // Replace an older copy of the same step: move it aside first, since rename(2) cannot
  // replace a non-empty directory.
  const std::string old = io::join_path(parent, absl::StrCat(".", base, ".old"));
  fs::remove_all(old, ec);
  if (fs::exists(step_dir)) {
    fs::rename(step_dir, old, ec);
    if (ec) return fs_error(step_dir, ec);
  }
  fs::rename(partial, step_dir, ec);
  if (ec) return fs_error(step_dir, ec);
  fs::remove_all(old, ec);
  return fsync_dir(parent);
}

absl::StatusOr<Checkpoint> read_checkpoint(const std::string& step_dir_in) {
  const std::string dir = strip_trailing_slashes(step_dir_in);
  if (!fs::is_directory(dir)) {
    return absl::NotFoundError(absl::StrCat(dir, ": no such checkpoint directory"));
  }
  absl::StatusOr<std::string> marker = io::read_file(io::join_path(dir, kCompleteMarker));
  if (!marker.ok()) {
    return absl::DataLossError(
        absl::StrCat(dir,
                     ": incomplete checkpoint: the COMPLETE marker is missing (the save did not "
                     "finish); refusing to load it"));
  }
  absl::string_view digest = *marker;
  if (!absl::ConsumePrefix(&digest, "sha256 ") || !absl::ConsumeSuffix(&digest, "\n") ||
      digest.size() != 64) {
    return absl::DataLossError(
        absl::StrCat(dir, "/", kCompleteMarker, ": expected \"sha256 <64 hex digits>\\n\""));
  }
  const std::string state_path = io::join_path(dir, kStateFile);
  if (absl::Status s = verify_digest(state_path, std::string(digest)); !s.ok()) return s;
  absl::StatusOr<std::string> state_text = io::read_file(state_path);
  if (!state_text.ok()) return state_text.status();

  Checkpoint checkpoint;
  try {
    const nlohmann::json state = nlohmann::json::parse(*state_text);
    if (state.at("format") != kCheckpointFormat) {
      return absl::DataLossError(absl::StrCat(state_path, ": expected format ", kCheckpointFormat,
                                              " but got ", state.at("format").dump()));
    }
    checkpoint.state.step = state.at("step").get<int64_t>();
    checkpoint.state.data_position.epoch = state.at("data_position").at("epoch").get<int64_t>();
    checkpoint.state.data_position.index = state.at("data_position").at("index").get<int64_t>();
    checkpoint.state.rng_cpu_hex = state.at("rng_cpu").get<std::string>();
    checkpoint.state.config_text = state.at("config").get<std::string>();
    // Absent in checkpoints written before the execution policy existed.
    if (state.contains("execution_policy")) {
      checkpoint.state.execution_policy = state.at("execution_policy").get<std::string>();
    }
    for (const char* name : kTensorFiles) {
      const std::string path = io::join_path(dir, name);
      const std::string expected = state.at("files").at(name).at("sha256").get<std::string>();
      if (absl::Status s = verify_digest(path, expected); !s.ok()) return s;
    }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(state_path, ": malformed: ", e.what()));
  }
  io::NamedTensors* sets[] = {&checkpoint.model, &checkpoint.optimizer};
  for (int i = 0; i < 2; ++i) {
    absl::StatusOr<io::SafetensorsContents> contents =
        io::read_safetensors(io::join_path(dir, kTensorFiles[i]));
    if (!contents.ok()) return contents.status();
    *sets[i] = std::move(contents->tensors);
  }
  return checkpoint;
}

absl::StatusOr<std::string> resolve_checkpoint_dir(const std::string& dir_in) {
  const std::string dir = strip_trailing_slashes(dir_in);
  if (!fs::is_directory(dir)) {
    return absl::NotFoundError(absl::StrCat(dir, ": no such checkpoint directory"));
  }
  if (fs::exists(io::join_path(dir, kStateFile)) ||
      fs::exists(io::join_path(dir, kCompleteMarker))) {
    return dir;
  }
  int64_t best = -1;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir)) {
    absl::string_view name = entry.path().filename().native();
    int64_t step = 0;
    if (!absl::ConsumePrefix(&name, "step_") || !absl::SimpleAtoi(name, &step)) continue;
    if (fs::exists(entry.path() / kCompleteMarker) && step > best) best = step;
  }
  if (best < 0) {
    return absl::NotFoundError(
        absl::StrCat(dir, ": no complete checkpoint (step_<N>/COMPLETE) in this directory"));
  }
  return checkpoint_step_dir(dir, best);
}

}  // namespace gdr
