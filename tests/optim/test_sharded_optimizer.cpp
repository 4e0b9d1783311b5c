// loom::ShardedOptimizer (ZeRO stage 1) with ranks as threads (tests/support/thread_communicator.hpp):
// the shard layout worked by hand; on 1, 2, 3 and 4 ranks each of SGD (momentum, nesterov), Adam
// (amsgrad), AdamW, RMSprop (centered, momentum) and Adagrad leaves parameters bit-identical to the
// same optimizer unsharded, over steps with a learning-rate change and a parameter without a
// gradient; the state per rank adds up to the unsharded state's bytes; gather_state rebuilds the
// unsharded optimizer's state bit for bit and scatter_state resumes it on another world size; misuse.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <doctest/doctest.h>
#include <torch/torch.h>

#include <loom/optim/sharded_optimizer.hpp>

#include "support/thread_communicator.hpp"

namespace {

using loom::detail::ShardLayout;
using loom::detail::ShardPiece;

/// Parameters of sizes that cut in interesting places: a matrix of 37 x 70 (2590 elements), a
/// vector of 130, one of 5 (never cut), a 3 x 64 matrix, all float32, and a float64 vector of 100
/// (a bucket of its own). Values from closed forms, the same on every rank.
std::vector<at::Tensor> make_params() {
  auto init = [](std::vector<int64_t> shape, double phase, at::ScalarType dtype) {
    int64_t n = 1;
    for (auto s : shape) n *= s;
    return torch::arange(n, torch::kDouble).mul(0.37).add(phase).sin().reshape(shape).to(dtype).requires_grad_();
  };
  return {init({37, 70}, 0.1, torch::kFloat), init({130}, 0.7, torch::kFloat), init({5}, 1.3, torch::kFloat),
          init({3, 64}, 2.1, torch::kFloat), init({100}, 0.5, torch::kDouble)};
}

/// The gradients of step s (the reduced ones, equal on every rank); parameter 2 has none at step 1.
void set_grads(const std::vector<at::Tensor>& params, int s) {
  for (std::size_t j = 0; j < params.size(); ++j) {
    at::Tensor p = params[j];
    if (j == 2 && s == 1) {
      p.mutable_grad().reset();
      continue;
    }
    p.mutable_grad() = torch::arange(p.numel(), torch::kDouble)
                           .mul(0.11 + 0.03 * s + 0.01 * static_cast<double>(j))
                           .cos()
                           .mul(1.0 + s)
                           .reshape(p.sizes())
                           .to(p.scalar_type());
  }
}

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(const std::vector<at::Tensor>&)>;

struct Case {
  const char* name;
  Factory make;
  double lr_after;  // the learning rate set from step 3 on
};

std::vector<Case> cases() {
  namespace o = torch::optim;
  return {
      {"SGD momentum nesterov",
       [](const std::vector<at::Tensor>& p) {
         return std::make_unique<o::SGD>(p, o::SGDOptions(0.1).momentum(0.9).nesterov(true).weight_decay(0.01));
       },
       0.05},
      {"Adam amsgrad",
       [](const std::vector<at::Tensor>& p) {
         return std::make_unique<o::Adam>(p, o::AdamOptions(1e-2).amsgrad(true).weight_decay(0.1));
       },
       3e-3},
      {"AdamW", [](const std::vector<at::Tensor>& p) { return std::make_unique<o::AdamW>(p, o::AdamWOptions(1e-2)); },
       2e-3},
      {"RMSprop centered momentum",
       [](const std::vector<at::Tensor>& p) {
         return std::make_unique<o::RMSprop>(p, o::RMSpropOptions(1e-2).centered(true).momentum(0.5));
       },
       4e-3},
      {"Adagrad",
       [](const std::vector<at::Tensor>& p) {
         return std::make_unique<o::Adagrad>(p, o::AdagradOptions(0.1).initial_accumulator_value(0.2));
       },
       0.02},
  };
}

void set_lr(torch::optim::Optimizer& o, double lr) {
  for (auto& g : o.param_groups()) g.options().set_lr(lr);
}

/// `steps` steps of the unsharded optimizer: its parameters and the optimizer.
struct Reference {
  std::vector<at::Tensor> params = make_params();
  std::unique_ptr<torch::optim::Optimizer> opt;
  Reference(const Case& c, int steps) : opt(c.make(params)) {
    for (int s = 0; s < steps; ++s) {
      if (s == 3) set_lr(*opt, c.lr_after);
      set_grads(params, s);
      opt->step();
    }
  }
};

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && torch::equal(a, b);
}

