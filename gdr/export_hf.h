// Hands a trained model back to Hugging Face: a training checkpoint (gdr/checkpoint.h) to a
// directory that transformers loads with Qwen3_5ForCausalLM.from_pretrained.
//
// The checkpoint's own state.json carries the run config, so the model's shape comes from
// the checkpoint and nothing else; its FP32 masters are written in `dtype` under their HF
// names with config.json (model_type qwen3_5_text, "dtype"). Tokenizer and generation files
// (tokenizer.json, tokenizer_config.json, generation_config.json, ...) are copied from
// `companion_dir`, by default the run's train.init_from when that is a directory, so a model
// started from a released checkpoint goes back out complete.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"

namespace gdr {

struct ExportHfOptions {
  at::ScalarType dtype = at::kBFloat16;  // BF16 (as HF ships) or Float
  // Where tokenizer/generation files come from; "" = the run's train.init_from if it is a
  // directory, else none are copied.
  std::string companion_dir;
  // When not empty: gdr's FP32 CPU logits for a fixed batch (tensors "input_ids" I64 [B, T]
  // and "logits" F32 [B, T, vocab]), computed from the weights as written (after the dtype
  // rounding), for comparing with transformers (tools/hf/check_export.py).
  std::string reference_logits_path;
};

struct ExportHfReport {
  std::string step_dir;  // the checkpoint step directory read
  int64_t step = 0;
  int64_t tensors = 0;
  int64_t bytes = 0;                      // of the weight files written
  std::vector<std::string> copied_files;  // from the companion directory
};

// The reference batch of ExportHfOptions::reference_logits_path: B = 2 rows of T tokens
// drawn uniformly from [0, vocab_size) by a generator seeded with 0.
inline constexpr int64_t kReferenceBatchRows = 2;
inline constexpr int64_t kReferenceBatchTokens = 64;

// Reads `checkpoint` (a step directory or a checkpoint_dir, whose newest complete step is
// taken; verified as resume verifies it) and writes `output_dir`, which must not exist or be
// empty. The files go to a sibling "<output_dir>.partial" first, which is renamed when
// complete, so a crash never leaves a half-written model under output_dir. Errors name the
// file or the flag: an unreadable or corrupted checkpoint, a non-empty output_dir, a dtype
// other than BFloat16/Float, an unreadable companion directory.
absl::StatusOr<ExportHfReport> export_hf_checkpoint(const std::string& checkpoint,
                                                    const std::string& output_dir,
                                                    const ExportHfOptions& options = {});

}  // namespace gdr
