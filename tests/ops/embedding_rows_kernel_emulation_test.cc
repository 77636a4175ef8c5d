// The tied embedding's rows kernel body runs on the CPU:
// kernels/tied_embedding/embedding_rows_kernel.cuh is compiled as host code with stand-ins for the
// CUDA built-ins it uses (one std::thread per CUDA thread, barriers for __syncthreads /
// __syncthreads_or, a per-warp slot for
// __ballot_sync; one block at a time, the 2-D grid flattened) under the launcher's own
// launch rule (launch_shape), and its result is checked bit for bit against the op's CPU
// reference (ops/tied_embedding/tied_embedding_op.h): BF16, FP16 and FP32, vectorised and element
// paths, several column tiles, an id in more tokens than a block has threads (matches compacted
// across chunks), misaligned rows, ids outside the vocabulary. The real hardware is the
// GPU test's business (//tests/ops:tied_embedding_gpu_test).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <pthread.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "kernels/tied_embedding/embedding_rows.h"
#include "ops/tied_embedding/tied_embedding_op.h"
#include "tests/ops/bitwise_equal.h"

// Host stand-ins for the CUDA built-ins the kernel body uses (see the NOTE in the .cuh).
#include "tests/ops/emulated_cuda.h"

inline std::atomic<int> g_or_flag{0};
inline std::atomic<unsigned> g_ballot[kMaxWarps];

inline int __syncthreads_or(int predicate) {
  pthread_barrier_wait(&g_block_barrier);
  if (predicate) g_or_flag.store(1);
  pthread_barrier_wait(&g_block_barrier);
  const int result = g_or_flag.load();
  pthread_barrier_wait(&g_block_barrier);
  if (threadIdx.x == 0) g_or_flag.store(0);
  pthread_barrier_wait(&g_block_barrier);
  return result;
}

inline unsigned __ballot_sync(unsigned /*mask*/, int predicate) {
  const unsigned warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (predicate) g_ballot[warp].fetch_or(1u << lane);
  pthread_barrier_wait(&g_warp_barrier[warp]);
  const unsigned result = g_ballot[warp].load();
  pthread_barrier_wait(&g_warp_barrier[warp]);
  if (lane == 0) g_ballot[warp].store(0);
  pthread_barrier_wait(&g_warp_barrier[warp]);
  return result;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }

#define __device__
#define __forceinline__ inline
#include "kernels/tied_embedding/embedding_rows_kernel.cuh"
#undef __device__
#undef __forceinline__

#include "tests/ops/emulated_storage_element.h"

namespace gdr::kernels {
namespace {

using test_support::bitwise_equal;
using test_support::run_grid;

// Runs the kernel body over the launcher's grid on (dw, ids, rows), in place.
template <typename T>
void run_emulated(const at::Tensor& dw, const at::Tensor& ids, const at::Tensor& rows) {
  EmbeddingRowsArgs args;
  args.ids = ids.data_ptr<int64_t>();
  args.rows = rows.data_ptr();
  args.dw = dw.data_ptr();
  args.tokens = ids.size(0);
  args.hidden = dw.size(1);
  args.vocab = dw.size(0);
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const embedding_rows_detail::LaunchShape shape = embedding_rows_detail::launch_shape(args, kVec);
  run_grid(args.tokens * shape.tiles, static_cast<int>(shape.threads), [&](int64_t block) {
    blockIdx.x = static_cast<unsigned>(block % args.tokens);
    blockIdx.y = static_cast<unsigned>(block / args.tokens);
    int later[embedding_rows_detail::kMaxThreads];  // the block's "shared memory"
    int warp_counts[embedding_rows_detail::kMaxThreads / 32];
    static int* shared_later = nullptr;
    static int* shared_counts = nullptr;
    if (threadIdx.x == 0) {
      shared_later = later;
      shared_counts = warp_counts;
    }
    __syncthreads();
    int* my_later = shared_later;
    int* my_counts = shared_counts;
    __syncthreads();
    if (shape.vectorised) {
      embedding_rows_detail::add_token_rows_block<T, kVec>(args, my_later, my_counts);
    } else {
      embedding_rows_detail::add_token_rows_block<T, 1>(args, my_later, my_counts);
    }
    __syncthreads();  // thread 0's arrays outlive every reader
  });
}

void run_for_dtype(const at::Tensor& dw, const at::Tensor& ids, const at::Tensor& rows) {
  switch (dw.scalar_type()) {
    case at::kFloat: return run_emulated<float>(dw, ids, rows);
    case at::kHalf: return run_emulated<c10::Half>(dw, ids, rows);
    case at::kBFloat16: return run_emulated<c10::BFloat16>(dw, ids, rows);
    default: FAIL() << "dtype " << dw.scalar_type();
  }
}

struct Case {
  const char* name;
  int64_t tokens, hidden, vocab;
  bool misaligned_rows;
};

at::Tensor make_ids(const Case& c) {
  // Mostly one id (more tokens than a block has threads for the long cases), 0, V - 1,
  // a few others, and ids outside [0, V).
  at::Tensor ids = at::randint(0, c.vocab, {c.tokens}, at::kLong);
  for (int64_t t = 0; t < c.tokens; t += 2) ids[t] = c.vocab / 2;
  ids[0] = c.vocab - 1;
  if (c.tokens > 3) {
    ids[1] = 0;
    ids[2] = -1;
    ids[c.tokens - 1] = c.vocab;
  }
  return ids;
}

class EmbeddingRowsEmulation : public ::testing::TestWithParam<std::tuple<at::ScalarType, Case>> {};

TEST_P(EmbeddingRowsEmulation, KernelBodyGivesTheCpuReferencesBits) {
  const auto& [dtype, c] = GetParam();
  at::manual_seed(c.tokens * 31 + c.hidden);
  const at::Tensor ids = make_ids(c);
  const at::Tensor buffer = (at::randn({c.tokens * c.hidden + 1}) * 4).to(dtype);
  const at::Tensor rows =
      buffer.narrow(0, c.misaligned_rows ? 1 : 0, c.tokens * c.hidden).view({c.tokens, c.hidden});
  const at::Tensor dw0 = at::randn({c.vocab, c.hidden}).to(dtype);
  at::Tensor expected = dw0.clone();
  tied_embedding_add_rows_(expected, ids, rows.contiguous());
  const at::Tensor got = dw0.clone();
  run_for_dtype(got, ids, rows);
  EXPECT_TRUE(bitwise_equal(got, expected));
  EXPECT_FALSE(bitwise_equal(got, dw0)) << "the case adds something";
}

const Case kCases[] = {
    {"vectorised_one_tile_chunks", 100, 64, 9, false},  // 32 threads: matches over 4 chunks
    {"element_path_odd_hidden", 70, 37, 5, false},
    {"several_tiles", 5, 2100, 4, false},
    {"one_token", 1, 24, 3, false},
    {"misaligned_rows", 40, 64, 6, true},
};

INSTANTIATE_TEST_SUITE_P(
    Cases, EmbeddingRowsEmulation,
    ::testing::Combine(::testing::Values(at::kBFloat16, at::kHalf, at::kFloat),
                       ::testing::ValuesIn(kCases)),
    [](const ::testing::TestParamInfo<EmbeddingRowsEmulation::ParamType>& info) {
      return std::string(c10::toString(std::get<0>(info.param))) + "_" +
             std::get<1>(info.param).name;
    });

}  // namespace
}  // namespace gdr::kernels
