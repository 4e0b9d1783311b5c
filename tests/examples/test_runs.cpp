// Integration tests: short runs of every example (a small subset, 2 ranks over Gloo, 1-2 epochs),
// asserting that the loss falls and the model beats its baseline, that a resumed run ends exactly
// where an uninterrupted one does, and that bad input (a missing folder, a corrupt PNG, an empty
// CSV column) stops the example with an error naming the file.
//
// The example executables are found through $LOOM_EXAMPLES_DIR (set by examples/meson.build);
// a case whose executable is absent reports it and fails.
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <netinet/in.h>
#include <optional>
#include <regex>
#include <string>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

#include <doctest/doctest.h>
#include <fmt/format.h>
#include <png.h>

#include "support/temp_dir.hpp"

namespace test_runs {

namespace fs = std::filesystem;

namespace {

using loom::test::TempDir;

struct RunResult {
  int exit_code = -1;
  std::string output;  // stdout and stderr, interleaved
};

fs::path example(const std::string& name) {
  const char* dir = std::getenv("LOOM_EXAMPLES_DIR");
  REQUIRE_MESSAGE(dir != nullptr, "LOOM_EXAMPLES_DIR is not set (run through meson test)");
  const fs::path p = fs::path(dir) / name;
  REQUIRE_MESSAGE(fs::exists(p), "example not built: " << p.string());
  return p;
}

/// Runs `cmd` through the shell with launcher variables cleared, so the example spawns its own ranks.
RunResult run(const std::string& cmd) {
  const std::string full =
      "env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u OMPI_COMM_WORLD_RANK -u SLURM_PROCID -u LOOM_LAUNCHER " + cmd +
      " 2>&1";
  MESSAGE("running: " << cmd);
  RunResult r;
  FILE* pipe = ::popen(full.c_str(), "r");
  REQUIRE(pipe != nullptr);
  std::array<char, 4096> buf{};
  std::size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) r.output.append(buf.data(), n);
  const int status = ::pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return r;
}

/// The last line of `out` that starts with `prefix` (after any leading spaces), or "".
std::string line_starting(const std::string& out, const std::string& prefix) {
  std::string found;
  std::size_t pos = 0;
  while (pos < out.size()) {
    std::size_t end = out.find('\n', pos);
    if (end == std::string::npos) end = out.size();
    std::string line = out.substr(pos, end - pos);
    const std::size_t first = line.find_first_not_of(' ');
    if (first != std::string::npos && line.compare(first, prefix.size(), prefix) == 0) found = line;
    pos = end + 1;
  }
  return found;
}

/// key=value pairs of a line (values parsed as doubles).
std::map<std::string, double> fields(const std::string& line) {
  std::map<std::string, double> m;
  // A whole token only: a hex hash such as weights_fnv1a=4e41775fd3d1ab35 is not a number.
  static const std::regex kv(R"(([a-z_0-9]+)=(-?[0-9.]+(?:e[-+]?[0-9]+)?)(?=\s|$))");
  for (auto it = std::sregex_iterator(line.begin(), line.end(), kv); it != std::sregex_iterator(); ++it)
    m[(*it)[1].str()] = std::stod((*it)[2].str());
  return m;
}

std::string q(const fs::path& p) {
  return "'" + p.string() + "'";
}

void write_png(const fs::path& file, int size, unsigned char shade, bool disc) {
  fs::create_directories(file.parent_path());
  std::vector<unsigned char> rgba(static_cast<std::size_t>(4 * size * size));
  for (int y = 0; y < size; ++y)
    for (int x = 0; x < size; ++x) {
      const double dx = x - size / 2.0, dy = y - size / 2.0;
      const bool in = disc ? dx * dx + dy * dy < size * size / 9.0 : (x > size / 4 && x < 3 * size / 4);
      unsigned char* p = &rgba[static_cast<std::size_t>(4 * (y * size + x))];
      p[0] = p[1] = p[2] = shade;
      p[3] = in ? 255 : 0;
    }
  png_image img{};
  img.version = PNG_IMAGE_VERSION;
  img.width = img.height = static_cast<png_uint_32>(size);
  img.format = PNG_FORMAT_RGBA;
  REQUIRE(png_image_write_to_file(&img, file.c_str(), 0, rgba.data(), 0, nullptr) != 0);
}

/// A TCP port that was free a moment ago (bound to port 0, read back, closed).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  ::close(fd);
  return ntohs(addr.sin_port);
}

}  // namespace

