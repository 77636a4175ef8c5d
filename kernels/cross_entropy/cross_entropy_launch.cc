// Host-side launch rules of the cross-entropy kernels (kernels/cross_entropy/cross_entropy.h); no
// CUDA needed.
#include <cstdint>

#include "kernels/cross_entropy/cross_entropy.h"

namespace gdr::kernels {

int64_t cross_entropy_scored_rows(const CrossEntropyProblem& p) {
  return p.tokens >= 1 ? p.batch * (p.tokens - 1) : 0;
}

int cross_entropy_block_threads(int64_t vocab) {
  // About one 16-byte BF16 pack (8 elements) per thread per pass: short rows do not
  // leave most of a 512-thread block idle, long rows get the full block.
  const int64_t packs = (vocab + 7) / 8;
  int threads = 32;
  while (threads < kCrossEntropyMaxThreads && threads < packs) threads *= 2;
  return threads;
}

bool cross_entropy_supports(const CrossEntropyProblem& p) {
  constexpr int64_t kMaxBlocks = 0x7fffffffLL;  // grid.x
  return p.tokens >= 2 && p.vocab >= 1 && p.batch >= 0 && p.batch <= kMaxBlocks / p.tokens;
}

}  // namespace gdr::kernels
