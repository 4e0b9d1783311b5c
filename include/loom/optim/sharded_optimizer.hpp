// loom/optim/sharded_optimizer.hpp — ShardedOptimizer: ZeRO stage 1 for a torch::optim optimizer.
// Each rank keeps the optimizer state of its own shard of the parameters' elements only (about
// 1/world_size of it), steps that shard with the reduced gradients every rank holds, and the
// updated shards are all-gathered back into every rank's parameters.
//
// Example (the low-level loop; loom::Trainer does this with TrainerOptions::zero_stage = 1):
//   torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-3));
//   loom::Reducer reducer(comm, loom::parameters_of(*model));
//   loom::ShardedOptimizer sharded(comm, adam);     // adam keeps its groups and options, no state
//   ...  loss.backward(); loom::Reduction r = reducer.finish_window();
//   if (r.verdict == loom::StepVerdict::apply) sharded.step();   // every rank, at every applied step
//   adam.zero_grad();
//
// What it keeps: `optimizer` (the one passed in) stays the source of the parameter groups and their
//   options (a learning-rate schedule that sets them works as before; they are copied at every
//   step) but holds no state: its state moves into an optimizer of the same type over this rank's
//   pieces (shard_optimizer()). save_checkpoint / load_checkpoint gather and scatter it
//   (gather_state / scatter_state); `optimizer.save()` by hand would save no state.
// Exactness: the five optimizers update element by element, and every cut falls on a multiple of
//   64 elements of its parameter (optim/detail/shard_layout.hpp), so the parameters are
//   bit-identical to the unsharded optimizer's on any world size (same gradients, one intra-op thread).
// Cost per step: the shard's update (1/world_size of the optimizer's arithmetic), one all_gather per
//   bucket of `bucket_cap_bytes` (every parameter's bytes once, as the broadcast half of an
//   all-reduce), copies of the parameters into and out of the all-gather's buffers. Memory: the
//   optimizer state of this rank's elements; a bucket's send buffer; the all-gather's result.
// Throws: loom::InvalidArgument for an optimizer other than torch::optim's SGD, Adam, AdamW,
//   RMSprop or Adagrad (a subclass included: its update may not be element by element), a
//   trainable parameter that is not dense (overlapping or with gaps) or lives on another device
//   than the communicator, a sparse gradient, a bucket cap of 0, or ranks that would cut different
//   shards (another cap or other parameters); loom::Error when a parameter's storage, the
//   parameter groups or the communicator's rank or world size changed after construction; the
//   communicator's errors.
// Guide: docs/zero.md. Source: ZeRO stage 1 (Rajbhandari et al. 2020), PyTorch's
//   ZeroRedundancyOptimizer (sharded state over DDP's all-reduce), llm.c's ZeRO-1.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Type.h>
#include <fmt/format.h>
#include <torch/optim/optimizer.h>

#include <loom/comm/communicator.hpp>
#include <loom/comm/host_values.hpp>
#include <loom/error.hpp>
#include <loom/optim/detail/param_state.hpp>
#include <loom/optim/detail/shard_layout.hpp>
#include <loom/reduce/buckets.hpp>

namespace loom {

/// Options of ShardedOptimizer; use with designated initializers.
///
/// Example: `loom::ShardedOptimizerOptions{.bucket_cap_bytes = 8 * loom::kMiB}`.
/// Units: bytes. Every rank must pass the same value (the layout depends on it).
struct ShardedOptimizerOptions {
  std::size_t bucket_cap_bytes = 25 * kMiB;  ///< parameters all-gathered together (one all_gather per bucket)
};

/// Bytes of every state tensor `optimizer` holds (torch::optim's SGD, Adam, AdamW, RMSprop and
/// Adagrad; 0 for another optimizer). Example: `loom::optimizer_state_bytes(adam)` — 2 x 4 bytes per
/// float32 element Adam has stepped.
inline std::int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  return detail::state_bytes_of(optimizer);
}