/// Every element of every parameter in exactly one piece, pieces contiguous within each shard.
void check_covers(const ShardLayout& layout, const std::vector<int64_t>& numels) {
  std::vector<std::vector<int>> seen(numels.size());
  for (std::size_t j = 0; j < numels.size(); ++j) seen[j].assign(static_cast<std::size_t>(numels[j]), 0);
  for (const auto& b : layout.buckets)
    for (const auto& rank : b.pieces) {
      int64_t position = 0;
      for (const ShardPiece& p : rank) {
        CHECK(p.position == position);
        position += p.length;
        for (int64_t e = p.offset; e < p.offset + p.length; ++e) ++seen[p.param][static_cast<std::size_t>(e)];
      }
      CHECK(position <= b.chunk);
    }
  for (const auto& s : seen)
    for (int v : s) REQUIRE(v == 1);
}

}  // namespace

TEST_CASE("ShardLayout: cuts worked by hand") {
  SUBCASE("one bucket of 1010 elements on 2 ranks: the cut moves back to 448") {
    const auto l = ShardLayout::build({1000, 10}, {at::kFloat, at::kFloat}, 2, 25 * loom::kMiB);
    REQUIRE(l.buckets.size() == 1);
    const auto& b = l.buckets[0];
    REQUIRE(b.pieces.size() == 2);
    REQUIRE(b.pieces[0].size() == 1);
    CHECK(b.pieces[0][0].param == 0);
    CHECK(b.pieces[0][0].offset == 0);
    CHECK(b.pieces[0][0].length == 448);
    REQUIRE(b.pieces[1].size() == 2);
    CHECK(b.pieces[1][0].offset == 448);
    CHECK(b.pieces[1][0].length == 552);
    CHECK(b.pieces[1][1].param == 1);
    CHECK(b.pieces[1][1].length == 10);
    CHECK(b.pieces[1][1].position == 552);
    CHECK(b.chunk == 562);
  }
  SUBCASE("3 ranks over 100 + 5 + 300: cuts at 35 -> 0 (param 0 is cut at multiples of 64) and 70 -> 64") {
    // T = 405, target 135: cut 1 at 135 falls in param 2 (start 105): 105 + 0 = 105; cut 2 at 270:
    // 105 + (165 / 64) * 64 = 233.
    const auto l = ShardLayout::build({100, 5, 300}, {at::kFloat, at::kFloat, at::kFloat}, 3, 25 * loom::kMiB);
    const auto& b = l.buckets.at(0);
    REQUIRE(b.pieces[0].size() == 2);  // params 0 and 1 whole
    CHECK(b.pieces[0][1].param == 1);
    REQUIRE(b.pieces[1].size() == 1);
    CHECK(b.pieces[1][0].param == 2);
    CHECK(b.pieces[1][0].offset == 0);
    CHECK(b.pieces[1][0].length == 128);
    REQUIRE(b.pieces[2].size() == 1);
    CHECK(b.pieces[2][0].offset == 128);
    CHECK(b.pieces[2][0].length == 172);
    CHECK(b.chunk == 172);
    check_covers(l, {100, 5, 300});
  }
  SUBCASE("dtypes never share a bucket; the cap closes one") {
    const auto l = ShardLayout::build({10, 20, 300, 5}, {at::kFloat, at::kDouble, at::kFloat, at::kFloat}, 2,
                                      /*cap_bytes=*/1200);
    REQUIRE(l.buckets.size() == 3);
    CHECK(l.buckets[0].params == std::vector<std::size_t>{0, 2});  // 40 + 1200 bytes: closed
    CHECK(l.buckets[1].params == std::vector<std::size_t>{1});
    CHECK(l.buckets[2].params == std::vector<std::size_t>{3});
    CHECK((l.buckets[1].dtype == at::kDouble));
    check_covers(l, {10, 20, 300, 5});
  }
  SUBCASE("more ranks than elements: cuts 1 and 2 move back to 0, cut 3 is the end; rank 2 holds it all") {
    const auto l = ShardLayout::build({3}, {at::kFloat}, 4, 25 * loom::kMiB);
    for (int r : {0, 1, 3}) CHECK(l.buckets[0].pieces[static_cast<std::size_t>(r)].empty());
    CHECK(l.buckets[0].pieces[2].size() == 1);
    CHECK(l.buckets[0].chunk == 3);
  }
  SUBCASE("every cut inside a parameter is a multiple of 64 of it, on 1..7 ranks") {
    const std::vector<int64_t> numels{2590, 130, 5, 192, 1000, 63, 4097};
    const std::vector<at::ScalarType> dtypes(numels.size(), at::kFloat);
    for (int w = 1; w <= 7; ++w) {
      CAPTURE(w);
      const auto l = ShardLayout::build(numels, dtypes, w, 25 * loom::kMiB);
      check_covers(l, numels);
      for (const auto& b : l.buckets)
        for (const auto& rank : b.pieces)
          for (const ShardPiece& p : rank) {
            CHECK(p.offset % loom::detail::kShardAlignment == 0);
            const bool ends_param = p.offset + p.length == numels[p.param];
            CHECK((ends_param || p.length % loom::detail::kShardAlignment == 0));
          }
    }
  }
  CHECK_THROWS_AS(ShardLayout::build({1}, {at::kFloat}, 0, 1), loom::InvalidArgument);
  CHECK_THROWS_AS(ShardLayout::build({1}, {at::kFloat}, 1, 0), loom::InvalidArgument);
}

