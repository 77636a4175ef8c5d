// Host-side launch rules of the causal conv1d + SiLU kernels
// (kernels/causal_conv1d/causal_conv1d.h); no CUDA needed.
#include "kernels/causal_conv1d/causal_conv1d.h"

namespace gdr::kernels {

bool causal_conv_supports(const CausalConvShape& shape) {
  return shape.taps >= kCausalConvMinTaps && shape.taps <= kCausalConvMaxTaps &&
         shape.channels >= 1 && shape.batch >= 0 && shape.seq >= 0;
}

CausalConvBackwardLaunch derive_causal_conv_backward_launch(const CausalConvShape& shape) {
  CausalConvBackwardLaunch launch;
  if (!causal_conv_supports(shape)) return launch;
  auto programs_for = [&](int64_t tile_tokens) {
    const int64_t tiles = shape.batch * ((shape.seq + tile_tokens - 1) / tile_tokens);
    return (tiles + kCausalConvTileRows - 1) / kCausalConvTileRows;
  };
  int64_t tile_tokens = kCausalConvBackwardMinTileTokens;
  // Doubling stops once a tile holds the whole sequence: longer tiles would change nothing.
  while (programs_for(tile_tokens) > kCausalConvTargetPrograms && tile_tokens < shape.seq) {
    tile_tokens *= 2;
  }
  launch.tile_tokens = tile_tokens;
  launch.tiles_per_seq = (shape.seq + tile_tokens - 1) / tile_tokens;
  launch.programs = shape.batch * shape.seq == 0 ? 0 : programs_for(tile_tokens);
  launch.scratch_floats = launch.programs * shape.channels * shape.taps;
  return launch;
}

}  // namespace gdr::kernels