/// ZeRO stage 1 over `optimizer` (see the file comment). Not copyable or movable (the shard's
/// optimizer keys its state by the shard views' addresses).
/// Example: `loom::ShardedOptimizer sharded(comm, adam); ... sharded.step();`
template <Communicator Comm>
class ShardedOptimizer {
 public:
  /// Lists `optimizer`'s trainable parameters (requires_grad, group by group), cuts them into
  /// shards, builds the optimizer over this rank's pieces and moves any state `optimizer` holds
  /// into it (a checkpoint loaded before; Adagrad's initial sums). One all_gather (world size > 1)
  /// compares the cap and the parameters' count and elements across the ranks.
  /// Throws: see the file comment.
  ShardedOptimizer(Comm& comm, torch::optim::Optimizer& optimizer, ShardedOptimizerOptions options = {})
      : comm_(&comm), user_(&optimizer), rank_(comm.rank()), world_size_(comm.world_size()) {
    const auto kind = detail::kind_of(optimizer);
    if (!kind)
      throw InvalidArgument(fmt::format(
          "ShardedOptimizer: {} is not one of the optimizers it can shard (torch::optim::SGD, Adam, AdamW, RMSprop, "
          "Adagrad: they update element by element)",
          c10::demangle(typeid(optimizer).name())));
    kind_ = *kind;
    std::vector<std::int64_t> numels;
    std::vector<c10::ScalarType> dtypes;
    const auto& groups = optimizer.param_groups();
    groups_ = detail::group_snapshot(optimizer);
    for (std::size_t g = 0; g < groups.size(); ++g)
      for (std::size_t i = 0; i < groups[g].params().size(); ++i) {
        const at::Tensor& p = groups[g].params()[i];
        if (!p.requires_grad()) continue;
        if (!p.is_non_overlapping_and_dense())
          throw InvalidArgument(fmt::format(
              "ShardedOptimizer: parameter {} of group {} (sizes {}, strides {}) is not dense; its elements cannot be "
              "cut into shards",
              i, g, fmt::join(p.sizes(), "x"), fmt::join(p.strides(), ",")));
        if (p.device() != comm.device())
          throw InvalidArgument(
              fmt::format("ShardedOptimizer: parameter {} of group {} is on {}, the communicator on {}", i, g,
                          p.device().str(), comm.device().str()));
        params_.push_back(p);
        flats_.push_back(flat_of(p.detach()));
        group_of_.push_back(g);
        numels.push_back(p.numel());
        dtypes.push_back(p.scalar_type());
      }
    layout_ = detail::ShardLayout::build(numels, dtypes, comm.world_size(), options.bucket_cap_bytes);
    check_same_layout(options.bucket_cap_bytes, numels);
    std::vector<std::vector<at::Tensor>> views(groups.size());
    for (std::size_t b = 0; b < layout_.buckets.size(); ++b)
      for (const detail::ShardPiece& piece : layout_.buckets[b].pieces[static_cast<std::size_t>(comm.rank())]) {
        at::Tensor view = flats_[piece.param].narrow(0, piece.offset, piece.length);
        mine_.push_back(Mine{piece, view});
        views[group_of_[piece.param]].push_back(view);
        shard_elements_ += piece.length;
      }
    detail::with_kind(kind_, [&](auto tag) {
      using Tag = decltype(tag);
      std::vector<torch::optim::OptimizerParamGroup> shard_groups;
      for (std::size_t g = 0; g < groups.size(); ++g) shard_groups.emplace_back(views[g], groups[g].options().clone());
      shard_ = std::make_unique<typename Tag::Optimizer>(
          std::move(shard_groups), static_cast<const typename Tag::OptionsType&>(optimizer.defaults()));
    });
    scatter_state();
  }

  ShardedOptimizer(const ShardedOptimizer&) = delete;
  ShardedOptimizer& operator=(const ShardedOptimizer&) = delete;

  /// Steps this rank's shard with the gradients the parameters hold (the reduced ones, equal on
  /// every rank; a parameter without a gradient is skipped, as the optimizer itself does), then
  /// all-gathers every bucket so that each rank holds every updated parameter. Every rank calls it
  /// at the same steps. Throws: loom::Error for a replaced parameter; the communicator's errors.
  void step() {
    at::NoGradGuard no_grad;
    check_unchanged("ShardedOptimizer::step");
    auto& mine_groups = shard_->param_groups();
    const auto& groups = user_->param_groups();
    for (std::size_t g = 0; g < groups.size(); ++g) mine_groups[g].set_options(groups[g].options().clone());
    for (Mine& m : mine_) {
      const at::Tensor& grad = params_[m.piece.param].grad();
      if (grad.defined() && grad.layout() != at::kStrided)
        throw InvalidArgument(fmt::format(
            "ShardedOptimizer::step: trainable parameter {} has a {} gradient; only dense (strided) gradients can be "
            "cut into shards (a sparse Embedding cannot be sharded)",
            m.piece.param, grad.is_sparse() ? "sparse" : "non-strided"));
      if (grad.defined())
        m.view.mutable_grad() = grad_flat(m.piece.param, grad).narrow(0, m.piece.offset, m.piece.length);
      else
        m.view.mutable_grad().reset();
    }
    shard_->step();
    for (Mine& m : mine_) m.view.mutable_grad().reset();
    gather_parameters();
  }

