#include <loom/comm/local.hpp>

namespace test_local {

TEST_CASE("LocalCommunicator: collectives are the identity and check their tensors") {
  loom::LocalCommunicator comm;
  CHECK(comm.rank() == 0);
  CHECK(comm.world_size() == 1);
  auto t = torch::tensor({1.5, -2.0});
  comm.all_reduce(t, loom::ReduceOp::avg);
  CHECK(t[0].item<double>() == 1.5);
  CHECK(t[1].item<double>() == -2.0);
  auto g = comm.all_gather(t);
  REQUIRE(g.size() == 1);
  CHECK(torch::equal(g[0], t));
  auto nc = torch::zeros({3, 4}).t();
  CHECK_THROWS_AS(comm.all_reduce(nc, loom::ReduceOp::sum), loom::InvalidArgument);
  auto b = torch::zeros({2}, torch::kBool);
  CHECK_THROWS_WITH_AS(comm.all_reduce(b, loom::ReduceOp::sum), doctest::Contains("unsupported dtype Bool"),
                       loom::InvalidArgument);
  CHECK_THROWS_AS(comm.broadcast(t, 1), loom::InvalidArgument);
}

namespace {
/// Everything of a Communicator except device(): loom's parts could not know where to allocate.
struct NoDevice {
  int rank() const { return 0; }
  int world_size() const { return 1; }
  std::chrono::milliseconds timeout() const { return std::chrono::seconds(1); }
  void all_reduce(at::Tensor&, loom::ReduceOp) {}
  void broadcast(at::Tensor&, int) {}
  std::vector<at::Tensor> all_gather(const at::Tensor& t) { return {t}; }
  void barrier() {}
};
/// The same with device().
struct WithDevice : NoDevice {
  c10::Device device() const { return c10::Device(c10::kCPU); }
};
}  // namespace

TEST_CASE("Communicator requires device(): where the collectives take their tensors") {
  static_assert(!loom::Communicator<NoDevice>, "device() is required");
  static_assert(loom::Communicator<WithDevice>);
  static_assert(loom::AsyncCommunicator<loom::LocalCommunicator>);
  CHECK(loom::LocalCommunicator{}.device() == c10::Device(c10::kCPU));
}

}  // namespace test_local
