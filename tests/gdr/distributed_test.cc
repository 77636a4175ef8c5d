// gdr/distributed.h in one process: the rank environment's checks, the PairwiseSum tree,
// and two ranks (threads) of a real TCPStore + Gloo group on loopback: all_reduce_sum
// sums by the tree, gathers the extras, and check_same_on_all_ranks refuses a difference
// on both ranks. The multi-process, end-to-end checks are in distributed_test.sh.
#include "gdr/distributed.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <cmath>
#include <cstring>

#include <map>
#include <string>
#include <thread>

namespace gdr {
namespace {

std::map<std::string, std::string> g_env;
const char* fake_getenv(const char* name) {
  auto it = g_env.find(name);
  return it == g_env.end() ? nullptr : it->second.c_str();
}

absl::Status env_status(std::map<std::string, std::string> env) {
  g_env = std::move(env);
  return read_dist_env(fake_getenv).status();
}

TEST(DistEnvTest, NothingSetIsOneProcess) {
  g_env.clear();
  absl::StatusOr<DistEnv> env = read_dist_env(fake_getenv);
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->rank, 0);
  EXPECT_EQ(env->timeout, std::chrono::milliseconds(60000));
}

TEST(DistEnvTest, ReadsTorchrunVariables) {
  g_env = {{"RANK", "3"},
           {"WORLD_SIZE", "4"},
           {"LOCAL_RANK", "1"},
           {"MASTER_ADDR", "node0"},
           {"MASTER_PORT", "29500"},
           {"GDR_DIST_TIMEOUT_S", "7"}};
  absl::StatusOr<DistEnv> env = read_dist_env(fake_getenv);
  ASSERT_TRUE(env.ok()) << env.status();
  EXPECT_EQ(env->rank, 3);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "node0");
  EXPECT_EQ(env->master_port, 29500);
  EXPECT_EQ(env->timeout, std::chrono::milliseconds(7000));
}

TEST(DistEnvTest, BadVariablesAreNamed) {
  EXPECT_EQ(env_status({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).message(),
            "RANK: 2 is outside 0..1 (WORLD_SIZE 2)");
  EXPECT_EQ(env_status({{"RANK", "0"}, {"WORLD_SIZE", "2"}}).message(),
            "MASTER_PORT: not set, but WORLD_SIZE is 2");
  EXPECT_EQ(env_status({{"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}}).message(),
            "RANK: not set, but WORLD_SIZE is 2");
  EXPECT_EQ(env_status({{"RANK", "0"}, {"WORLD_SIZE", "two"}}).message(),
            "WORLD_SIZE: expected an integer but got 'two'");
  EXPECT_EQ(env_status({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "http"}}).message(),
            "MASTER_PORT: expected an integer but got 'http'");
  EXPECT_EQ(env_status({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "70000"}}).message(),
            "MASTER_PORT: expected 1..65535 but got 70000");
  EXPECT_EQ(env_status({{"GDR_DIST_TIMEOUT_S", "0"}}).message(),
            "GDR_DIST_TIMEOUT_S: expected a positive number of seconds but got 0");
  EXPECT_EQ(env_status({{"RANK", "0"}}).message(), "WORLD_SIZE: not set, but RANK is");
}

// 1e8 + 1 == 1e8 in FP32, so the tree shape decides the result: the left fold
// ((1e8 + 1) - 1e8) + 1 gives 1, the pairwise tree (1e8 + 1) + (-1e8 + 1) gives 0.
std::vector<float> kLeaves = {1e8f, 1.0f, -1e8f, 1.0f};

TEST(PairwiseSumTest, FourLeavesAreTheBalancedTree) {
  PairwiseSum tree;
  for (float v : kLeaves) tree.add({at::full({1}, v)});
  EXPECT_EQ(tree.finish()[0].item<float>(), 0.0f);
  PairwiseSum three;
  for (int i = 0; i < 3; ++i) three.add({at::full({1}, kLeaves[i])});
  EXPECT_EQ(three.finish()[0].item<float>(), 0.0f);  // (1e8 + 1) - 1e8
  EXPECT_TRUE(PairwiseSum().finish().empty());
}

TEST(PairwiseSumTest, TwoHalvesCombinedEqualTheWhole) {
  PairwiseSum halves[2], outer;
  for (int i = 0; i < 4; ++i) halves[i / 2].add({at::full({2}, kLeaves[i])});
  for (PairwiseSum& h : halves) outer.add(h.finish());
  PairwiseSum whole;
  for (float v : kLeaves) whole.add({at::full({2}, v)});
  EXPECT_TRUE(at::equal(outer.finish()[0], whole.finish()[0]));
}

// add_kept(leaf) is add() of the leaf, for 1..11 BF16 leaves held in kDeferredLeaves
// rotating buffers as the trainer's per-position graphs hold them (Note [Microbatch
// graphs]): a buffer is rewritten for leaf k + kDeferredLeaves right after leaf k's group
// is summed, and poisoned as soon as the tree is done with it, which changes nothing; the
// sums tile one FP32 buffer in order.
TEST(PairwiseSumTest, AddKeptReadsEachLeafBeforeItsBufferIsReused) {
  constexpr size_t kSlots = PairwiseSum::kDeferredLeaves;
  for (int n = 1; n <= 11; ++n) {
    at::manual_seed(100 + n);
    PairwiseSum owned, kept;
    std::vector<std::vector<at::Tensor>> buffers;
    for (size_t b = 0; b < kSlots; ++b) {
      buffers.push_back({at::empty({5}, at::kBFloat16), at::empty({2, 3}, at::kBFloat16)});
    }
    for (int k = 0; k < n; ++k) {
      const std::vector<at::Tensor> leaf = {(at::randn({5}) * 1e4).to(at::kBFloat16),
                                            at::randn({2, 3}).to(at::kBFloat16)};
      owned.add({leaf[0].to(at::kFloat), leaf[1].to(at::kFloat)});
      std::vector<at::Tensor>& slot = buffers[static_cast<size_t>(k) % kSlots];
      for (size_t i = 0; i < leaf.size(); ++i) slot[i].copy_(leaf[i]);
      kept.add_kept(slot);
      if (static_cast<size_t>(k) % kSlots == kSlots - 1) {  // the group was summed
        for (std::vector<at::Tensor>& b : buffers) {
          for (at::Tensor& t : b) t.fill_(std::nanf(""));
        }
      }
    }
    const std::vector<at::Tensor> want = owned.finish(), got = kept.finish();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(got[i], want[i])) << n << " leaves, index " << i;
    }
    if (n >= 2) {
      EXPECT_EQ(static_cast<const float*>(got[1].data_ptr()),
                static_cast<const float*>(got[0].data_ptr()) + got[0].numel())
          << n << " leaves: the sums tile one buffer";
    }
  }
}