TEST_CASE("ShardedOptimizer: bit-identical to the unsharded optimizer on 1, 2, 3 and 4 ranks") {
  at::set_num_threads(1);
  constexpr int kSteps = 6;
  for (const Case& c : cases()) {
    const Reference ref(c, kSteps);
    const int64_t ref_bytes = loom::optimizer_state_bytes(*ref.opt);
    REQUIRE(ref_bytes > 0);
    for (int world : {1, 2, 3, 4}) {
      CAPTURE(c.name);
      CAPTURE(world);
      loom::test::ThreadGroup group(world);
      std::vector<std::vector<at::Tensor>> out(static_cast<std::size_t>(world));
      std::vector<int64_t> bytes(static_cast<std::size_t>(world)), elements(static_cast<std::size_t>(world));
      group.run([&](int rank) {
        loom::test::ThreadCommunicator comm(group, rank);
        std::vector<at::Tensor> params = make_params();
        auto opt = c.make(params);
        // A small cap: several buckets per dtype.
        loom::ShardedOptimizer sharded(comm, *opt, {.bucket_cap_bytes = 4096});
        for (int s = 0; s < kSteps; ++s) {
          if (s == 3) set_lr(*opt, c.lr_after);  // set on the optimizer passed in, as a schedule does
          set_grads(params, s);
          sharded.step();
        }
        CHECK(opt->state().empty());
        out[static_cast<std::size_t>(rank)] = params;
        bytes[static_cast<std::size_t>(rank)] = sharded.state_bytes();
        elements[static_cast<std::size_t>(rank)] = sharded.shard_elements();
      });
      int64_t total_bytes = 0, total_elements = 0;
      for (int r = 0; r < world; ++r) {
        for (std::size_t j = 0; j < ref.params.size(); ++j) {
          CAPTURE(r);
          CAPTURE(j);
          CHECK(same_bytes(out[static_cast<std::size_t>(r)][j], ref.params[j]));
        }
        total_bytes += bytes[static_cast<std::size_t>(r)];
        total_elements += elements[static_cast<std::size_t>(r)];
      }
      CHECK(total_bytes == ref_bytes);
      CHECK(total_elements == 2590 + 130 + 5 + 192 + 100);
      if (world == 4) {  // each rank near a quarter of the state
        for (int64_t b : bytes) CHECK(b < ref_bytes / 2);
      }
    }
  }
}

