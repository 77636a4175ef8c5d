// Host-side launch rules of the RMSNorm kernels (kernels/rms_norm/rms_norm.h); no CUDA needed.
#include <algorithm>

#include "kernels/rms_norm/rms_norm.h"

namespace gdr::kernels {

bool rms_norm_supports_cols(int64_t cols) { return cols >= 1 && cols <= kRmsNormMaxCols; }

RmsNormBackwardLaunch derive_rms_norm_backward_launch(int64_t rows, int64_t cols) {
  RmsNormBackwardLaunch launch;
  if (!rms_norm_supports_cols(cols) || rows < 0) return launch;
  const int64_t row_bytes = cols * static_cast<int64_t>(sizeof(float));
  launch.warps = static_cast<int>(
      std::clamp<int64_t>(kRmsNormSharedBudget / row_bytes, 1, kRmsNormBackwardMaxWarps));
  // At least one row per warp; beyond kRmsNormTargetPrograms programs, more rows per
  // program (a multiple of the warp count, so every warp gets the same number of rows in
  // full programs) rather than more partial rows for the second pass to sum.
  const int64_t per_program = (rows + kRmsNormTargetPrograms - 1) / kRmsNormTargetPrograms;
  const int64_t warps = launch.warps;
  launch.rows_per_program = std::max<int64_t>(warps, (per_program + warps - 1) / warps * warps);
  launch.programs = (rows + launch.rows_per_program - 1) / launch.rows_per_program;
  launch.scratch_floats = launch.programs * cols;
  launch.shared_bytes = warps * row_bytes;
  return launch;
}

}  // namespace gdr::kernels
