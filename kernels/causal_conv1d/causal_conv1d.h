// Fused causal depthwise conv1d + SiLU, forward and backward: the Gated DeltaNet's short
// convolution over its qkv projection (models/qwen/layers.cc), in one pass over the
// activations instead of ATen's pad + transpose + cuDNN conv + SiLU. Plain C++ (no CUDA or
// torch headers): the launch rules below are host code, testable without a GPU.
//
// Math, per batch b, token t, channel c, with K taps and x[b, s, c] = 0 for s < 0:
//   pre[t]  = round(sum_{j<K} w[c, j] * x[t + j - K + 1])   FP32 accumulation, taps in j
//                                                            order (fmaf after the first)
//   y[t]    = round(silu(pre[t]))                            silu(p) = p / (1 + exp(-p))
//   dpre[t] = round(dy[t] * s * (1 + pre[t] * (1 - s)))      s = sigmoid(pre[t])
//   dx[t]   = round(sum_{j<K} w[c, j] * dpre[t + K - 1 - j]) dpre[s] = 0 for s >= T
//   dw[c,j] = round(sum_{b,t} dpre[b, t] * x[b, t + j - K + 1])
// where round() is to the activation dtype: exactly where the ATen composition (at::conv1d
// writing the activation dtype, at::silu, at::silu_backward) stores its intermediates, so
// the two differ only by the FP32 summation order of the taps and of dw. The backward
// recomputes pre from x (nothing is saved but x and w).
//
// Layout contract: x and grad_y are [B, T, C] with unit channel stride and any
// (non-negative) batch and token strides (TokenOperand); y and dx are written contiguous
// [B, T, C]; the weight is [C, K] contiguous (a [C, 1, K] conv weight), in the activation
// dtype. x, grad_y, y, dx, w share one storage dtype (ConvDtype); math is FP32. Every
// launcher runs on the stream it is given and returns 0 (cudaSuccess) or the CUDA error of
// the launch.
//
// Note [Causal conv determinism]: every output is deterministic by construction (no
// atomics). y and dx are per-element functions of their inputs. dw sums over all tokens:
// each thread sums its token tile in token order, the block's token tiles are added in
// tile order into one FP32 partial row per program (every slot written exactly once), and
// a second kernel on the same stream sums the partial rows in a fixed order; the grid is a
// pure function of (B, T, C, K) (derive_causal_conv_backward_launch), so the bits of dw
// depend on the shapes and the inputs only, never on the device's load or schedule.
#pragma once

#include <cstdint>

struct CUstream_st;