  /// Bytes of this rank's optimizer state tensors (about 1/world_size of the unsharded optimizer's).
  [[nodiscard]] std::int64_t state_bytes() const { return detail::state_bytes_of(*shard_); }
  /// Elements this rank steps, and of all trainable parameters.
  [[nodiscard]] std::int64_t shard_elements() const noexcept { return shard_elements_; }
  [[nodiscard]] std::int64_t elements() const noexcept {
    std::int64_t n = 0;
    for (const auto& b : layout_.buckets) n += b.elements;
    return n;
  }
  /// The buckets and every rank's pieces.
  [[nodiscard]] const detail::ShardLayout& layout() const noexcept { return layout_; }
  /// The optimizer over this rank's pieces (its state is this rank's shard of the state).
  [[nodiscard]] torch::optim::Optimizer& shard_optimizer() noexcept { return *shard_; }
  /// The optimizer passed in (groups and options; it holds state only between gather_state and
  /// release_state, on the root).
  [[nodiscard]] torch::optim::Optimizer& optimizer() const noexcept { return *user_; }

  /// Joins every rank's shard of the state into the optimizer passed in, on rank `root` only (the
  /// others take part in the all-gathers and keep nothing): what an unsharded optimizer would hold,
  /// for a checkpoint. Memory on `root`: the whole optimizer state until release_state(). Every rank
  /// calls it. Throws: the communicator's errors.
  void gather_state(int root = 0) {
    if (root < 0 || root >= world_size_)
      throw InvalidArgument(
          fmt::format("ShardedOptimizer::gather_state: root {} is outside [0, {})", root, world_size_));
    check_unchanged("ShardedOptimizer::gather_state");
    at::NoGradGuard no_grad;
    detail::with_kind(kind_, [&](auto tag) { gather_state_as(tag, root); });
  }
  /// Drops the state gather_state (or a load) put into the optimizer passed in.
  void release_state() { user_->state().clear(); }
  /// Takes this rank's pieces of the state the optimizer passed in holds (whole parameters: a
  /// checkpoint loaded into it), replacing this rank's shard state (a parameter without state there
  /// has none here), then releases it. When that optimizer holds no state at all, this rank's shard
  /// state stays as it is. No collective.
  /// Throws: loom::InvalidArgument for a state of another optimizer type.
  void scatter_state() {
    at::NoGradGuard no_grad;
    detail::with_kind(kind_, [&](auto tag) { scatter_state_as(tag); });
    release_state();
  }

 private:
  struct Mine {
    detail::ShardPiece piece;
    at::Tensor view;  // the piece of the parameter, the key of its state in shard_
  };

  /// `t`'s elements in storage order (a 1-D view; `t` is dense).
  static at::Tensor flat_of(const at::Tensor& t) { return t.as_strided({t.numel()}, {1}, t.storage_offset()); }

  /// Parameter j's gradient as a 1-D view in the parameter's storage order (a copy when its
  /// strides differ from the parameter's).
  at::Tensor grad_flat(std::size_t j, const at::Tensor& grad) const {
    const at::Tensor& p = params_[j];
    if (grad.strides() == p.strides() && grad.is_non_overlapping_and_dense()) return flat_of(grad);
    at::Tensor copy = at::empty_like(p);
    copy.copy_(grad);
    return flat_of(copy);
  }

  /// A state tensor of parameter j, 1-D in the parameter's storage order.
  at::Tensor state_flat(std::size_t j, const at::Tensor& t) const { return grad_flat(j, t.to(params_[j].device())); }

  /// loom::Error when the parameters, their groups, their storage or the communicator's rank or
  /// world size changed since construction (the layout and the state's keys would no longer fit).
  void check_unchanged(const char* where) const {
    if (comm_->rank() != rank_ || comm_->world_size() != world_size_)
      throw Error(fmt::format(
          "{}: the communicator is rank {} of {} now, rank {} of {} when this ShardedOptimizer was built (a recovered "
          "elastic group?); its shards of the state do not fit another group: build a new one from a checkpoint",
          where, comm_->rank(), comm_->world_size(), rank_, world_size_));
    if (!detail::same_groups(*user_, groups_))
      throw Error(fmt::format(
          "{}: the optimizer's parameter groups changed since the ShardedOptimizer was built (a group or parameter "
          "added or replaced, or one frozen or unfrozen); build a new optimizer and ShardedOptimizer (with "
          "loom::Trainer: "
          "a new Trainer)",
          where));
    for (std::size_t j = 0; j < params_.size(); ++j)
      if (params_[j].data_ptr() != flats_[j].data_ptr())
        throw Error(fmt::format(
            "{}: trainable parameter {} (sizes {}) has another storage than when the ShardedOptimizer was built "
            "(set_data or a new tensor); build a new optimizer and ShardedOptimizer (with loom::Trainer: a new "
            "Trainer)",
            where, j, fmt::join(params_[j].sizes(), "x")));
  }

