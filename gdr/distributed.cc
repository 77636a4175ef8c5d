#include "gdr/distributed.h"

#include <ATen/ATen.h>
#include <torch/headeronly/version.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <new>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "gdr/distributed_backend.h"
#include "ops/tree_sum/tree_sum_op.h"

// Note [Gloo without gloo headers]: libtorch_cpu.so contains c10d's ProcessGroupGloo, but
// the libtorch distribution ships no gloo/ headers, which ProcessGroupGloo.hpp includes. We
// declare the three entry points we call, with the exact signatures libtorch exports, and
// use the object only through its c10d::Backend base (whose header is self-contained):
//   ProcessGroupGloo::Options::create_default(timeout)  (reads GLOO_SOCKET_IFNAME)
//   ProcessGroupGloo::ProcessGroupGloo(store, rank, size, options)
//   ProcessGroupGloo::~ProcessGroupGloo()
// Our declaration does not know sizeof(ProcessGroupGloo) (488 bytes in libtorch 2.11, read
// from its deleting destructor), so the object is constructed by placement new into a
// block of kGlooObjectBytes from ::operator new; the library's deleting destructor frees it
// with ::operator delete. Options objects come only from create_default and are destroyed
// through their virtual destructor. Replace this with #include
// <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp> once gloo headers are available.
static_assert(TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR == 11,
              "Note [Gloo without gloo headers]: check the declarations below and "
              "sizeof(c10d::ProcessGroupGloo) against this libtorch before changing the "
              "version here");
namespace c10d {
class ProcessGroupGloo : public Backend {
 public:
  struct Options : public Backend::Options {
    static c10::intrusive_ptr<Options> create_default(std::chrono::milliseconds timeout);
  };
  ProcessGroupGloo(const c10::intrusive_ptr<Store>& store, int rank, int size,
                   c10::intrusive_ptr<Options> options);
  ~ProcessGroupGloo() override;
};
}  // namespace c10d