TEST_CASE("ShardedOptimizer: gather_state gives the unsharded state; scatter_state resumes on another world size") {
  at::set_num_threads(1);
  for (const Case& c : cases()) {
    CAPTURE(c.name);
    const Reference first(c, 4);  // the uninterrupted run's state after 4 steps, and after 6
    const Reference whole(c, 6);
    // 4 steps on 2 ranks, the state gathered on rank 0 (what a checkpoint writes).
    std::vector<at::Tensor> saved_params;
    std::unique_ptr<torch::optim::Optimizer> saved;
    {
      loom::test::ThreadGroup group(2);
      group.run([&](int rank) {
        loom::test::ThreadCommunicator comm(group, rank);
        std::vector<at::Tensor> params = make_params();
        auto opt = c.make(params);
        loom::ShardedOptimizer sharded(comm, *opt, {.bucket_cap_bytes = 4096});
        for (int s = 0; s < 4; ++s) {
          if (s == 3) set_lr(*opt, c.lr_after);
          set_grads(params, s);
          sharded.step();
        }
        sharded.gather_state(0);
        if (rank == 0) {
          CHECK(loom::optimizer_state_bytes(*opt) == loom::optimizer_state_bytes(*first.opt));
          saved_params = params;
          saved = std::move(opt);
        } else {
          CHECK(opt->state().empty());
        }
      });
    }
    // Every state tensor equal to the unsharded optimizer's, bit for bit.
    REQUIRE(saved);
    for (std::size_t j = 0; j < saved_params.size(); ++j) {
      CAPTURE(j);
      const auto a = saved->state().find(loom::detail::state_key(*saved, saved_params[j]));
      const auto b = first.opt->state().find(loom::detail::state_key(*first.opt, first.params[j]));
      REQUIRE((a == saved->state().end()) == (b == first.opt->state().end()));
      if (a == saved->state().end()) continue;
      torch::serialize::OutputArchive x, y;
      a->second->serialize(x);
      b->second->serialize(y);
      std::ostringstream xs, ys;
      x.save_to(xs);
      y.save_to(ys);
      CHECK(xs.str() == ys.str());
    }
    // Resume on 3 ranks from those parameters and that state: 2 more steps, the uninterrupted run's bytes.
    loom::test::ThreadGroup group(3);
    std::vector<std::vector<at::Tensor>> out(3);
    group.run([&](int rank) {
      loom::test::ThreadCommunicator comm(group, rank);
      std::vector<at::Tensor> params = make_params();
      for (std::size_t j = 0; j < params.size(); ++j) params[j].detach().copy_(saved_params[j]);
      auto opt = c.make(params);
      set_lr(*opt, c.lr_after);
      // The gathered state into this rank's optimizer, as load_checkpoint does (every rank).
      torch::serialize::OutputArchive archive;
      saved->save(archive);
      std::ostringstream bytes;
      archive.save_to(bytes);
      std::istringstream in(bytes.str());
      torch::serialize::InputArchive loaded;
      loaded.load_from(in);
      opt->load(loaded);
      loom::ShardedOptimizer sharded(comm, *opt, {.bucket_cap_bytes = 4096});  // takes its pieces
      CHECK(opt->state().empty());
      for (int s = 4; s < 6; ++s) {
        set_grads(params, s);
        sharded.step();
      }
      out[static_cast<std::size_t>(rank)] = params;
    });
    for (int r = 0; r < 3; ++r)
      for (std::size_t j = 0; j < whole.params.size(); ++j) {
        CAPTURE(r);
        CAPTURE(j);
        CHECK(same_bytes(out[static_cast<std::size_t>(r)][j], whole.params[j]));
      }
  }
}

TEST_CASE("ShardedOptimizer: ranks that would cut different shards get an error naming each rank's values") {
  loom::test::ThreadGroup group(2);
  std::vector<std::string> errors(2);
  group.run([&](int rank) {
    loom::test::ThreadCommunicator comm(group, rank);
    std::vector<at::Tensor> params = make_params();
    torch::optim::SGD sgd(params, 0.1);
    try {
      loom::ShardedOptimizer sharded(comm, sgd, {.bucket_cap_bytes = rank == 0 ? 4096u : 8192u});
    } catch (const loom::InvalidArgument& e) {
      errors[static_cast<std::size_t>(rank)] = e.what();
    }
  });
  for (const auto& e : errors)
    CHECK(e.find("by rank (bucket_cap_bytes 4096, 5 trainable parameters, 3017 elements), (bucket_cap_bytes 8192") !=
          std::string::npos);
}

