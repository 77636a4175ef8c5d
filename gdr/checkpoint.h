// Training checkpoints: one directory per step, written atomically and verified on load.
//
// Layout of <checkpoint_dir>/step_<N>/:
//   model.safetensors      FP32 master weights under Hugging Face names
//   optimizer.safetensors  per parameter "<name>.exp_avg", "<name>.exp_avg_sq" (FP32, never
//                          rounded) and "<name>.step" (I64 scalar); empty before step 1
//   state.json             {"format", "step", "data_position": {"epoch", "index"},
//                           "rng_cpu": hex bytes of the CPU generator state, "config": the
//                           effective run config text, "execution_policy": the run's kernel
//                           and determinism choices (describe_execution_policy), "files":
//                           {name: {"sha256", "bytes"}}}
//   COMPLETE               "sha256 <hex of state.json>\n", written last
//
// Note [Atomic checkpoint directories]: the files are written into a sibling directory
// ".step_<N>.partial", each one atomically and fsynced (Note [Atomic file writes] in
// io/file_util.h), COMPLETE last; then the directory is fsynced and renamed to step_<N>
// and the parent fsynced. A crash leaves either no step_<N> or a complete one; a step_<N>
// without COMPLETE (copied half-way, written by hand) is refused. Loading checks COMPLETE,
// then state.json against COMPLETE's digest, then every file against state.json's digests,
// so a flipped bit anywhere is refused before any tensor is used.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "gdr/data.h"
#include "io/safetensors.h"

namespace gdr {

inline constexpr char kCheckpointFormat[] = "gdr-checkpoint-1";
inline constexpr char kCompleteMarker[] = "COMPLETE";

struct TrainingState {
  int64_t step = 0;
  DataPosition data_position;
  std::string rng_cpu_hex;
  std::string config_text;
  // describe_execution_policy of the run that wrote it ("" in older checkpoints).
  std::string execution_policy;
};

struct Checkpoint {
  io::NamedTensors model;
  io::NamedTensors optimizer;
  TrainingState state;
};

// "<checkpoint_dir>/step_<step>".
std::string checkpoint_step_dir(const std::string& checkpoint_dir, int64_t step);

// Writes `checkpoint` to `step_dir` (replacing an existing one), atomically.
absl::Status write_checkpoint(const std::string& step_dir, const Checkpoint& checkpoint);

// Reads and verifies a step directory. Errors (absl::DataLossError unless noted):
//   NotFound  "<dir>: no such checkpoint directory"
//             "<dir>: incomplete checkpoint: the COMPLETE marker is missing (the save did
//              not finish); refusing to load it"
//             "<dir>/<file>: checksum mismatch: expected sha256 <a> but the file has <b>;
//              the checkpoint is corrupted, refusing to load it"
absl::StatusOr<Checkpoint> read_checkpoint(const std::string& step_dir);

// `dir` itself when it holds a state.json or a COMPLETE marker, else the step_<N>
// subdirectory with the highest N that has a COMPLETE marker (NotFound when none).
absl::StatusOr<std::string> resolve_checkpoint_dir(const std::string& dir);

}  // namespace gdr