namespace gdr {
namespace {

constexpr size_t kGlooObjectBytes = 4096;  // >= sizeof(c10d::ProcessGroupGloo) (488)
static_assert(kGlooObjectBytes >= 488);

absl::StatusOr<int64_t> parse_int(const char* name, const char* text) {
  int64_t v = 0;
  if (!absl::SimpleAtoi(text, &v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected an integer but got '", text, "'"));
  }
  return v;
}

// One line: c10::Error's what() carries a C++ backtrace.
std::string error_text(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

absl::StatusOr<DistEnv> read_dist_env(EnvGetter get) {
  if (get == nullptr) get = [](const char* n) -> const char* { return std::getenv(n); };
  auto value = [&](const char* name) -> const char* {
    const char* v = get(name);
    return (v != nullptr && *v != '\0') ? v : nullptr;
  };
  DistEnv env;
  if (const char* t = value("GDR_DIST_TIMEOUT_S")) {
    absl::StatusOr<int64_t> s = parse_int("GDR_DIST_TIMEOUT_S", t);
    if (!s.ok()) return s.status();
    if (*s <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("GDR_DIST_TIMEOUT_S: expected a positive number of seconds but got ", *s));
    }
    env.timeout = std::chrono::milliseconds(*s * 1000);
  }
  const char* ws = value("WORLD_SIZE");
  if (ws == nullptr) {
    if (value("RANK") != nullptr) {
      return absl::InvalidArgumentError("WORLD_SIZE: not set, but RANK is");
    }
    return env;
  }
  absl::StatusOr<int64_t> world = parse_int("WORLD_SIZE", ws);
  if (!world.ok()) return world.status();
  if (*world < 1 || *world > 65536) {
    return absl::InvalidArgumentError(
        absl::StrCat("WORLD_SIZE: expected 1..65536 but got ", *world));
  }
  env.world_size = static_cast<int>(*world);
  const char* rank = value("RANK");
  if (rank == nullptr && env.world_size > 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("RANK: not set, but WORLD_SIZE is ", env.world_size));
  }
  if (rank != nullptr) {
    absl::StatusOr<int64_t> r = parse_int("RANK", rank);
    if (!r.ok()) return r.status();
    if (*r < 0 || *r >= env.world_size) {
      return absl::InvalidArgumentError(absl::StrCat("RANK: ", *r, " is outside 0..",
                                                     env.world_size - 1, " (WORLD_SIZE ",
                                                     env.world_size, ")"));
    }
    env.rank = static_cast<int>(*r);
  }
  if (const char* lr = value("LOCAL_RANK")) {
    absl::StatusOr<int64_t> l = parse_int("LOCAL_RANK", lr);
    if (!l.ok()) return l.status();
    if (*l < 0) return absl::InvalidArgumentError(absl::StrCat("LOCAL_RANK: negative: ", *l));
    env.local_rank = static_cast<int>(*l);
  }
  if (const char* addr = value("MASTER_ADDR")) env.master_addr = addr;
  const char* port = value("MASTER_PORT");
  if (port == nullptr) {
    if (env.world_size > 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("MASTER_PORT: not set, but WORLD_SIZE is ", env.world_size));
    }
  } else {
    absl::StatusOr<int64_t> p = parse_int("MASTER_PORT", port);
    if (!p.ok()) return p.status();
    if (*p < 1 || *p > 65535) {
      return absl::InvalidArgumentError(
          absl::StrCat("MASTER_PORT: expected 1..65535 but got ", *p));
    }
    env.master_port = static_cast<int>(*p);
  }
  return env;
}

namespace {
std::atomic<NcclBackendFactory> nccl_backend_factory{nullptr};
}  // namespace

void register_nccl_backend_factory(NcclBackendFactory factory) {
  nccl_backend_factory.store(factory);
}

struct ProcessGroup::Impl {
  c10::intrusive_ptr<c10d::Store> store;      // "gdr/" keys: exchange()
  c10::intrusive_ptr<c10d::Backend> backend;  // Gloo (CPU tensors) or NCCL (CUDA tensors)
  bool cuda = false;
  int64_t exchanges = 0;
  bool two_rank_all_reduce = true;
};

void ProcessGroup::set_two_rank_all_reduce_for_testing(bool enabled) {
  impl_->two_rank_all_reduce = enabled;
}

ProcessGroup::ProcessGroup(DistEnv env, std::unique_ptr<Impl> impl)
    : env_(std::move(env)), impl_(std::move(impl)) {}
ProcessGroup::~ProcessGroup() = default;

absl::StatusOr<std::unique_ptr<ProcessGroup>> ProcessGroup::create(const DistEnv& env, bool cuda) {
  const NcclBackendFactory make_nccl = nccl_backend_factory.load();
  if (cuda && make_nccl == nullptr) {
    return absl::UnimplementedError(
        "data parallelism on CUDA needs the NCCL backend, which this binary does not link "
        "(//gdr:distributed_nccl; the CUDA trainer //tools:train_cuda has it)");
  }
  const std::string where = absl::StrCat(env.master_addr, ":", env.master_port);
  const std::string timeout_s = absl::StrCat(env.timeout.count() / 1000.0, " s");
  auto impl = std::make_unique<Impl>();
  c10::intrusive_ptr<c10d::Store> tcp;
  try {
    c10d::TCPStoreOptions options;
    options.port = static_cast<uint16_t>(env.master_port);
    options.isServer = env.rank == 0;
    options.numWorkers = env.world_size;
    options.waitWorkers = true;
    options.timeout = env.timeout;
    tcp = c10::make_intrusive<c10d::TCPStore>(env.master_addr, options);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env.rank, ": rendezvous at ", where,
                                               " failed within ", timeout_s, ": ", error_text(e)));
  }
  impl->store = c10::make_intrusive<c10d::PrefixStore>("gdr/", tcp);
  impl->cuda = cuda;
  if (cuda) {
    try {
      impl->backend = make_nccl(tcp, env.rank, env.world_size, env.local_rank, env.timeout);
    } catch (const std::exception& e) {
      return absl::UnavailableError(absl::StrCat("rank ", env.rank, ": NCCL process group at ",
                                                 where, " failed: ", error_text(e)));
    }
    return std::unique_ptr<ProcessGroup>(new ProcessGroup(env, std::move(impl)));
  }
  try {
    // Loopback unless told otherwise: the default (the address the hostname resolves to)
    // may be unroutable on single-host machines.
    c10::intrusive_ptr<c10d::ProcessGroupGloo::Options> options;
    {
      static std::mutex env_mutex;  // setenv/getenv are not thread-safe
      std::lock_guard<std::mutex> lock(env_mutex);
      if (std::getenv("GLOO_SOCKET_IFNAME") == nullptr &&
          (env.master_addr == "127.0.0.1" || env.master_addr == "localhost")) {
        setenv("GLOO_SOCKET_IFNAME", "lo", 0);
      }
      options = c10d::ProcessGroupGloo::Options::create_default(env.timeout);
    }
    void* memory = ::operator new(kGlooObjectBytes);
    c10d::ProcessGroupGloo* gloo = nullptr;
    try {
      gloo = new (memory) c10d::ProcessGroupGloo(
          c10::make_intrusive<c10d::PrefixStore>("gloo/", tcp), env.rank, env.world_size, options);
    } catch (...) {
      ::operator delete(memory);
      throw;
    }
    impl->backend = c10::intrusive_ptr<c10d::Backend>::unsafe_steal_from_new(gloo);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env.rank, ": Gloo process group at ", where,
                                               " failed within ", timeout_s, ": ", error_text(e)));
  }
  return std::unique_ptr<ProcessGroup>(new ProcessGroup(env, std::move(impl)));
}