TEST_SUITE("runs") {
  TEST_CASE(
      "readme_loop: 2 epochs on 2 ranks, then --resume to 4 on 3 ranks, ends like 4 epochs straight; without "
      "--resume an old checkpoint is overwritten, not read") {
    TempDir dir;
    const std::string file = q(dir.path / "loop.ckpt");
    const std::string loop = q(example("readme_loop"));
    const auto straight = run(fmt::format("{} --nproc 2 --epochs 4 --checkpoint {}", loop, file));
    INFO(straight.output);
    REQUIRE(straight.exit_code == 0);
    const auto half = run(fmt::format("{} --nproc 2 --epochs 2 --checkpoint {}", loop, file));
    REQUIRE(half.exit_code == 0);
    const auto resumed = run(fmt::format("{} --nproc 3 --epochs 4 --checkpoint {} --resume", loop, file));
    INFO(resumed.output);
    REQUIRE(resumed.exit_code == 0);
    CHECK(line_starting(resumed.output, "epoch 0 ").empty());  // epochs 0 and 1 are not trained again
    CHECK(line_starting(resumed.output, "epoch 3 ") == line_starting(straight.output, "epoch 3 "));
    const auto a = fields(line_starting(straight.output, "result:"));
    const auto b = fields(line_starting(resumed.output, "result:"));
    REQUIRE(a.count("last_loss") == 1);
    CHECK(b.at("last_loss") == a.at("last_loss"));
    CHECK(b.at("val_accuracy") == a.at("val_accuracy"));
    CHECK(a.at("val_accuracy") > 0.8);  // two classes shifted by +-0.5: far above chance
    // The file now holds epoch 4's state; a run without --resume starts afresh from epoch 0.
    const auto fresh = run(fmt::format("{} --nproc 2 --epochs 4 --checkpoint {}", loop, file));
    REQUIRE(fresh.exit_code == 0);
    CHECK(line_starting(fresh.output, "epoch 0 ") == line_starting(straight.output, "epoch 0 "));
    CHECK(fields(line_starting(fresh.output, "result:")).at("last_loss") == a.at("last_loss"));
  }

  TEST_CASE("finetune_icons: a short 2-rank run learns (loss falls, accuracy beats the majority baseline)") {
    TempDir out;
    const auto r =
        run(fmt::format("{} --nproc 2 --subset 3 --epochs 2 --out {}", q(example("finetune_icons")), q(out.path)));
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const auto start = fields(line_starting(r.output, "fine-tune start:"));
    const auto e1 = fields(line_starting(r.output, "epoch 1/2:"));
    const auto e2 = fields(line_starting(r.output, "epoch 2/2:"));
    const auto result = fields(line_starting(r.output, "result:"));
    REQUIRE(start.count("val_loss") == 1);
    REQUIRE(e2.count("train_loss") == 1);
    REQUIRE(result.count("val_accuracy") == 1);
    CHECK(e2.at("train_loss") < e1.at("train_loss"));
    CHECK(e2.at("val_loss") < start.at("val_loss"));
    CHECK(result.at("val_accuracy") > result.at("majority_baseline") + 0.05);
    CHECK(result.at("epochs") == 2);
    CHECK(fs::is_regular_file(out.path / "pretrained.pt"));
    CHECK(fs::is_regular_file(out.path / "checkpoint.pt"));
  }

  TEST_CASE("finetune_icons: a run stopped mid-epoch and resumed from its checkpoint ends like an uninterrupted run") {
    TempDir a, b;
    const std::string common =
        fmt::format("{} --nproc 2 --subset 5 --epochs 2 --batches-per-step 4", q(example("finetune_icons")));
    const auto full = run(fmt::format("{} --out {}", common, q(a.path)));
    INFO(full.output);
    REQUIRE(full.exit_code == 0);
    const auto steps = fields(line_starting(full.output, "fine-tune plan:"));
    REQUIRE(steps.count("optimizer_steps_per_epoch") == 1);
    const auto per_epoch = static_cast<int64_t>(steps.at("optimizer_steps_per_epoch"));
    REQUIRE(per_epoch >= 4);
    const int64_t stop_at = per_epoch + per_epoch / 2;  // in the middle of epoch 2

    const auto stopped = run(fmt::format("{} --out {} --stop-after-steps {}", common, q(b.path), stop_at));
    INFO(stopped.output);
    REQUIRE(stopped.exit_code == 0);
    CHECK(line_starting(stopped.output, "result:").empty());
    CHECK(!line_starting(stopped.output, "stopped after").empty());

    const auto resumed = run(fmt::format("{} --out {} --resume {}", common, q(b.path), q(b.path / "checkpoint.pt")));
    INFO(resumed.output);
    REQUIRE(resumed.exit_code == 0);
    CHECK(!line_starting(resumed.output, "resumed at fine-tune epoch 2").empty());
    const auto want = fields(line_starting(full.output, "epoch 2/2:"));
    const auto got = fields(line_starting(resumed.output, "epoch 2/2:"));
    REQUIRE(got.count("val_loss") == 1);
    // Same weights, same optimizer state, same batches from the saved sampler position: the same numbers.
    CHECK(got.at("val_loss") == want.at("val_loss"));
    CHECK(got.at("val_accuracy") == want.at("val_accuracy"));
  }

  TEST_CASE(
      "finetune_icons: a run stopped on 2 ranks resumes on 3 and on 1 at the same global step and ends like the "
      "uninterrupted run") {
    TempDir a, b;
    const std::string options = "--subset 5 --epochs 2 --batches-per-step 4";
    const auto full = run(fmt::format("{} --nproc 2 {} --out {}", q(example("finetune_icons")), options, q(a.path)));
    INFO(full.output);
    REQUIRE(full.exit_code == 0);
    const auto plan = fields(line_starting(full.output, "fine-tune plan:"));
    REQUIRE(plan.count("optimizer_steps_per_epoch") == 1);
    const auto per_epoch = static_cast<int64_t>(plan.at("optimizer_steps_per_epoch"));
    REQUIRE(per_epoch >= 4);
    const int64_t stop_at = per_epoch + per_epoch / 2;  // in the middle of epoch 2
    const auto want = fields(line_starting(full.output, "result:"));
    REQUIRE(want.count("val_loss") == 1);

    const auto stopped = run(fmt::format("{} --nproc 2 {} --out {} --stop-after-steps {}", q(example("finetune_icons")),
                                         options, q(b.path), stop_at));
    INFO(stopped.output);
    REQUIRE(stopped.exit_code == 0);
    for (int nproc : {3, 1}) {
      TempDir c;
      fs::copy(b.path / "checkpoint.pt", c.path / "checkpoint.pt");
      const auto resumed = run(fmt::format("{} --nproc {} {} --out {} --resume {}", q(example("finetune_icons")), nproc,
                                           options, q(c.path), q(c.path / "checkpoint.pt")));
      INFO(resumed.output);
      REQUIRE(resumed.exit_code == 0);
      // It says where it resumed: the global step after the last committed one, on this world size.
      const auto at = fields(line_starting(resumed.output, "resumed at fine-tune epoch 2"));
      REQUIRE(at.count("global_step") == 1);
      CHECK(static_cast<int64_t>(at.at("global_step")) == stop_at - per_epoch);
      CHECK(static_cast<int>(at.at("ranks")) == nproc);
      const auto got = fields(line_starting(resumed.output, "result:"));
      REQUIRE(got.count("val_loss") == 1);
      // The same optimizer steps (every sample of the epoch once, in the same steps); float32 summation
      // order differs with the world size.
      CHECK(got.at("steps") == want.at("steps"));
      CHECK(std::abs(got.at("val_loss") - want.at("val_loss")) <= 1e-4 * std::abs(want.at("val_loss")));
    }
  }

  TEST_CASE("finetune_icons --deterministic: the same weights (hash of their bytes) on 1, 2 and 3 ranks") {
    // Pre-training and fine-tuning both deterministic; the floating run of the same options for the
    // accuracy comparison.
    const std::string args = "--subset 4 --epochs 1 --pretrain-epochs 1";
    static const std::regex hash_field(R"(weights_fnv1a=([0-9a-f]{16}))");
    std::map<int, std::string> hashes;
    std::map<int, double> accuracy;
    for (int nproc : {1, 2, 3}) {
      TempDir dir;
      const auto r = run(fmt::format("{} --nproc {} {} --deterministic --out {}", q(example("finetune_icons")), nproc,
                                     args, q(dir.path)));
      INFO(r.output);
      REQUIRE(r.exit_code == 0);
      const std::string line = line_starting(r.output, "result:");
      std::smatch m;
      REQUIRE(std::regex_search(line, m, hash_field));
      hashes[nproc] = m[1].str();
      accuracy[nproc] = fields(line).at("val_accuracy");
    }
    CHECK(hashes[2] == hashes[1]);
    CHECK(hashes[3] == hashes[1]);
    CHECK(accuracy[2] == accuracy[1]);
    TempDir dir;
    const auto floating = run(fmt::format("{} --nproc 2 {} --out {}", q(example("finetune_icons")), args, q(dir.path)));
    INFO(floating.output);
    REQUIRE(floating.exit_code == 0);
    const auto f = fields(line_starting(floating.output, "result:"));
    MESSAGE(fmt::format("val_accuracy: deterministic {:.4f}, floating {:.4f}", accuracy[1], f.at("val_accuracy")));
    CHECK(std::abs(accuracy[1] - f.at("val_accuracy")) <= 0.05);
  }

  TEST_CASE(
      "finetune_icons --zero 1: the weights of --zero 0 on 2 and 3 ranks with a shard of the state; resumes "
      "elsewhere") {
    const std::string args = "--subset 4 --epochs 2 --pretrain-epochs 1 --deterministic";
    static const std::regex hash_field(R"(weights_fnv1a=([0-9a-f]{16}))");
    struct Result {
      std::string hash;
      double state_bytes = 0;
    };
    auto result_of = [&](const std::string& extra, const fs::path& out) {
      const auto r = run(fmt::format("{} {} {} --out {}", q(example("finetune_icons")), args, extra, q(out)));
      INFO(r.output);
      REQUIRE(r.exit_code == 0);
      const std::string line = line_starting(r.output, "result:");
      std::smatch m;
      REQUIRE(std::regex_search(line, m, hash_field));
      return Result{m[1].str(), fields(line).at("optimizer_state_bytes")};
    };
    TempDir a;
    const Result whole = result_of("--nproc 1 --zero 0", a.path);
    for (int nproc : {2, 3}) {
      CAPTURE(nproc);
      TempDir d;
      const Result sharded = result_of(fmt::format("--nproc {} --zero 1", nproc), d.path);
      CHECK(sharded.hash == whole.hash);
      // Rank 0's shard of AdamW's state: 1/nproc of it, give or take a cut's alignment (64 elements).
      CHECK(sharded.state_bytes <= whole.state_bytes / nproc + 4 * 64 * 2 * 8);
      CHECK(sharded.state_bytes >= whole.state_bytes / nproc - 4 * 64 * 2 * 8);
    }
    // The floating reducer (no --deterministic): the unsharded run's bytes on the same world size.
    std::map<int, std::string> floating;
    for (int zero : {0, 1}) {
      TempDir d;
      const auto r = run(fmt::format("{} --subset 4 --epochs 1 --pretrain-epochs 1 --nproc 2 --zero {} --out {}",
                                     q(example("finetune_icons")), zero, q(d.path)));
      INFO(r.output);
      REQUIRE(r.exit_code == 0);
      std::smatch m;
      const std::string line = line_starting(r.output, "result:");
      REQUIRE(std::regex_search(line, m, hash_field));
      floating[zero] = m[1].str();
    }
    CHECK(floating[1] == floating[0]);
    // Stopped mid-epoch on 2 ranks with --zero 1, resumed on 3 with --zero 1 and on 1 with --zero 0.
    TempDir stopped;
    const auto s = run(fmt::format("{} {} --nproc 2 --zero 1 --stop-after-steps 9 --out {}",
                                   q(example("finetune_icons")), args, q(stopped.path)));
    INFO(s.output);
    REQUIRE(s.exit_code == 0);
    for (const char* extra : {"--nproc 3 --zero 1", "--nproc 1 --zero 0"}) {
      CAPTURE(extra);
      TempDir c;
      fs::copy(stopped.path / "checkpoint.pt", c.path / "checkpoint.pt");
      const Result resumed = result_of(fmt::format("{} --resume {}", extra, q(c.path / "checkpoint.pt")), c.path);
      CHECK(resumed.hash == whole.hash);
    }
  }

  TEST_CASE("finetune_icons --elastic 2 --deterministic: a rank killed mid-run, the same weights as nobody killed") {
    const std::string args = "--nproc 3 --subset 4 --epochs 1 --pretrain-epochs 1 --deterministic --elastic 2";
    static const std::regex hash_field(R"(weights_fnv1a=([0-9a-f]{16}))");
    auto hash_of = [&](const std::string& extra) {
      TempDir dir;
      const auto r = run(fmt::format("{} {} {} --out {}", q(example("finetune_icons")), args, extra, q(dir.path)));
      INFO(r.output);
      REQUIRE(r.exit_code == 0);
      std::smatch m;
      const std::string line = line_starting(r.output, "result:");
      REQUIRE(std::regex_search(line, m, hash_field));
      return std::make_pair(m[1].str(), r.output);
    };
    const auto [whole, whole_output] = hash_of("");
    for (int victim : {1, 0}) {
      CAPTURE(victim);
      const auto [killed, output] = hash_of(fmt::format("--kill-rank {} --kill-at-step 3", victim));
      INFO(output);
      CHECK(output.find(fmt::format("recovered: rank {} died at step", victim)) != std::string::npos);
      CHECK(output.find("2 ranks left") != std::string::npos);
      CHECK(killed == whole);
    }
  }

  TEST_CASE("finetune_icons: under torchrun's and mpirun's variables, the same result as with spawn") {
    const std::string args = "--subset 4 --epochs 1 --pretrain-epochs 1";
    TempDir a, b, c;
    const auto spawned = run(fmt::format("{} --nproc 2 {} --out {}", q(example("finetune_icons")), args, q(a.path)));
    INFO(spawned.output);
    REQUIRE(spawned.exit_code == 0);
    CHECK(spawned.output.find("(spawn launcher)") != std::string::npos);
    const auto want = fields(line_starting(spawned.output, "result:"));
    REQUIRE(want.count("val_accuracy") == 1);

    // torchrun's variables, set by hand for two background processes (what torchrun does).
    const int port = free_port();
    auto rank_cmd = [&](int rank, const fs::path& out) {
      return fmt::format(
          "RANK={0} WORLD_SIZE=2 LOCAL_RANK={0} LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={1} {2} {3} --out "
          "{4}",
          rank, port, q(example("finetune_icons")), args, q(out));
    };
    const auto torchrun =
        run(fmt::format("sh -c \"{} & {} > /dev/null; wait\"", rank_cmd(0, b.path), rank_cmd(1, b.path)));
    INFO(torchrun.output);
    CHECK(torchrun.output.find("(torchrun launcher)") != std::string::npos);
    const auto got = fields(line_starting(torchrun.output, "result:"));
    REQUIRE(got.count("val_accuracy") == 1);
    CHECK(got.at("val_accuracy") == want.at("val_accuracy"));

    if (run("command -v mpirun").exit_code != 0) {
      MESSAGE("mpirun not installed: its part is skipped");
      return;
    }
    const auto mpi = run(fmt::format(
        "mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT={} {} {} --out {}",
        free_port(), q(example("finetune_icons")), args, q(c.path)));
    INFO(mpi.output);
    CHECK(mpi.output.find("(mpirun launcher)") != std::string::npos);
    const auto got_mpi = fields(line_starting(mpi.output, "result:"));
    REQUIRE(got_mpi.count("val_accuracy") == 1);
    CHECK(got_mpi.at("val_accuracy") == want.at("val_accuracy"));
  }

  TEST_CASE("finetune_icons: a missing data folder is an error naming the folder") {
    const auto r = run(fmt::format("{} --nproc 2 --data /nonexistent/loom-icons", q(example("finetune_icons"))));
    INFO(r.output);
    CHECK(r.exit_code != 0);
    CHECK(r.output.find("/nonexistent/loom-icons: icon folder does not exist") != std::string::npos);
  }

  TEST_CASE("finetune_icons: a corrupt PNG is an error naming it, or skipped with a warning and a count when asked") {
    TempDir tmp;
    const fs::path theme = tmp.path / "theme";
    // Two contexts that differ in shape (bars vs discs), 24 names each, at 16 and 24 px.
    for (int i = 0; i < 24; ++i)
      for (int s : {16, 24}) {
        const auto shade = static_cast<unsigned char>(40 + 8 * i);
        write_png(theme / fmt::format("{}x{}", s, s) / "actions" / fmt::format("bar{}.png", i), s, shade, false);
        write_png(theme / fmt::format("{}x{}", s, s) / "status" / fmt::format("disc{}.png", i), s, shade, true);
      }
    {
      std::ofstream(theme / "16x16" / "status" / "broken.png", std::ios::binary)
          << "\x89PNG\r\n\x1a\n garbage after the signature";
    }
    const std::string cmd = fmt::format("{} --nproc 2 --data {} --sizes 16,24 --pretrain-sizes 16 --epochs 1 --out {}",
                                        q(example("finetune_icons")), q(theme), q(tmp.path / "out"));
    const auto strict = run(cmd);
    INFO(strict.output);
    CHECK(strict.exit_code != 0);
    CHECK(strict.output.find("broken.png: ") != std::string::npos);
    CHECK(strict.output.find("DataError") != std::string::npos);

    const auto lenient = run(cmd + " --skip-corrupt");
    INFO(lenient.output);
    CHECK(lenient.exit_code == 0);
    CHECK(lenient.output.find("warning: skipping " + (theme / "16x16" / "status" / "broken.png").string()) !=
          std::string::npos);
    CHECK(lenient.output.find("1 corrupt PNG files skipped") != std::string::npos);
    CHECK(!line_starting(lenient.output, "result:").empty());
  }

  TEST_CASE("generators_to_devices: 2 ranks and in-process devices learn to beat the naive forecast, and agree") {
    std::map<std::string, std::map<std::string, double>> results;
    for (const std::string mode :
         {"--mode ranks --devices 2", "--mode in-process --devices 2", "--mode in-process --devices 8"}) {
      const auto r = run(fmt::format("{} {} --epochs 2 --max-windows 128", q(example("generators_to_devices")), mode));
      INFO(r.output);
      REQUIRE(r.exit_code == 0);
      const auto before = fields(line_starting(r.output, "before training:"));
      const auto result = fields(line_starting(r.output, "result:"));
      REQUIRE(before.count("model_mse") == 1);
      REQUIRE(result.count("model_mse") == 1);
      CHECK(result.at("model_mse") < before.at("model_mse"));  // the held-out loss falls
      CHECK(result.at("model_mse") < result.at("naive_mse"));  // and beats the last-value forecast
      results[mode] = result;
    }
    // Exact weighting: 2 ranks (2-row batches reduced over Gloo) and 2 in-process devices (2
    // micro-batches of one window) take the same optimizer steps; only float summation order differs.
    const double a = results["--mode ranks --devices 2"].at("model_mse");
    const double b = results["--mode in-process --devices 2"].at("model_mse");
    CHECK(std::abs(a - b) <= 1e-3 * a);
  }

  TEST_CASE("generators_to_devices: an empty CSV column is an error naming the file and the column") {
    TempDir tmp;
    const char* names[] = {"seattle-temps.csv", "sf-temps.csv", "seattle-weather.csv", "stocks.csv",
                           "us-employment.csv"};
    fs::path src;
    for (const fs::path& dir : {fs::path("/usr/lib/python3/dist-packages/vega_datasets/_data"),
                                fs::path(LOOM_SOURCE_ROOT) / "third_party_data" / "vega_datasets"})
      if (fs::is_regular_file(dir / "us-employment.csv")) {
        src = dir;
        break;
      }
    REQUIRE_MESSAGE(!src.empty(), "vega-datasets CSV files not found: run scripts/setup.sh");
    for (const char* n : names) fs::copy_file(src / n, tmp.path / n);
    {
      std::ofstream(tmp.path / "sf-temps.csv", std::ios::trunc)
          << "temp,date\n,2010/01/01 00:00:00\n,2010/01/01 01:00:00\n";
    }
    const auto r = run(fmt::format("{} --mode in-process --data {}", q(example("generators_to_devices")), q(tmp.path)));
    INFO(r.output);
    CHECK(r.exit_code != 0);
    CHECK(r.output.find((tmp.path / "sf-temps.csv").string() + ": column 'temp' is empty") != std::string::npos);
  }

  TEST_CASE("fashion_mnist_multiscale: a short multi-scale 2-rank run learns (loss falls, accuracy far above 0.1)") {
    const auto r = run(fmt::format("{} --nproc 2 --train-subset 3000 --test-subset 1000 --epochs 2",
                                   q(example("fashion_mnist_multiscale"))));
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const auto e1 = fields(line_starting(r.output, "epoch 1/2:"));
    const auto e2 = fields(line_starting(r.output, "epoch 2/2:"));
    const auto result = fields(line_starting(r.output, "result:"));
    REQUIRE(result.count("test_accuracy") == 1);
    CHECK(e2.at("train_loss") < e1.at("train_loss"));
    CHECK(result.at("test_accuracy") > result.at("baseline") + 0.4);
  }

  TEST_CASE("fashion_mnist_multiscale: a missing data folder is an error naming the folder") {
    const auto r = run(fmt::format("{} --nproc 2 --data /nonexistent/fmnist", q(example("fashion_mnist_multiscale"))));
    INFO(r.output);
    CHECK(r.exit_code != 0);
    CHECK(r.output.find("/nonexistent/fmnist: Fashion-MNIST folder does not exist") != std::string::npos);
  }

}  // TEST_SUITE("runs")

}  // namespace test_runs