// A BF16 leaf (what a graphed bf16 microbatch hands over): add_kept and
// finish_with_last give the bits of the same leaf widened to FP32 first, and FP32 sums.
TEST(PairwiseSumTest, SixteenBitLeavesEqualTheirWidenedCopies) {
  for (int n = 1; n <= 5; ++n) {
    at::manual_seed(n);
    std::vector<std::vector<at::Tensor>> leaves;
    for (int k = 0; k < n; ++k) {
      leaves.push_back(
          {(at::randn({6}) * 1e3).to(at::kBFloat16), at::randn({2, 2}).to(at::kBFloat16)});
    }
    PairwiseSum widened, narrow, widened_last, narrow_last;
    for (int k = 0; k < n; ++k) {
      widened.add({leaves[k][0].to(at::kFloat), leaves[k][1].to(at::kFloat)});
      narrow.add_kept(leaves[k]);
      if (k + 1 < n) {
        widened_last.add({leaves[k][0].to(at::kFloat), leaves[k][1].to(at::kFloat)});
        narrow_last.add_kept(leaves[k]);
      }
    }
    const std::vector<at::Tensor> want = widened.finish(), got = narrow.finish();
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_EQ(got[i].scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(got[i], want[i])) << n << " leaves, index " << i;
      const at::Tensor last = narrow_last.finish_with_last(i, leaves[n - 1][i]);
      EXPECT_EQ(last.scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(last, want[i])) << n << " leaves, finish_with_last, index " << i;
    }
  }
}

// finish_with_last(i, x) is add() of a leaf holding x at index i, then finish(), for
// index i: the same bits, whatever the number of earlier leaves.
TEST(PairwiseSumTest, FinishWithLastEqualsAddThenFinish) {
  for (int earlier = 0; earlier <= 6; ++earlier) {
    at::manual_seed(earlier);
    std::vector<std::vector<at::Tensor>> leaves;
    for (int k = 0; k <= earlier; ++k) {
      leaves.push_back({at::randn({5}) * 1e4, at::randn({2, 3})});
    }
    PairwiseSum whole, per_index;
    for (int k = 0; k <= earlier; ++k) {
      std::vector<at::Tensor> copy;
      for (const at::Tensor& t : leaves[k]) copy.push_back(t.clone());
      whole.add(copy);
    }
    for (int k = 0; k < earlier; ++k) {
      std::vector<at::Tensor> copy;
      for (const at::Tensor& t : leaves[k]) copy.push_back(t.clone());
      per_index.add(copy);
    }
    const std::vector<at::Tensor> want = whole.finish();
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(at::equal(per_index.finish_with_last(i, leaves[earlier][i].clone()), want[i]))
          << earlier << " earlier leaves, index " << i;
    }
  }
}

