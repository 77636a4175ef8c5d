// Note [Graph marks] on the GPU: work that waits for a mark sees everything the replay
// wrote before the mark, on every replay, even when the graph spends milliseconds before
// reaching it; marks are refused outside a capture; a capture that sets no marks refuses
// a wait for one.
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "gdr/cuda_graph.h"
#include "tests/ops/error_of.h"

namespace gdr {
namespace {

using test_support::error_of;

CudaGraphCapture capture_or_die() {
  CudaGraphCapture capture = cuda_graph_capture();
  EXPECT_NE(capture, nullptr) << "//gdr:cuda_graph_cuda is linked, so capture is registered";
  return capture;
}

// Several milliseconds of GPU work (chained 2048^2 matmuls) so that the side stream, were
// it not held back by the mark, would read before the replay writes.
void slow_work(at::Tensor& m) {
  for (int i = 0; i < 40; ++i) m = at::mm(m, m).mul_(1.0 / 2048);
}

TEST(CudaGraphMarks, SideWorkAfterAMarkSeesTheReplaysWritesBeforeIt) {
  CudaGraphCapture capture = capture_or_die();
  ASSERT_NE(capture, nullptr);
  const at::TensorOptions f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  at::Tensor input = at::zeros({1 << 20}, f32);    // written by the host before each replay
  at::Tensor written = at::zeros({1 << 20}, f32);  // the graph copies input here, late
  at::Tensor scratch = at::eye(2048, f32);
  at::mm(scratch, scratch);  // cuBLAS creates its handle outside the capture
  size_t before_copy = 0, after_copy = 0;
  std::unique_ptr<CapturedWork> work = capture(
      [&](CapturedWork& w) {
        before_copy = w.mark();
        slow_work(scratch);
        written.copy_(input);
        after_copy = w.mark();
        slow_work(scratch);
      },
      /*share_memory_with=*/nullptr);
  EXPECT_EQ(before_copy, 0u);
  EXPECT_EQ(after_copy, 1u);
  for (int replay = 1; replay <= 5; ++replay) {
    input.fill_(static_cast<float>(replay));
    work->replay();
    at::Tensor seen;
    work->on_side_stream_after(after_copy, [&] {
      EXPECT_NE(c10::cuda::getCurrentCUDAStream(), c10::cuda::getDefaultCUDAStream())
          << "the work runs on the side stream";
      seen = written.clone();
    });
    work->join_side_stream();
    EXPECT_TRUE(at::equal(seen, at::full_like(seen, static_cast<float>(replay))))
        << "replay " << replay << ": the side stream read before the replay's copy";
  }
}

TEST(CudaGraphMarks, MarkOutsideACaptureIsRefused) {
  CudaGraphCapture capture = capture_or_die();
  ASSERT_NE(capture, nullptr);
  at::Tensor x = at::zeros({16}, at::TensorOptions().device(at::kCUDA));
  std::unique_ptr<CapturedWork> work = capture([&](CapturedWork&) { x.add_(1); }, nullptr);
  const std::string outside = error_of([&] { work->mark(); });
  EXPECT_NE(outside.find("CapturedWork::mark: expected to be called inside the capture body"),
            std::string::npos)
      << outside;
  const std::string missing = error_of([&] { work->on_side_stream_after(0, [] {}); });
  EXPECT_NE(missing.find("CapturedWork::on_side_stream_after: mark 0 does not exist; the "
                         "capture set 0 marks"),
            std::string::npos)
      << missing;
}

TEST(CudaGraphMarks, ReplayBeforeJoiningTheSideStreamIsRefused) {
  CudaGraphCapture capture = capture_or_die();
  ASSERT_NE(capture, nullptr);
  at::Tensor x = at::zeros({16}, at::TensorOptions().device(at::kCUDA));
  size_t after_add = 0;
  std::unique_ptr<CapturedWork> work = capture(
      [&](CapturedWork& w) {
        x.add_(1);
        after_add = w.mark();
      },
      nullptr);
  work->replay();
  work->on_side_stream_after(after_add, [] {});
  const std::string unjoined = error_of([&] { work->replay(); });
  EXPECT_NE(unjoined.find("CapturedWork::replay: join_side_stream() first"), std::string::npos)
      << unjoined;
  work->join_side_stream();
  work->replay();
  work->join_side_stream();
  EXPECT_TRUE(at::equal(x, at::full_like(x, 2.0f))) << "two replays of x += 1";
}

// Note [Microbatch graphs]' per-position graphs: captures sharing one memory pool reuse
// each other's temporaries but never an output one of them still holds, so each graph's
// outputs survive the others' replays; and the second capture takes (almost) no new
// memory for temporaries the first one freed.
TEST(CudaGraphPools, CapturesSharingAPoolKeepEachOthersOutputs) {
  CudaGraphCapture capture = capture_or_die();
  ASSERT_NE(capture, nullptr);
  const at::TensorOptions f32 = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  constexpr int64_t kElements = int64_t{1} << 22;  // 16 MiB per tensor
  at::Tensor input = at::zeros({kElements}, f32);
  at::Tensor out_first, out_second;
  // Temporaries (freed inside the body) and an output held after it.
  auto body = [&](at::Tensor& out, double scale) {
    return [&out, &input, scale](CapturedWork&) {
      at::Tensor temporary = input * scale;
      at::Tensor other = temporary + 1.0;
      out = other * 2.0;
    };
  };
  std::unique_ptr<CapturedWork> first = capture(body(out_first, 3.0), nullptr);
  const int64_t reserved_after_first = static_cast<int64_t>(
      c10::cuda::CUDACachingAllocator::getDeviceStats(0).reserved_bytes[0].current);
  std::unique_ptr<CapturedWork> second = capture(body(out_second, 5.0), first.get());
  const int64_t reserved_after_second = static_cast<int64_t>(
      c10::cuda::CUDACachingAllocator::getDeviceStats(0).reserved_bytes[0].current);
  // The second capture needs one new 16 MiB block for its output; its two temporaries fit
  // in what the first one freed. A pool of its own would take three.
  EXPECT_LE(reserved_after_second - reserved_after_first, 2 * kElements * 4)
      << "the second capture did not reuse the first one's freed temporaries";
  EXPECT_NE(out_first.data_ptr(), out_second.data_ptr());
  for (int round = 1; round <= 3; ++round) {
    input.fill_(static_cast<float>(round));
    first->replay();
    second->replay();
    EXPECT_TRUE(at::equal(out_first, at::full_like(out_first, (3.0 * round + 1.0) * 2.0)))
        << "round " << round << ": the second graph's replay overwrote the first's output";
    EXPECT_TRUE(at::equal(out_second, at::full_like(out_second, (5.0 * round + 1.0) * 2.0)))
        << "round " << round;
  }
}

}  // namespace
}  // namespace gdr