absl::StatusOr<std::vector<std::string>> ProcessGroup::exchange(const std::string& key,
                                                                const std::string& value) {
  const std::string prefix = absl::StrCat(key, "/", impl_->exchanges++, "/");
  std::vector<std::string> out;
  try {
    impl_->store->set(absl::StrCat(prefix, env_.rank), value);
    for (int r = 0; r < env_.world_size; ++r) {
      std::vector<uint8_t> bytes = impl_->store->get(absl::StrCat(prefix, r));
      out.emplace_back(bytes.begin(), bytes.end());
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("rank ", env_.rank, ": exchanging ", key,
                                               " with the other ranks failed: ", error_text(e)));
  }
  return out;
}

// Note [Deferred gradient leaves]
// Adding leaf by leaf reads and writes the FP32 partial sum once per add: with M
// microbatches of the 0.8B model that is about 3 x 3.2 GB per add, and an FP32 += BF16 add
// runs ATen's casting (unrolled) elementwise path well below the HBM bandwidth (step
// profile: docs/benchmarks_log.md). So PairwiseSum keeps the newest leaves as they come (up
// to kDeferredLeaves - 1 of them, in their own dtype: half the bytes of FP32 for BF16) and
// evaluates the binary-counter tree over the FP32 partial sums, the deferred leaves and
// the last leaf in one pass per tensor
// (pairwise_tree_sum_out, ops/tree_sum/tree_sum_op.h): each input read once, the sum written once.
// A full group of kDeferredLeaves leaves (a power of two, and always starting at a multiple of it,
// so a complete subtree that the counter merges into one node before anything else touches it) is
// summed into one FP32 partial sum, which bounds the leaves kept. Every merge is still one FP32 add
// in the tree's order, so the bits are those of the leaf-by-leaf evaluation
// (tests/gdr/distributed_test.cc checks both against at::add).
static_assert((PairwiseSum::kDeferredLeaves & (PairwiseSum::kDeferredLeaves - 1)) == 0,
              "a deferred group must be a complete subtree");