namespace gdr::kernels {

enum class ConvDtype : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Supported kernel sizes (linear_conv_kernel_dim; 4 in Qwen3.5). The kernels unroll over K.
constexpr int kCausalConvMinTaps = 2;
constexpr int kCausalConvMaxTaps = 4;

struct CausalConvShape {
  int64_t batch = 0;     // B
  int64_t seq = 0;       // T
  int64_t channels = 0;  // C
  int taps = 0;          // K
};

// A [B, T, C] operand with unit channel stride: element (b, t, c) sits at
// data + b * batch_stride + t * token_stride + c (element strides).
struct TokenOperand {
  const void* data = nullptr;
  int64_t batch_stride = 0;
  int64_t token_stride = 0;
};

struct CausalConvForwardArgs {
  ConvDtype dtype = ConvDtype::kFloat32;
  CausalConvShape shape;
  TokenOperand x;
  const void* weight = nullptr;  // [C, K] contiguous, `dtype`
  void* y = nullptr;             // [B, T, C] contiguous, `dtype`
};

struct CausalConvBackwardArgs {
  ConvDtype dtype = ConvDtype::kFloat32;
  CausalConvShape shape;
  TokenOperand grad_y, x;
  const void* weight = nullptr;  // [C, K] contiguous, `dtype`
  void* dx = nullptr;            // [B, T, C] contiguous, `dtype`
  float* partials = nullptr;     // [programs, C * K] FP32 scratch, every slot written
};

// Thread layout of both passes: a block is kCausalConvChannelThreads threads along the
// channels (threadIdx.x; each owns VEC consecutive channels, so a warp reads one
// contiguous run of 32 * VEC channels of a token) by kCausalConvTileRows token tiles
// (threadIdx.y). A thread walks the tokens of its tile in order, keeping the K - 1
// previous inputs of its channels in registers, so each input is read once plus a halo of
// K - 1 tokens per tile. Tiles never cross a sequence: tile g is sequence
// g / tiles_per_seq, tokens [(g % tiles_per_seq) * tile_tokens, ... + tile_tokens) clipped
// to T. grid.x covers the tiles (kCausalConvTileRows per block), grid.y the channels.
constexpr int kCausalConvChannelThreads = 32;
constexpr int kCausalConvTileRows = 8;

// Forward tile: 16 tokens (the halo, K - 1 = 3 more reads per tile, mostly hits L2). At
// B*T = 2048, C = 6144 in BF16 (4 channels per thread) that is 196608 threads, about two
// waves of 3 resident blocks per SM over the 132 SMs of an H200.
constexpr int64_t kCausalConvForwardTileTokens = 16;

// Backward grid, a pure function of (B, T, C, K) so that dw's summation order never
// depends on the device or the load. A program is one block row (blockIdx.x): its
// kCausalConvTileRows tiles write one FP32 partial row of C * K. tile_tokens starts at
// kCausalConvBackwardMinTileTokens and doubles while there would be more than
// kCausalConvTargetPrograms programs, so the partial rows (programs * C * K floats written
// and read once more) stay a few percent of the pass's traffic at long sequences. (At
// B*T = 4096, C = 6144, K = 4: tiles of 32 tokens, 16 programs, 1.6 MB of partials.)
struct CausalConvBackwardLaunch {
  int64_t tile_tokens = 0;
  int64_t tiles_per_seq = 0;   // ceil(T / tile_tokens)
  int64_t programs = 0;        // grid.x = ceil(B * tiles_per_seq / kCausalConvTileRows); 0 if empty
  int64_t scratch_floats = 0;  // programs * C * K
};

constexpr int64_t kCausalConvBackwardMinTileTokens = 32;
constexpr int64_t kCausalConvTargetPrograms = 128;

CausalConvBackwardLaunch derive_causal_conv_backward_launch(const CausalConvShape& shape);

// The ordered second pass: blocks of kCausalConvReduceCols slots x kCausalConvReduceSlices
// slices; slice s sums programs s, s + slices, ... in order, then the slice sums are added
// in slice order. A pure function of `programs`.
constexpr int kCausalConvReduceCols = 32;
constexpr int kCausalConvReduceSlices = 16;

// True when the kernels take `shape`: K in [kCausalConvMinTaps, kCausalConvMaxTaps],
// C >= 1, B >= 0, T >= 0.
bool causal_conv_supports(const CausalConvShape& shape);

// Writes y. B * T == 0 launches nothing.
int launch_causal_conv1d_silu_forward(const CausalConvForwardArgs& args, CUstream_st* stream);

// Writes dx and launch.scratch_floats partial sums into args.partials, where
// launch = derive_causal_conv_backward_launch(args.shape). B * T == 0 launches nothing.
int launch_causal_conv1d_silu_backward(const CausalConvBackwardArgs& args, CUstream_st* stream);

// Sums the [programs, row_floats] partial rows in the fixed order above and writes dw
// ([row_floats] = [C * K], `weight_dtype`). programs == 0 writes zeros.
int launch_causal_conv1d_reduce_partials(const float* partials, int64_t programs,
                                         int64_t row_floats, ConvDtype weight_dtype, void* dw,
                                         CUstream_st* stream);

}  // namespace gdr::kernels