  /// Every rank must have cut the same parameters with the same cap: one all_gather of (cap, count,
  /// elements) compares them. Throws: loom::InvalidArgument naming each rank's values.
  void check_same_layout(std::size_t cap, const std::vector<std::int64_t>& numels) {
    if (world_size_ == 1) return;
    std::int64_t elements = 0;
    for (std::int64_t n : numels) elements += n;
    const std::vector<std::int64_t> mine{static_cast<std::int64_t>(cap), static_cast<std::int64_t>(numels.size()),
                                         elements};
    std::vector<std::string> rows;
    bool same = true;
    for (const auto& v : detail::all_gather_int64(*comm_, mine)) {
      same = same && v == mine;
      rows.push_back(fmt::format("(bucket_cap_bytes {}, {} trainable parameters, {} elements)", v[0], v[1], v[2]));
    }
    if (!same)
      throw InvalidArgument(fmt::format(
          "ShardedOptimizer: the ranks would cut different shards: by rank {}; every rank must pass the same "
          "parameters and ShardedOptimizerOptions",
          fmt::join(rows, ", ")));
  }

  /// Every rank's updated pieces into every rank's parameters, one all_gather per bucket.
  void gather_parameters() {
    const auto me = static_cast<std::size_t>(comm_->rank());
    if (comm_->world_size() == 1) return;
    for (const detail::ShardBucket& b : layout_.buckets) {
      at::Tensor send = at::empty({b.chunk}, at::TensorOptions().dtype(b.dtype).device(comm_->device()));
      for (const detail::ShardPiece& p : b.pieces[me])
        send.narrow(0, p.position, p.length).copy_(flats_[p.param].narrow(0, p.offset, p.length));
      const std::vector<at::Tensor> all = comm_->all_gather(send);
      for (std::size_t r = 0; r < b.pieces.size(); ++r) {
        if (r == me) continue;
        for (const detail::ShardPiece& p : b.pieces[r])
          flats_[p.param].narrow(0, p.offset, p.length).copy_(all[r].narrow(0, p.position, p.length));
      }
    }
  }

  template <class Tag>
  void scatter_state_as(Tag /*tag*/) {
    using State = typename Tag::StateType;
    using Fields = typename Tag::Fields;
    auto& from = user_->state();
    auto& to = shard_->state();
    if (from.empty()) return;
    for (const Mine& m : mine_) {
      const auto key = detail::state_key(*shard_, m.view);
      const auto it = from.find(detail::state_key(*user_, params_[m.piece.param]));
      if (it == from.end()) {
        to.erase(key);
        continue;
      }
      const auto* whole = dynamic_cast<const State*>(it->second.get());
      if (whole == nullptr)
        throw InvalidArgument(fmt::format("ShardedOptimizer: the state of trainable parameter {} is not a {}",
                                          m.piece.param, c10::demangle(typeid(State).name())));
      auto piece = std::make_unique<State>();
      Fields::set_step(*piece, Fields::step(*whole));
      for (int i = 0; i < Fields::kTensors; ++i) {
        const at::Tensor& t = Fields::get(*whole, i);
        if (t.defined())
          Fields::set(*piece, i, state_flat(m.piece.param, t).narrow(0, m.piece.offset, m.piece.length).clone());
      }
      to[key] = std::move(piece);
    }
  }

