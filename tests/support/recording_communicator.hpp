// tests/support/recording_communicator.hpp — communicator archetypes that record every call and
// let a test play "the other ranks" through hooks.
//
// RecordingCommunicator models loom::Communicator and deliberately not AsyncCommunicator (the
// weakest legal use: a component's blocking path runs); AsyncRecordingCommunicator adds
// all_reduce_async, recording the launch and its wait() under one id. With no hooks both behave
// like a world of `world_size` identical ranks: all_reduce(sum) multiplies by world_size (at world
// size 1, the default, every collective is the identity, as loom::LocalCommunicator),
// all_gather returns world_size copies, broadcast leaves the tensor as it is.
//
// What a test checks with them: (1) which collectives a component issues, how many, in which
// order, with which dtype and size — so two ranks can be compared call for call ("every rank
// issues the same collectives"); (2) what a rank does with answers that other ranks' data would
// produce (on_all_reduce / on_all_gather, gather_strings_from).
//
// Example:
//   loom::test::AsyncRecordingCommunicator comm;                // rank 0 of 1
//   loom::Reducer reducer(comm, params);
//   ... one backward ...
//   CHECK(comm.calls()[0].name == "all_reduce_async");
//   CHECK(comm.calls()[0].numel == 2);
#pragma once

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include <loom/comm/communicator.hpp>

namespace loom::test {

/// One recorded call: its name, the op (all-reduces), the root (broadcast), a copy of the tensor as
/// this rank passed it in, its size and dtype, and for an async all-reduce the id its wait shares.
struct Call {
  std::string name{};  ///< "all_reduce", "all_reduce_async", "wait", "broadcast", "all_gather", "barrier"
  loom::ReduceOp op = loom::ReduceOp::sum;
  int root = -1;
  at::Tensor input{};  ///< undefined for wait and barrier
  std::int64_t numel = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::int64_t id = -1;

  /// "all_reduce(sum) Double[2]" — compares call sequences across simulated ranks.
  [[nodiscard]] std::string signature() const {
    std::string s = name;
    if (name == "all_reduce") s += "(" + std::string(loom::to_string(op)) + ")";
    if (input.defined())
      s += " " + std::string(c10::toString(input.scalar_type())) + "[" + std::to_string(input.numel()) + "]";
    return s;
  }
};

using CallLog = std::vector<Call>;

class RecordingCommunicator {
 public:
  explicit RecordingCommunicator(int rank = 0, int world_size = 1)
      : rank_(rank), world_size_(world_size), calls_(std::make_shared<CallLog>()) {}

  /// Replaces the default all_reduce result; receives the tensor (already recorded) in place.
  std::function<void(at::Tensor&, loom::ReduceOp)> on_all_reduce;
  /// Replaces the default all_gather result.
  std::function<std::vector<at::Tensor>(const at::Tensor&)> on_all_gather;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return std::chrono::seconds(5); }
  [[nodiscard]] c10::Device device() const noexcept { return c10::Device(c10::kCPU); }