// The leaf-by-leaf binary counter written out with at::add (the definition of Note
// [Gradient reduction tree]), independent of PairwiseSum's deferred, fused evaluation.
at::Tensor leaf_by_leaf(const std::vector<at::Tensor>& leaves) {
  std::vector<std::pair<int, at::Tensor>> stack;
  auto merge = [&] {
    const auto newer = stack.back();
    stack.pop_back();
    stack.back() = {stack.back().first + newer.first, at::add(stack.back().second, newer.second)};
  };
  for (const at::Tensor& leaf : leaves) {
    stack.emplace_back(1, leaf.to(at::kFloat));
    while (stack.size() >= 2 && stack.back().first == stack[stack.size() - 2].first) merge();
  }
  while (stack.size() >= 2) merge();
  return stack.back().second;
}

// 1 .. 19 leaves, FP32 through add() and BF16 through add_kept() and finish_with_last():
// the bits of the leaf-by-leaf tree, across several deferred groups (kDeferredLeaves = 4).
// The values span 1e-3 .. 1e5, so a different tree or order would change low bits.
TEST(PairwiseSumTest, DeferredEvaluationHasTheBitsOfTheLeafByLeafTree) {
  for (int n = 1; n <= 19; ++n) {
    at::manual_seed(100 + n);
    std::vector<at::Tensor> fp32, bf16;
    for (int k = 0; k < n; ++k) {
      fp32.push_back(at::randn({37}) * at::pow(10.0, at::randint(-3, 6, {37})));
      bf16.push_back(fp32.back().to(at::kBFloat16));
    }
    PairwiseSum owned, copied, with_last;
    for (int k = 0; k < n; ++k) {
      owned.add({fp32[k].clone()});
      copied.add_kept({bf16[k]});
      if (k + 1 < n) with_last.add_kept({bf16[k]});
    }
    EXPECT_TRUE(at::equal(owned.finish()[0], leaf_by_leaf(fp32))) << n << " FP32 leaves";
    const at::Tensor want = leaf_by_leaf(bf16);
    EXPECT_TRUE(at::equal(copied.finish()[0], want)) << n << " BF16 leaves";
    EXPECT_TRUE(at::equal(with_last.finish_with_last(0, bf16[n - 1]), want))
        << n << " BF16 leaves, finish_with_last";
  }
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

// Runs `body(group)` on two ranks (threads) of one Gloo group.
template <typename Body>
void on_two_ranks(Body body) {
  const int port = free_port();
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      DistEnv env;
      env.rank = r;
      env.world_size = 2;
      env.master_port = port;
      env.timeout = std::chrono::milliseconds(20000);
      absl::StatusOr<std::unique_ptr<ProcessGroup>> group = ProcessGroup::create(env, false);
      ASSERT_TRUE(group.ok()) << group.status();
      body(**group);
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(ProcessGroupTest, AllReduceSumsByTheTreeAndGathersExtras) {
  std::vector<at::Tensor> results(2);
  std::vector<std::vector<std::vector<double>>> extras(2);
  on_two_ranks([&](ProcessGroup& group) {
    const int r = group.rank();
    // Rank r holds the partial sum of its two leaves, as the trainer does.
    PairwiseSum mine;
    for (int i = 2 * r; i < 2 * r + 2; ++i) mine.add({at::full({3}, kLeaves[i])});
    std::vector<at::Tensor> grads = mine.finish();
    grads.push_back(at::full({2, 2}, static_cast<float>(r + 1)));
    absl::Status s = group.all_reduce_sum(grads, {r + 0.5, r + 0.25}, &extras[r]);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(grads[0][0].item<float>(), 0.0f);
    EXPECT_TRUE(at::equal(grads[1], at::full({2, 2}, 3.0f)));
    results[r] = grads[0];
  });
  ASSERT_TRUE(results[0].defined() && results[1].defined());
  EXPECT_TRUE(at::equal(results[0], results[1]));
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(extras[r], (std::vector<std::vector<double>>{{0.5, 0.25}, {1.5, 1.25}}));
  }
}

// Many small buckets (more than ProcessGroup::kBucketsInFlight queued at once): every
// tensor is the rank-order tree sum, whatever bucket it fell in.
TEST(ProcessGroupTest, ManyBucketsInFlightGiveTheSameSums) {
  constexpr int kTensors = 40;
  std::vector<std::vector<at::Tensor>> results(2);
  on_two_ranks([&](ProcessGroup& group) {
    group.set_two_rank_all_reduce_for_testing(false);  // the buckets are under test
    const int r = group.rank();
    std::vector<at::Tensor> grads;
    for (int i = 0; i < kTensors; ++i) {
      // Sizes 1..5 so buckets of 6 elements hold one or several tensors.
      grads.push_back(at::arange(1 + i % 5, at::kFloat).mul(0.1f * (i + 1)).add(r * 1000.0f));
    }
    absl::Status s = group.all_reduce_sum(grads, {}, nullptr, /*bucket_elements=*/6);
    ASSERT_TRUE(s.ok()) << s;
    results[r] = grads;
  });
  ASSERT_EQ(results[0].size(), static_cast<size_t>(kTensors));
  for (int i = 0; i < kTensors; ++i) {
    const at::Tensor base = at::arange(1 + i % 5, at::kFloat).mul(0.1f * (i + 1));
    const at::Tensor want = base.add(0.0f) + base.add(1000.0f);  // rank 0 + rank 1
    EXPECT_TRUE(at::equal(results[0][i], want)) << i;
    EXPECT_TRUE(at::equal(results[1][i], want)) << i;
  }
}

// See Note [Two-rank all-reduce]: the one all-reduce gives the all-gather tree's bits, for
// values where the order of an addition chain would show (1e8 + 1, signed zeros, huge and
// tiny), whether the gradients tile one flat buffer (as PairwiseSum::add_kept leaves
// them) or not, and the result lands in the caller's tensors.
TEST(ProcessGroupTest, TwoRankAllReduceEqualsTheGatherTree) {
  std::vector<std::vector<at::Tensor>> fast(2), tree(2), tiled(2);
  on_two_ranks([&](ProcessGroup& group) {
    const int r = group.rank();
    auto make = [&] {
      // A generator of the rank's own: the two ranks are threads of one process.
      at::Generator gen = at::detail::createCPUGenerator(100 + r);
      std::vector<at::Tensor> g = {
          at::randn({7}, gen) * (r == 0 ? 1e8 : 1.0), at::randn({3, 4}, gen),
          r == 0 ? at::full({2}, 0.0f) : at::full({2}, -0.0f), at::full({1}, r == 0 ? 1e8f : 1.0f)};
      return g;
    };
    std::vector<at::Tensor> a = make(), b = make();
    ASSERT_TRUE(group.all_reduce_sum(a).ok());
    group.set_two_rank_all_reduce_for_testing(false);
    ASSERT_TRUE(group.all_reduce_sum(b).ok());
    group.set_two_rank_all_reduce_for_testing(true);
    PairwiseSum one_leaf;
    one_leaf.add_kept(make());
    std::vector<at::Tensor> c = one_leaf.finish();
    ASSERT_TRUE(group.all_reduce_sum(c).ok());
    fast[r] = a, tree[r] = b, tiled[r] = c;
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(fast[r].size(), 4u);
    for (size_t i = 0; i < 4; ++i) {
      const at::Tensor f = fast[r][i], t = tree[r][i], c = tiled[r][i];
      EXPECT_EQ(std::memcmp(f.data_ptr(), t.data_ptr(), f.nbytes()), 0) << "rank " << r << " " << i;
      EXPECT_EQ(std::memcmp(c.data_ptr(), t.data_ptr(), c.nbytes()), 0) << "rank " << r << " " << i;
    }
    EXPECT_EQ(fast[r][3].item<float>(), 1e8f);  // 1e8 + 1 rounds to 1e8
  }
}

// RangeAllReduce gives all_reduce_sum's bits, in place, for tensors that tile one buffer
// (one collective over their range, the caller's views updated) and for separate ones
// (a concatenated copy, copied back by finish()).
TEST(ProcessGroupTest, RangeAllReduceEqualsAllReduceSumInPlace) {
  std::vector<std::vector<at::Tensor>> ranged(2), plain(2);
  std::vector<at::Tensor> buffers(2);
  on_two_ranks([&](ProcessGroup& group) {
    const int r = group.rank();
    at::Generator gen = at::detail::createCPUGenerator(200 + r);
    const at::Tensor buffer = at::randn({12}, gen) * (r == 0 ? 1e8 : 1.0);
    std::vector<at::Tensor> tiled = {buffer.narrow(0, 0, 4).view({2, 2}), buffer.narrow(0, 4, 3),
                                     buffer.narrow(0, 7, 5)};
    std::vector<at::Tensor> separate = {at::randn({3}, gen), at::randn({2, 3}, gen)};
    std::vector<at::Tensor> expected;
    for (const at::Tensor& t : tiled) expected.push_back(t.clone());
    for (const at::Tensor& t : separate) expected.push_back(t.clone());
    RangeAllReduce reduction(group);
    reduction.start({tiled[0], tiled[1]});
    reduction.start({tiled[2]});
    reduction.start(separate);
    ASSERT_TRUE(reduction.finish().ok());
    ASSERT_TRUE(group.all_reduce_sum(expected).ok());
    for (const at::Tensor& t : tiled) ranged[r].push_back(t);
    for (const at::Tensor& t : separate) ranged[r].push_back(t);
    plain[r] = expected;
    buffers[r] = buffer;
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(ranged[r].size(), 5u);
    for (size_t i = 0; i < 5; ++i) {
      EXPECT_TRUE(at::equal(ranged[r][i], plain[r][i])) << "rank " << r << " tensor " << i;
    }
    EXPECT_TRUE(at::equal(buffers[r].narrow(0, 0, 4).view({2, 2}), plain[r][0]));
  }
  EXPECT_TRUE(at::equal(ranged[0][0], ranged[1][0]));
}

// See Note [Overlapped gradient reduction]: ranks set their tensors in different orders (here
// one ascending, one descending, small buckets so several are in flight); every tensor
// still comes back as the rank-order tree sum, the same as all_reduce_sum's.
TEST(ProcessGroupTest, OverlappedReductionEqualsAllReduceSumWhateverTheSetOrder) {
  constexpr int kTensors = 30;
  std::vector<std::vector<at::Tensor>> overlapped(2), plain(2);
  on_two_ranks([&](ProcessGroup& group) {
    const int r = group.rank();
    std::vector<at::Tensor> grads;
    std::vector<std::vector<int64_t>> shapes;
    for (int i = 0; i < kTensors; ++i) {
      grads.push_back(at::arange(1 + i % 4, at::kFloat).mul(0.3f * (i + 1)).add(r * 77.0f));
      shapes.push_back(grads.back().sizes().vec());
    }
    OverlappedReduction reduction(group, shapes, grads[0].options(), /*bucket_elements=*/5);
    for (int j = 0; j < kTensors; ++j) {
      const int i = r == 0 ? j : kTensors - 1 - j;
      reduction.set(i, grads[i]);
    }
    absl::StatusOr<std::vector<at::Tensor>> out = reduction.finish();
    ASSERT_TRUE(out.ok()) << out.status();
    overlapped[r] = *out;
    ASSERT_TRUE(group.all_reduce_sum(grads, {}, nullptr, /*bucket_elements=*/5).ok());
    plain[r] = grads;
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(overlapped[r].size(), static_cast<size_t>(kTensors));
    for (int i = 0; i < kTensors; ++i) {
      EXPECT_TRUE(at::equal(overlapped[r][i], plain[r][i])) << "rank " << r << " tensor " << i;
    }
  }
}

TEST(ProcessGroupTest, OverlappedReductionRefusesAMissingTensor) {
  std::vector<absl::Status> status(2);
  on_two_ranks([&](ProcessGroup& group) {
    OverlappedReduction reduction(group, {{2}, {3}}, at::TensorOptions().dtype(at::kFloat));
    reduction.set(1, at::ones({3}));
    status[group.rank()] = reduction.finish().status();
  });
  for (const absl::Status& s : status) {
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(s.message(), "OverlappedReduction::finish: tensor 0 was never set");
  }
}

TEST(ProcessGroupTest, DifferentValuesAreRefusedOnEveryRank) {
  std::vector<absl::Status> same(2), differ(2);
  on_two_ranks([&](ProcessGroup& group) {
    same[group.rank()] = check_same_on_all_ranks(group, "config hash", "abc");
    differ[group.rank()] =
        check_same_on_all_ranks(group, "config hash", group.rank() == 0 ? "abc" : "abd");
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(same[r].ok()) << same[r];
    EXPECT_EQ(differ[r].code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(differ[r].message(), "config hash differs between ranks: rank 0 abc, rank 1 abd");
  }
}

// Note [Sharded optimizer state]: the plan is greedy by size in parameter order, ties to the
// lowest rank; every parameter has one owner, and the ranks are balanced to within the largest
// parameter.
TEST(OptimizerStateOwnersTest, GreedyBalancedEveryParameterOnce) {
  EXPECT_EQ(optimizer_state_owners({10, 4, 4, 3, 1}, 2), (std::vector<int>{0, 1, 1, 1, 0}));
  EXPECT_EQ(optimizer_state_owners({5, 5, 5}, 1), (std::vector<int>{0, 0, 0}));
  EXPECT_EQ(optimizer_state_owners({}, 4), (std::vector<int>{}));
  EXPECT_EQ(optimizer_state_owners({1, 1}, 4), (std::vector<int>{0, 1}));  // ranks 2, 3 idle
  // A model-like list: embeddings, then many layers' matrices and norms.
  std::vector<int64_t> numels{151936 * 64};
  for (int layer = 0; layer < 24; ++layer) {
    for (int64_t n : {64 * 192, 64 * 64, 64, 64 * 256, 256 * 64, 64}) numels.push_back(n);
  }
  for (int world : {2, 3, 4, 8}) {
    const std::vector<int> owners = optimizer_state_owners(numels, world);
    ASSERT_EQ(owners.size(), numels.size());
    EXPECT_EQ(owners, optimizer_state_owners(numels, world));  // pure
    std::vector<int64_t> owned(world, 0);
    for (size_t i = 0; i < owners.size(); ++i) {
      ASSERT_GE(owners[i], 0);
      ASSERT_LT(owners[i], world);
      owned[owners[i]] += numels[i];
    }
    // The embedding dominates: rank 0 owns it alone; the others share the rest evenly.
    EXPECT_EQ(owners[0], 0);
    const int64_t largest_layer_tensor = 64 * 256;
    for (int r = 2; r < world; ++r) {
      EXPECT_LE(std::abs(owned[r] - owned[1]), largest_layer_tensor) << world << " " << r;
    }
  }
}

// Broadcast moves the root's bytes into every rank's tensors, any dtype, in buckets or alone.
TEST(ProcessGroupTest, BroadcastCopiesTheRootsBytes) {
  std::vector<std::vector<at::Tensor>> got(2);
  on_two_ranks([&](ProcessGroup& group) {
    const int r = group.rank();
    for (int root : {0, 1}) {
      std::vector<at::Tensor> tensors{
          at::arange(7, at::kFloat).mul(root + 0.25f).add(r * 100.0f),
          at::arange(6, at::kFloat).reshape({2, 3}).to(at::kBFloat16).add(r * 10.0f + root),
          at::empty({0}, at::kFloat), at::full({40}, static_cast<float>(r + root))};
      // 32-byte buckets: the first two tensors share one, the 160-byte one goes alone.
      absl::Status s = group.broadcast(tensors, root, /*bucket_bytes=*/64);
      ASSERT_TRUE(s.ok()) << s;
      if (root == 1) got[r] = tensors;
      EXPECT_TRUE(
          at::equal(tensors[0], at::arange(7, at::kFloat).mul(root + 0.25f).add(root * 100.0f)));
      EXPECT_TRUE(at::equal(
          tensors[1],
          at::arange(6, at::kFloat).reshape({2, 3}).to(at::kBFloat16).add(root * 10.0f + root)));
      EXPECT_TRUE(at::equal(tensors[3], at::full({40}, static_cast<float>(2 * root))));
    }
  });
  ASSERT_EQ(got[0].size(), 4u);
  for (size_t i = 0; i < got[0].size(); ++i) EXPECT_TRUE(at::equal(got[0][i], got[1][i])) << i;
}

// This CPU binary does not link //gdr:distributed_nccl: asking for CUDA says which target
// is missing, before any rendezvous is attempted.
TEST(ProcessGroupTest, CudaWithoutTheNcclBackendLinkedIsRefused) {
  DistEnv env;
  env.world_size = 2;
  env.master_port = 1;
  const absl::Status status = ProcessGroup::create(env, true).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(status.message(),
            "data parallelism on CUDA needs the NCCL backend, which this binary does not link "
            "(//gdr:distributed_nccl; the CUDA trainer //tools:train_cuda has it)");
}

}  // namespace
}  // namespace gdr