namespace {

// FP32 (or `dtype`) tensors of `like`'s shapes tiling one new buffer in order, when they
// share a device; separate tensors otherwise.
std::vector<at::Tensor> tiled_like(const std::vector<at::Tensor>& like, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  out.reserve(like.size());
  bool same_device = true;
  int64_t total = 0;
  for (const at::Tensor& t : like) {
    same_device = same_device && t.device() == like[0].device();
    total += t.numel();
  }
  if (!like.empty() && same_device) {
    const at::Tensor flat = at::empty({total}, like[0].options().dtype(dtype));
    int64_t offset = 0;
    for (const at::Tensor& t : like) {
      out.push_back(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  } else {
    for (const at::Tensor& t : like) out.push_back(at::empty_like(t, dtype));
  }
  return out;
}

}  // namespace

void PairwiseSum::merge_equal_levels() {
  while (stack_.size() >= 2 && stack_[stack_.size() - 1].first == stack_[stack_.size() - 2].first) {
    auto newer = std::move(stack_.back());
    stack_.pop_back();
    auto& older = stack_.back();
    at::_foreach_add_(older.second, newer.second);  // FP32 += FP32
    older.first += newer.first;
  }
}

at::Tensor PairwiseSum::destination(size_t i, const at::Tensor& like) const {
  if (!stack_.empty()) return stack_[0].second[i];
  if (!sums_.empty()) return sums_[i];
  if (!deferred_.empty() && deferred_[0][i].scalar_type() == at::kFloat) return deferred_[0][i];
  return at::empty_like(like, at::kFloat);
}

at::Tensor PairwiseSum::sum_of_index(size_t i, const at::Tensor& last) const {
  std::vector<at::Tensor> inputs;
  std::vector<int64_t> leaves;
  for (const auto& [count, partial] : stack_) {
    inputs.push_back(partial[i]);
    leaves.push_back(count);
  }
  for (const std::vector<at::Tensor>& leaf : deferred_) {
    inputs.push_back(leaf[i]);
    leaves.push_back(1);
  }
  if (last.defined()) {
    inputs.push_back(last);
    leaves.push_back(1);
  }
  if (inputs.size() == 1 && inputs[0].scalar_type() == at::kFloat) return inputs[0];
  at::Tensor out = destination(i, inputs[0]);
  pairwise_tree_sum_out(inputs, leaves, out);
  return out;
}

void PairwiseSum::collapse_deferred() {
  std::vector<at::Tensor> partial =
      stack_.empty() && !sums_.empty() ? sums_ : tiled_like(deferred_[0], at::kFloat);
  const std::vector<int64_t> leaves(deferred_.size(), 1);
  for (size_t i = 0; i < partial.size(); ++i) {
    std::vector<at::Tensor> inputs;
    for (const std::vector<at::Tensor>& leaf : deferred_) inputs.push_back(leaf[i]);
    pairwise_tree_sum_out(inputs, leaves, partial[i]);
  }
  const int64_t count = static_cast<int64_t>(deferred_.size());
  deferred_.clear();
  stack_.emplace_back(count, std::move(partial));
  merge_equal_levels();
}

void PairwiseSum::add(std::vector<at::Tensor> leaf) {
  at::NoGradGuard no_grad;
  deferred_.push_back(std::move(leaf));
  if (deferred_.size() == kDeferredLeaves) collapse_deferred();
}

void PairwiseSum::allocate_sums_like(const std::vector<at::Tensor>& leaf) {
  // The sum's FP32 buffer, tiled in order (Note [Two-rank all-reduce]): the sums come out
  // as views of one buffer.
  if (stack_.empty() && deferred_.empty() && sums_.empty()) sums_ = tiled_like(leaf, at::kFloat);
}

void PairwiseSum::add_kept(const std::vector<at::Tensor>& leaf) {
  at::NoGradGuard no_grad;
  allocate_sums_like(leaf);
  deferred_.push_back(leaf);
  if (deferred_.size() == kDeferredLeaves) collapse_deferred();
}

at::Tensor PairwiseSum::finish_with_last(size_t i, at::Tensor last) {
  at::NoGradGuard no_grad;
  return sum_of_index(i, last);
}

std::vector<at::Tensor> PairwiseSum::finish() {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> out;
  const size_t n = !stack_.empty()      ? stack_[0].second.size()
                   : !deferred_.empty() ? deferred_[0].size()
                                        : 0;
  for (size_t i = 0; i < n; ++i) out.push_back(sum_of_index(i, at::Tensor()));
  stack_.clear();
  deferred_.clear();
  sums_.clear();
  return out;
}

namespace {

// The bucket rule of every gradient reduction: consecutive tensors (given by their element
// counts) in order, a bucket closed before one would overflow bucket_elements (a larger
// tensor is a bucket of its own). Returns [begin, end) tensor ranges.
std::vector<std::pair<size_t, size_t>> bucket_ranges(const std::vector<int64_t>& numels,
                                                     int64_t bucket_elements) {
  std::vector<std::pair<size_t, size_t>> ranges;
  size_t begin = 0;
  while (begin < numels.size()) {
    size_t end = begin;
    int64_t elements = 0;
    while (end < numels.size() && (end == begin || elements + numels[end] <= bucket_elements)) {
      elements += numels[end];
      ++end;
    }
    ranges.emplace_back(begin, end);
    begin = end;
  }
  return ranges;
}

// The W gathered copies of a bucket added by the rank-order tree (Note [Gradient reduction
// tree]).
at::Tensor sum_over_ranks(const std::vector<at::Tensor>& copies) {
  PairwiseSum tree;
  for (const at::Tensor& copy : copies) tree.add({copy});
  return tree.finish()[0];
}

// Starts an all-gather of `input` over the group; `gathered` gets one tensor per rank once
// the returned work completes.
c10::intrusive_ptr<c10d::Work> start_allgather(c10d::Backend& backend, int world,
                                               const at::Tensor& input,
                                               std::vector<at::Tensor>* gathered) {
  std::vector<at::Tensor> inputs{input};
  std::vector<std::vector<at::Tensor>> outputs(1);
  for (int r = 0; r < world; ++r) outputs[0].push_back(at::empty_like(input));
  c10::intrusive_ptr<c10d::Work> work = backend.allgather(outputs, inputs);
  *gathered = std::move(outputs[0]);
  return work;
}

absl::Status reduction_failed(int rank, int world, const std::exception& e) {
  return absl::UnavailableError(
      absl::StrCat("rank ", rank, " of ", world,
                   ": gradient all-reduce failed (a peer died, or did not answer within the "
                   "timeout, GDR_DIST_TIMEOUT_S): ",
                   error_text(e)));
}

// A 1-D view of exactly `tensors` when they are contiguous views that follow each other in
// one storage (as PairwiseSum::add_kept's sums do); undefined otherwise.
at::Tensor consecutive_range(const std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return {};
  const c10::Storage& storage = tensors[0].storage();
  const int64_t start = tensors[0].storage_offset();
  int64_t offset = start;
  for (const at::Tensor& t : tensors) {
    if (!t.is_contiguous() || !t.storage().is_alias_of(storage) || t.storage_offset() != offset ||
        t.scalar_type() != tensors[0].scalar_type()) {
      return {};
    }
    offset += t.numel();
  }
  return at::empty({0}, tensors[0].options()).set_(storage, start, {offset - start}, {1});
}

// tensors[begin, end) flattened into one new 1-D tensor, in order.
at::Tensor concat_flat(const std::vector<at::Tensor>& tensors, size_t begin, size_t end) {
  std::vector<at::Tensor> pieces;
  for (size_t i = begin; i < end; ++i) pieces.push_back(tensors[i].reshape({-1}));
  return at::cat(pieces);
}

// The inverse of concat_flat: copies consecutive pieces of `flat` into tensors[begin, end).
void copy_from_flat(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, size_t begin,
                    size_t end) {
  int64_t offset = 0;
  for (size_t i = begin; i < end; ++i) {
    tensors[i].copy_(flat.narrow(0, offset, tensors[i].numel()).view(tensors[i].sizes()));
    offset += tensors[i].numel();
  }
}

// All-reduces `tensors` in place with one collective: over the range they tile when they
// tile one, else over a concatenated copy, copied back by the returned function once the
// collective is done.
std::pair<c10::intrusive_ptr<c10d::Work>, std::function<void()>> start_all_reduce(
    c10d::Backend& backend, const std::vector<at::Tensor>& tensors) {
  at::Tensor flat = consecutive_range(tensors);
  std::function<void()> copy_back = [] {};
  if (!flat.defined()) {
    flat = concat_flat(tensors, 0, tensors.size());
    copy_back = [flat, tensors] { copy_from_flat(flat, tensors, 0, tensors.size()); };
  }
  std::vector<at::Tensor> io{flat};
  return {backend.allreduce(io), std::move(copy_back)};
}

}  // namespace

c10d::Backend& ProcessGroup::backend() const { return *impl_->backend; }

std::vector<int> optimizer_state_owners(const std::vector<int64_t>& numels, int world) {
  std::vector<int64_t> owned(std::max(world, 1), 0);
  std::vector<int> owners;
  owners.reserve(numels.size());
  for (int64_t n : numels) {
    // min_element returns the first minimum: ties go to the lowest rank.
    const int r = static_cast<int>(std::min_element(owned.begin(), owned.end()) - owned.begin());
    owners.push_back(r);
    owned[r] += n;
  }
  return owners;
}

absl::Status ProcessGroup::broadcast(const std::vector<at::Tensor>& tensors, int root,
                                     int64_t bucket_bytes) {
  try {
    at::NoGradGuard no_grad;
    // Byte views: the collective moves bytes, so any dtype goes (BF16 included) unchanged.
    std::vector<at::Tensor> bytes;
    for (const at::Tensor& t : tensors) {
      TORCH_CHECK(t.is_contiguous(), "broadcast: tensors must be contiguous");
      if (t.numel() > 0) bytes.push_back(t.reshape({-1}).view(at::kByte));
    }
    c10d::BroadcastOptions options;
    options.rootRank = root;
    for (size_t begin = 0; begin < bytes.size();) {
      size_t end = begin + 1;
      int64_t size = bytes[begin].numel();
      while (end < bytes.size() && size + bytes[end].numel() <= bucket_bytes) {
        size += bytes[end++].numel();
      }
      // One tensor goes in place; several through a concatenated copy.
      std::vector<at::Tensor> io{end - begin == 1 ? bytes[begin] : concat_flat(bytes, begin, end)};
      backend().broadcast(io, options)->wait();
      if (end - begin > 1) copy_from_flat(io[0], bytes, begin, end);
      begin = end;
    }
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("rank ", env_.rank, " of ", env_.world_size, ": broadcast from rank ", root,
                     " failed (a peer died, or did not answer within the timeout, "
                     "GDR_DIST_TIMEOUT_S): ",
                     error_text(e)));
  }
  return absl::OkStatus();
}

absl::Status ProcessGroup::all_reduce_sum(const std::vector<at::Tensor>& tensors,
                                          const std::vector<double>& extra,
                                          std::vector<std::vector<double>>* gathered_extra,
                                          int64_t bucket_elements) {
  const int world = env_.world_size;
  try {
    at::NoGradGuard no_grad;
    auto allgather = [&](const at::Tensor& input) {
      std::vector<at::Tensor> gathered;
      start_allgather(backend(), world, input, &gathered)->wait();
      return gathered;
    };
    // NCCL moves CUDA tensors only; the all-gather is pure data movement either way, and
    // the sum below runs on the tensors' device by the same tree.
    const at::Device device = impl_->cuda ? at::Device(at::kCUDA) : at::Device(at::kCPU);
    if (gathered_extra != nullptr) {
      std::vector<at::Tensor> got = allgather(
          at::tensor(extra, at::kDouble).reshape({static_cast<int64_t>(extra.size())}).to(device));
      gathered_extra->clear();
      for (const at::Tensor& t_any : got) {
        const at::Tensor t = t_any.cpu();
        const double* p = t.data_ptr<double>();
        gathered_extra->emplace_back(p, p + t.numel());
      }
    }
    std::vector<int64_t> numels;
    for (size_t i = 0; i < tensors.size(); ++i) {
      TORCH_CHECK(
          tensors[i].scalar_type() == at::kFloat && tensors[i].device().type() == device.type(),
          "all_reduce_sum: expected tensor ", i, " FP32 on ", device.type(),
          " (the process group's device) but got ", tensors[i].scalar_type(), " on ",
          tensors[i].device());
      numels.push_back(tensors[i].numel());
    }
    if (world == 2 && impl_->two_rank_all_reduce && !tensors.empty()) {
      // Note [Two-rank all-reduce]: with two ranks every element of the sum is one FP32
      // addition, rank 0's value + rank 1's, and IEEE addition is commutative: whatever
      // algorithm, protocol or chunking the backend's all-reduce picks, each element is that
      // one correctly rounded add, so the result has the bits of the rank-order tree below
      // (a NaN's payload aside), and ranks and reruns agree. It moves the same bytes as the
      // all-gather but needs no copies, no sum pass and no host wait per bucket: one
      // collective over the flat buffer the gradients tile (PairwiseSum::add_kept makes
      // them so), else over a concatenated copy.
      auto [work, copy_back] = start_all_reduce(backend(), tensors);
      work->wait();
      copy_back();
      return absl::OkStatus();
    }
    // Buckets by bucket_ranges. Up to kBucketsInFlight all-gathers are queued before the
    // oldest is waited for, so the transfers run back to back while earlier buckets are
    // summed; the sums themselves are the same tree in the same order, so this changes no
    // bits.
    struct InFlight {
      size_t begin = 0, end = 0;
      at::Tensor input;                  // kept alive until the collective is done
      std::vector<at::Tensor> gathered;  // one copy per rank
      c10::intrusive_ptr<c10d::Work> work;
    };
    std::deque<InFlight> in_flight;
    auto finish_oldest = [&] {
      InFlight bucket = std::move(in_flight.front());
      in_flight.pop_front();
      bucket.work->wait();
      copy_from_flat(sum_over_ranks(bucket.gathered), tensors, bucket.begin, bucket.end);
    };
    for (const auto& [begin, end] : bucket_ranges(numels, bucket_elements)) {
      InFlight bucket;
      bucket.begin = begin;
      bucket.end = end;
      bucket.input = concat_flat(tensors, begin, end);
      bucket.work = start_allgather(backend(), world, bucket.input, &bucket.gathered);
      in_flight.push_back(std::move(bucket));
      if (static_cast<int>(in_flight.size()) >= kBucketsInFlight) finish_oldest();
    }
    while (!in_flight.empty()) finish_oldest();
  } catch (const std::exception& e) {
    return reduction_failed(env_.rank, world, e);
  }
  return absl::OkStatus();
}

struct RangeAllReduce::State {
  ProcessGroup* group = nullptr;
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<std::function<void()>> copy_backs;
};

RangeAllReduce::RangeAllReduce(ProcessGroup& group) : state_(std::make_unique<State>()) {
  TORCH_CHECK(group.world_size() == 2, "RangeAllReduce: expected a group of 2 ranks but got ",
              group.world_size());
  state_->group = &group;
}

RangeAllReduce::~RangeAllReduce() = default;

void RangeAllReduce::start(const std::vector<at::Tensor>& tensors) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tensors[i].scalar_type() == at::kFloat, "RangeAllReduce::start: expected tensor ",
                i, " FP32 but got ", tensors[i].scalar_type());
  }
  at::NoGradGuard no_grad;
  auto [work, copy_back] = start_all_reduce(state_->group->backend(), tensors);
  state_->works.push_back(std::move(work));
  state_->copy_backs.push_back(std::move(copy_back));
}