  void all_reduce(at::Tensor& t, loom::ReduceOp op) {
    loom::detail::check_collective_tensor(t, "all_reduce");
    record("all_reduce", t, op);
    reduce(t, op);
  }
  void broadcast(at::Tensor& t, int root) {
    loom::detail::check_collective_tensor(t, "broadcast");
    loom::detail::check_root(root, world_size_, "broadcast");
    record("broadcast", t, loom::ReduceOp::sum, root);
  }
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    loom::detail::check_collective_tensor(t, "all_gather");
    record("all_gather", t);
    if (on_all_gather) return on_all_gather(t);
    return std::vector<at::Tensor>(static_cast<std::size_t>(world_size_), t.clone());
  }
  void barrier() { calls_->push_back({.name = "barrier"}); }

  /// Every call so far, in order.
  [[nodiscard]] const CallLog& calls() const noexcept { return *calls_; }
  /// Call::signature() of every call so far.
  [[nodiscard]] std::vector<std::string> signatures() const {
    std::vector<std::string> out;
    for (const auto& c : *calls_) out.push_back(c.signature());
    return out;
  }
  /// Forgets the calls so far.
  void clear() { calls_->clear(); }

 protected:
  void record(std::string name, const at::Tensor& t, loom::ReduceOp op = loom::ReduceOp::sum, int root = -1,
              std::int64_t id = -1) {
    calls_->push_back({.name = std::move(name),
                       .op = op,
                       .root = root,
                       .input = t.clone(),
                       .numel = t.numel(),
                       .dtype = t.scalar_type(),
                       .id = id});
  }
  void reduce(at::Tensor& t, loom::ReduceOp op) {
    if (on_all_reduce) {
      on_all_reduce(t, op);
    } else if (op == loom::ReduceOp::sum && world_size_ != 1) {
      t.mul_(world_size_);
    }
  }

  int rank_;
  int world_size_;
  std::shared_ptr<CallLog> calls_;  // shared with RecordingWork, which records its wait()
};

/// Handle of a recorded async all-reduce; wait() records "wait" once, with the launch's id.
struct RecordingWork {
  std::shared_ptr<CallLog> calls;
  std::int64_t id = -1;
  bool done = false;
  void wait() {
    if (!done) calls->push_back({.name = "wait", .id = id});
    done = true;
  }
  [[nodiscard]] bool is_completed() const { return done; }
};

class AsyncRecordingCommunicator : public RecordingCommunicator {
 public:
  using RecordingCommunicator::RecordingCommunicator;

  /// Records "all_reduce_async" with a fresh id and reduces at once (the hook or the default);
  /// the returned work records its wait().
  RecordingWork all_reduce_async(at::Tensor& t, loom::ReduceOp op) {
    loom::detail::check_collective_tensor(t, "all_reduce");
    const auto id = next_id_++;
    record("all_reduce_async", t, op, -1, id);
    reduce(t, op);
    return {calls_, id};
  }

 private:
  std::int64_t next_id_ = 0;
};

static_assert(loom::Communicator<RecordingCommunicator>, "the archetype must model Communicator");
static_assert(!loom::AsyncCommunicator<RecordingCommunicator>, "the blocking archetype is deliberately not async");
static_assert(loom::AsyncCommunicator<AsyncRecordingCommunicator>);

/// Encodes `text` the way loom::detail::all_gather_strings sends it (int32 words, zero padded),
/// so an on_all_gather hook can answer as another rank would.
inline at::Tensor pack_string(const std::string& text, std::int64_t words) {
  at::Tensor t = at::zeros({words}, at::kInt);
  std::memcpy(t.data_ptr<std::int32_t>(), text.data(), text.size());
  return t;
}

/// An on_all_gather hook for a simulated world where rank r holds `texts[r]` (this rank's entry is
/// ignored: the tensor this rank passes is used). Handles both all_gathers of all_gather_strings.
inline std::function<std::vector<at::Tensor>(const at::Tensor&)> gather_strings_from(std::vector<std::string> texts,
                                                                                     int my_rank) {
  return [texts = std::move(texts), my_rank](const at::Tensor& t) {
    std::vector<at::Tensor> out;
    if (t.scalar_type() == at::kLong) {  // lengths
      for (std::size_t r = 0; r < texts.size(); ++r)
        out.push_back(static_cast<int>(r) == my_rank
                          ? t.clone()
                          : at::full({1}, static_cast<std::int64_t>(texts[r].size()), at::kLong));
    } else {  // bytes, padded to t.numel() words
      for (std::size_t r = 0; r < texts.size(); ++r)
        out.push_back(static_cast<int>(r) == my_rank ? t.clone() : pack_string(texts[r], t.numel()));
    }
    return out;
  };
}

}  // namespace loom::test
