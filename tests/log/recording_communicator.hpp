// Test archetype: a Communicator that records every call it gets and lets a test play "the other
// ranks" through hooks. With no hooks it behaves like a world of `world_size` identical ranks:
// all_reduce sums as if every rank held the same tensor (sum -> t * world_size), all_gather returns
// world_size copies.
//
// It lets single-process tests check (1) which collectives a component issues, how many, with which
// dtype and size — so two RankInfos can be compared call for call ("every rank issues the same
// collectives"), and (2) what a rank does with answers that other ranks' data would produce.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include <loom/comm/communicator.hpp>

namespace loom_test {

/// One recorded collective: its name, the op (all_reduce), the root (broadcast), and a copy of the
/// tensor as this rank passed it in.
struct Call {
  std::string name;
  loom::ReduceOp op = loom::ReduceOp::sum;
  int root = -1;
  at::Tensor input;

  /// "all_reduce(sum) Double[2]" — compares call sequences across simulated ranks.
  [[nodiscard]] std::string signature() const {
    std::string s = name;
    if (name == "all_reduce") s += "(" + std::string(loom::to_string(op)) + ")";
    if (input.defined())
      s += " " + std::string(c10::toString(input.scalar_type())) + "[" + std::to_string(input.numel()) + "]";
    return s;
  }
};

class RecordingCommunicator {
 public:
  explicit RecordingCommunicator(int rank = 0, int world_size = 1) : rank_(rank), world_size_(world_size) {}

  /// Replaces the default all_reduce result; receives the tensor (already recorded) in place.
  std::function<void(at::Tensor&, loom::ReduceOp)> on_all_reduce;
  /// Replaces the default all_gather result.
  std::function<std::vector<at::Tensor>(const at::Tensor&)> on_all_gather;

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_size_; }
  [[nodiscard]] std::chrono::milliseconds timeout() const noexcept { return std::chrono::seconds(5); }

  void all_reduce(at::Tensor& t, loom::ReduceOp op) {
    loom::detail::check_collective_tensor(t, "all_reduce");
    calls_.push_back({"all_reduce", op, -1, t.clone()});
    if (on_all_reduce) {
      on_all_reduce(t, op);
    } else if (op == loom::ReduceOp::sum) {
      t.mul_(world_size_);
    }
  }
  void broadcast(at::Tensor& t, int root) {
    loom::detail::check_collective_tensor(t, "broadcast");
    calls_.push_back({"broadcast", loom::ReduceOp::sum, root, t.clone()});
  }
  [[nodiscard]] std::vector<at::Tensor> all_gather(const at::Tensor& t) {
    loom::detail::check_collective_tensor(t, "all_gather");
    calls_.push_back({"all_gather", loom::ReduceOp::sum, -1, t.clone()});
    if (on_all_gather) return on_all_gather(t);
    return std::vector<at::Tensor>(static_cast<std::size_t>(world_size_), t.clone());
  }
  void barrier() { calls_.push_back({"barrier", loom::ReduceOp::sum, -1, {}}); }

  [[nodiscard]] const std::vector<Call>& calls() const noexcept { return calls_; }
  [[nodiscard]] std::vector<std::string> signatures() const {
    std::vector<std::string> out;
    for (const auto& c : calls_) out.push_back(c.signature());
    return out;
  }

 private:
  int rank_;
  int world_size_;
  std::vector<Call> calls_;
};

static_assert(loom::Communicator<RecordingCommunicator>, "the archetype must model Communicator");
static_assert(!loom::AsyncCommunicator<RecordingCommunicator>, "the archetype is deliberately not async");

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

}  // namespace loom_test