absl::Status RangeAllReduce::finish() {
  try {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < state_->works.size(); ++i) {
      state_->works[i]->wait();
      state_->copy_backs[i]();
    }
  } catch (const std::exception& e) {
    return reduction_failed(state_->group->rank(), state_->group->world_size(), e);
  }
  state_->works.clear();
  state_->copy_backs.clear();
  return absl::OkStatus();
}

struct OverlappedReduction::State {
  ProcessGroup* group = nullptr;
  std::vector<std::vector<int64_t>> shapes;
  std::vector<size_t> bucket_of;          // tensor -> bucket
  std::vector<int64_t> offset_in_bucket;  // tensor -> element offset in its bucket
  std::vector<at::Tensor> flat;           // one FP32 buffer per bucket
  std::vector<int> missing;               // per bucket: tensors not set yet
  std::vector<bool> is_set;
  std::vector<std::vector<at::Tensor>> gathered;  // per bucket, one copy per rank
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  int64_t next_to_start = -1;  // the highest bucket not started; buckets start last-first
  std::mutex mutex;
};

OverlappedReduction::OverlappedReduction(ProcessGroup& group,
                                         const std::vector<std::vector<int64_t>>& shapes,
                                         const at::TensorOptions& options, int64_t bucket_elements)
    : state_(std::make_unique<State>()) {
  State& st = *state_;
  st.group = &group;
  st.shapes = shapes;
  st.is_set.assign(shapes.size(), false);
  std::vector<int64_t> numels;
  for (const std::vector<int64_t>& shape : shapes) numels.push_back(c10::multiply_integers(shape));
  for (const auto& [begin, end] : bucket_ranges(numels, bucket_elements)) {
    int64_t filled = 0;
    for (size_t i = begin; i < end; ++i) {
      st.bucket_of.push_back(st.flat.size());
      st.offset_in_bucket.push_back(filled);
      filled += numels[i];
    }
    st.missing.push_back(static_cast<int>(end - begin));
    st.flat.push_back(at::empty({filled}, options.dtype(at::kFloat)));
  }
  st.gathered.resize(st.flat.size());
  st.works.resize(st.flat.size());
  st.next_to_start = static_cast<int64_t>(st.flat.size()) - 1;
}

