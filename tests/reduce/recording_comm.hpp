// tests/reduce/recording_comm.hpp — communicator archetypes for reducer tests: world size 1
// (collectives are the identity, as LocalCommunicator) but every call is recorded, so a test can
// check which collectives a reducer issues, in which order, with which dtype and size.
//
// RecordingCommunicator models AsyncCommunicator; BlockingRecordingCommunicator models only
// Communicator (the weakest legal use: no async all-reduce), so the reducer's blocking path runs.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <loom/comm/communicator.hpp>

namespace loom::test {

struct CommCall {
  std::string name{};       // "all_reduce", "all_reduce_async", "wait", "broadcast", "all_gather", "barrier"
  std::int64_t numel = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  std::int64_t id = -1;   // async: id of the collective (wait has the same id)
};

using CommLog = std::vector<CommCall>;

/// Handle of a recorded async all-reduce; wait() records "wait" once.
struct RecordingWork {
  std::shared_ptr<CommLog> log;
  std::int64_t id = -1;
  bool done = false;
  void wait() {
    if (!done) log->push_back({"wait", 0, c10::ScalarType::Undefined, id});
    done = true;
  }
  [[nodiscard]] bool is_completed() const { return done; }
};

class BlockingRecordingCommunicator {
 public:
  BlockingRecordingCommunicator() : log_(std::make_shared<CommLog>()) {}
  [[nodiscard]] int rank() const { return 0; }
  [[nodiscard]] int world_size() const { return 1; }
  [[nodiscard]] std::chrono::milliseconds timeout() const { return std::chrono::seconds(10); }
  void all_reduce(at::Tensor& t, ReduceOp) {
    detail::check_collective_tensor(t, "all_reduce");
    log_->push_back({"all_reduce", t.numel(), t.scalar_type()});
  }
  void broadcast(at::Tensor& t, int root) {
    detail::check_collective_tensor(t, "broadcast");
    detail::check_root(root, 1, "broadcast");
    log_->push_back({"broadcast", t.numel(), t.scalar_type()});
  }
  std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    detail::check_collective_tensor(t, "all_gather");
    log_->push_back({"all_gather", t.numel(), t.scalar_type()});
    return {t.clone()};
  }
  void barrier() { log_->push_back({"barrier"}); }

  [[nodiscard]] const CommLog& log() const { return *log_; }
  void clear() { log_->clear(); }

 protected:
  std::shared_ptr<CommLog> log_;
};

class RecordingCommunicator : public BlockingRecordingCommunicator {
 public:
  RecordingWork all_reduce_async(at::Tensor& t, ReduceOp) {
    detail::check_collective_tensor(t, "all_reduce");
    const auto id = next_id_++;
    log_->push_back({"all_reduce_async", t.numel(), t.scalar_type(), id});
    return {log_, id};
  }

 private:
  std::int64_t next_id_ = 0;
};

static_assert(AsyncCommunicator<RecordingCommunicator>);
static_assert(Communicator<BlockingRecordingCommunicator> && !AsyncCommunicator<BlockingRecordingCommunicator>);

}  // namespace loom::test