TEST_CASE("ShardedOptimizer: misuse is a loom error naming the value") {
  loom::test::ThreadGroup group(1);
  loom::test::ThreadCommunicator comm(group, 0);
  SUBCASE("an optimizer it cannot shard") {
    std::vector<at::Tensor> params = make_params();
    torch::optim::LBFGS lbfgs(params);
    CHECK_THROWS_WITH_AS(loom::ShardedOptimizer(comm, lbfgs), doctest::Contains("LBFGS"), loom::InvalidArgument);
    struct MyAdam : torch::optim::Adam {
      using torch::optim::Adam::Adam;
    };
    MyAdam mine(params);
    CHECK_THROWS_WITH_AS(loom::ShardedOptimizer(comm, mine), doctest::Contains("MyAdam"), loom::InvalidArgument);
  }
  SUBCASE("a parameter with gaps") {
    at::Tensor gappy = torch::ones({4, 8}).narrow(1, 0, 4).detach().requires_grad_();
    torch::optim::SGD sgd(std::vector<at::Tensor>{gappy}, 0.1);
    CHECK_THROWS_WITH_AS(loom::ShardedOptimizer(comm, sgd), doctest::Contains("parameter 0 of group 0 (sizes 4x4"),
                         loom::InvalidArgument);
  }
  SUBCASE("a parameter whose storage was replaced") {
    std::vector<at::Tensor> params = make_params();
    torch::optim::SGD sgd(params, 0.1);
    loom::ShardedOptimizer sharded(comm, sgd);
    params[1].set_data(torch::zeros({130}));
    set_grads(params, 0);
    CHECK_THROWS_WITH_AS(sharded.step(), doctest::Contains("trainable parameter 1 (sizes 130) has another storage"),
                         loom::Error);
  }
  SUBCASE("parameter groups changed after construction") {
    std::vector<at::Tensor> params = make_params();
    torch::optim::SGD sgd(std::vector<at::Tensor>{params[0], params[1]}, 0.1);
    loom::ShardedOptimizer sharded(comm, sgd);
    sgd.add_param_group(torch::optim::OptimizerParamGroup({params[2]}));
    set_grads(params, 0);
    CHECK_THROWS_WITH_AS(sharded.step(), doctest::Contains("the optimizer's parameter groups changed"), loom::Error);
  }
  SUBCASE("a sparse gradient") {
    std::vector<at::Tensor> params = make_params();
    torch::optim::SGD sgd(std::vector<at::Tensor>{params[1]}, 0.1);
    loom::ShardedOptimizer sharded(comm, sgd);
    params[1].mutable_grad() = torch::ones({130}).to_sparse();
    CHECK_THROWS_WITH_AS(sharded.step(), doctest::Contains("trainable parameter 0 has a sparse gradient"),
                         loom::InvalidArgument);
  }
  SUBCASE("gather_state to a root outside the group") {
    std::vector<at::Tensor> params = make_params();
    torch::optim::Adam adam(params);
    loom::ShardedOptimizer sharded(comm, adam);
    CHECK_THROWS_WITH_AS(sharded.gather_state(1), doctest::Contains("root 1 is outside [0, 1)"), loom::InvalidArgument);
  }
  SUBCASE("a scatter_state with no state to take keeps the shard's (Adagrad's sums)") {
    std::vector<at::Tensor> params = make_params();
    torch::optim::Adagrad adagrad(params, torch::optim::AdagradOptions(0.1).initial_accumulator_value(0.2));
    loom::ShardedOptimizer sharded(comm, adagrad);
    const int64_t bytes = sharded.state_bytes();
    sharded.scatter_state();  // the optimizer passed in holds nothing now
    CHECK(sharded.state_bytes() == bytes);
    set_grads(params, 0);
    sharded.step();
  }
  SUBCASE("frozen parameters are left out; a channels-last parameter is cut in storage order") {
    std::vector<at::Tensor> params = make_params();
    params[1].requires_grad_(false);
    at::Tensor cl = torch::arange(2 * 3 * 4 * 5, torch::kFloat)
                        .reshape({2, 3, 4, 5})
                        .contiguous(at::MemoryFormat::ChannelsLast)
                        .requires_grad_();
    params.push_back(cl);
    torch::optim::SGD sgd(params, 0.5);
    loom::ShardedOptimizer sharded(comm, sgd);
    CHECK(sharded.elements() == 2590 + 5 + 192 + 100 + 120);
    cl.mutable_grad() = torch::ones_like(cl);
    sharded.step();
    CHECK(cl.is_contiguous(at::MemoryFormat::ChannelsLast));
    CHECK(torch::equal(cl, torch::arange(120, torch::kFloat).reshape({2, 3, 4, 5}) - 0.5));
  }
}