OverlappedReduction::~OverlappedReduction() = default;

void OverlappedReduction::start_ready_buckets() {
  State& st = *state_;
  while (st.next_to_start >= 0 && st.missing[st.next_to_start] == 0) {
    const size_t b = static_cast<size_t>(st.next_to_start);
    st.works[b] =
        start_allgather(st.group->backend(), st.group->world_size(), st.flat[b], &st.gathered[b]);
    --st.next_to_start;
  }
}

void OverlappedReduction::set(size_t i, const at::Tensor& local_sum) {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mutex);
  TORCH_CHECK(i < st.shapes.size() && !st.is_set[i], "OverlappedReduction::set: tensor ", i,
              i < st.shapes.size() ? " was already set" : " is out of range");
  TORCH_CHECK(local_sum.scalar_type() == at::kFloat && local_sum.sizes().vec() == st.shapes[i],
              "OverlappedReduction::set: expected tensor ", i, " FP32 of shape ", st.shapes[i],
              " but got ", local_sum.scalar_type(), " ", local_sum.sizes());
  at::NoGradGuard no_grad;
  const size_t b = st.bucket_of[i];
  st.flat[b]
      .narrow(0, st.offset_in_bucket[i], local_sum.numel())
      .view(local_sum.sizes())
      .copy_(local_sum);
  st.is_set[i] = true;
  --st.missing[b];
  start_ready_buckets();
}