  template <class Tag>
  void gather_state_as(Tag /*tag*/, int root) {
    using State = typename Tag::StateType;
    using Fields = typename Tag::Fields;
    const auto me = static_cast<std::size_t>(comm_->rank());
    const std::size_t n = params_.size();
    // Per parameter, from each rank holding a piece of it: whether it has state, its step, and
    // which tensors are defined (bit i); -1 where the rank holds no piece.
    std::vector<std::int64_t> row(n * 3, -1);
    const auto& mine_state = shard_->state();
    for (const Mine& m : mine_) {
      const auto it = mine_state.find(detail::state_key(*shard_, m.view));
      const auto* s = it == mine_state.end() ? nullptr : dynamic_cast<const State*>(it->second.get());
      std::int64_t mask = 0;
      for (int i = 0; s != nullptr && i < Fields::kTensors; ++i)
        if (Fields::get(*s, i).defined()) mask |= std::int64_t{1} << i;
      row[m.piece.param * 3] = s != nullptr ? 1 : 0;
      row[m.piece.param * 3 + 1] = s != nullptr ? Fields::step(*s) : 0;
      row[m.piece.param * 3 + 2] = mask;
    }
    const auto rows = detail::all_gather_int64(*comm_, row);
    std::vector<std::int64_t> has(n, 0), step(n, 0), mask(n, 0);
    for (std::size_t j = 0; j < n; ++j)
      for (const auto& r : rows) {
        const std::int64_t* v = r.data() + j * 3;
        if (v[0] < 0) continue;
        has[j] = v[0];
        step[j] = v[1];
        mask[j] = v[2];
        break;
      }
    bool keep = comm_->rank() == root;
    std::string failed;  // the root's own error while it assembles: it still joins every all_gather
    std::vector<std::unique_ptr<State>> whole(n);
    std::vector<at::Tensor> full(n);
    for (std::size_t j = 0; j < n && keep; ++j)
      if (has[j] != 0) {
        whole[j] = std::make_unique<State>();
        Fields::set_step(*whole[j], step[j]);
      }
    for (const detail::ShardBucket& b : layout_.buckets)
      for (int i = 0; i < Fields::kTensors; ++i) {
        bool any = false;
        for (std::size_t j : b.params) any = any || (has[j] != 0 && ((mask[j] >> i) & 1) != 0);
        if (!any) continue;
        at::Tensor send = at::zeros({b.chunk}, at::TensorOptions().dtype(b.dtype).device(comm_->device()));
        for (const detail::ShardPiece& p : b.pieces[me]) {
          const auto it = mine_state.find(detail::state_key(*shard_, mine_view(p)));
          if (it == mine_state.end()) continue;
          const at::Tensor& t = Fields::get(static_cast<const State&>(*it->second), i);
          if (t.defined()) send.narrow(0, p.position, p.length).copy_(t);
        }
        const std::vector<at::Tensor> all = comm_->all_gather(send);
        if (!keep) continue;
        try {
          // On the host: the whole state is the memory peak of a save, and it goes to a file.
          for (std::size_t j : b.params)
            if (has[j] != 0 && ((mask[j] >> i) & 1) != 0)
              full[j] =
                  at::empty_strided(params_[j].sizes(), params_[j].strides(), params_[j].options().device(at::kCPU));
          for (std::size_t r = 0; r < b.pieces.size(); ++r)
            for (const detail::ShardPiece& p : b.pieces[r])
              if (full[p.param].defined())
                flat_of(full[p.param]).narrow(0, p.offset, p.length).copy_(all[r].narrow(0, p.position, p.length));
          for (std::size_t j : b.params)
            if (full[j].defined()) Fields::set(*whole[j], i, std::move(full[j]));
        } catch (const std::exception& e) {
          failed = detail::first_line(e.what());
          keep = false;
          whole.clear();
        }
        for (std::size_t j : b.params)
          if (j < full.size()) full[j] = at::Tensor();
      }
    if (!failed.empty())
      throw Error(fmt::format(
          "ShardedOptimizer::gather_state: rank {} could not assemble the whole optimizer state: {}", root, failed));
    if (!keep) return;
    auto& to = user_->state();
    to.clear();
    for (std::size_t j = 0; j < n; ++j)
      if (whole[j]) to[detail::state_key(*user_, params_[j])] = std::move(whole[j]);
  }

  /// The view of this rank's piece `p` (it is one of mine_).
  const at::Tensor& mine_view(const detail::ShardPiece& p) const {
    for (const Mine& m : mine_)
      if (m.piece.param == p.param && m.piece.offset == p.offset) return m.view;
    throw Error("ShardedOptimizer: a piece of this rank has no view");  // unreachable by construction
  }

  Comm* comm_;
  torch::optim::Optimizer* user_;
  int rank_;  // the communicator's rank and world size at construction (the layout's)
  int world_size_;
  detail::GroupSnapshot groups_;  // the parameter groups at construction
  detail::OptimizerKind kind_ = detail::OptimizerKind::sgd;
  std::vector<at::Tensor> params_;     // the trainable parameters, group by group
  std::vector<at::Tensor> flats_;      // each one's elements in storage order (1-D views)
  std::vector<std::size_t> group_of_;  // each one's parameter group
  detail::ShardLayout layout_;
  std::vector<Mine> mine_;  // this rank's pieces, bucket by bucket
  std::int64_t shard_elements_ = 0;
  std::unique_ptr<torch::optim::Optimizer> shard_;
};

}  // namespace loom