absl::StatusOr<std::vector<at::Tensor>> OverlappedReduction::finish() {
  State& st = *state_;
  std::lock_guard<std::mutex> lock(st.mutex);
  for (size_t i = 0; i < st.is_set.size(); ++i) {
    if (!st.is_set[i]) {
      return absl::FailedPreconditionError(
          absl::StrCat("OverlappedReduction::finish: tensor ", i, " was never set"));
    }
  }
  const int world = st.group->world_size();
  std::vector<at::Tensor> out(st.shapes.size());
  try {
    at::NoGradGuard no_grad;
    start_ready_buckets();
    std::vector<at::Tensor> sums(st.flat.size());
    // Wait in start order (last bucket first), then the rank-order tree of all_reduce_sum.
    for (int64_t b = static_cast<int64_t>(st.flat.size()) - 1; b >= 0; --b) {
      st.works[b]->wait();
      sums[b] = sum_over_ranks(st.gathered[b]);
    }
    for (size_t i = 0; i < st.shapes.size(); ++i) {
      out[i] = sums[st.bucket_of[i]]
                   .narrow(0, st.offset_in_bucket[i], c10::multiply_integers(st.shapes[i]))
                   .view(st.shapes[i]);
    }
  } catch (const std::exception& e) {
    return reduction_failed(st.group->rank(), world, e);
  }
  return out;
}

absl::Status check_same_on_all_ranks(ProcessGroup& group, const std::string& what,
                                     const std::string& value) {
  absl::StatusOr<std::vector<std::string>> all = group.exchange(what, value);
  if (!all.ok()) return all.status();
  for (int r = 1; r < group.world_size(); ++r) {
    if ((*all)[r] != (*all)[0]) {
      return absl::FailedPreconditionError(absl::StrCat(what, " differs between ranks: rank 0 ",
                                                        (*all)[0], ", rank ", r, " ", (*all)[r]));
    }
  }
  return absl::OkStatus();
}

}  // namespace gdr
