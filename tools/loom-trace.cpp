// loom-trace — reads the flight records a failed loom job left (one loom-trace-rank<r>.txt per
// rank, written by the ranks' communicators when a collective failed) and prints each rank's last
// collectives as a timeline and the verdict: the first rank that went its own way, where and when.
//
// Usage: loom-trace FOLDER [--job ID] [--world-size N] [--last K]
//   FOLDER        the folder named in the error ("records in ..."): GlooOptions::trace_folder,
//                 LOOM_TRACE_DIR, or ./loom-trace
//   --job         which job's records to read (the id on each record's "job" line); default: the
//                 job whose newest record was taken last. Records of other jobs in the folder (an
//                 earlier run's) are skipped, and the first lines say which.
//   --world-size  the job's number of ranks (default: what the records say), so that ranks that
//                 wrote no record are named
//   --last        how many collectives of each rank to print (default 8; 0: all the record holds)
// Exit status: 0 when the records show no divergence, 1 when they do, 2 on a usage or read error.
// docs/debugging.md explains what to make of the output.
#include <algorithm>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <loom/trace/all.hpp>

int main(int argc, char** argv) {
  CLI::App app{"loom-trace: the timeline and verdict of a failed loom job's flight records"};
  std::string folder;
  int world_size = 0;
  int last = 8;
  std::string job;
  app.add_option("folder", folder, "the folder holding loom-trace-rank<r>.txt files")->required();
  app.add_option("--job", job, "the job whose records to read (default: the newest job's)");
  app.add_option("--world-size", world_size, "the job's number of ranks (default: from the records)")
      ->check(CLI::PositiveNumber);
  app.add_option("--last", last, "collectives printed per rank (0: all)")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    auto all = loom::trace::read_folder(folder);
    if (all.empty()) {
      fmt::print(stderr, "loom-trace: no loom-trace-rank*.txt file in {}\n", folder);
      return 2;
    }
    const auto selection = loom::trace::select_job(std::move(all), job);
    const auto& records = selection.records;
    fmt::print("{}: {} {}\n", selection.job.empty() ? std::string("records without a job id") : "job " + selection.job,
               records.size(), records.size() == 1 ? "record" : "records");
    if (!selection.skipped_text.empty()) fmt::print("{} (loom-trace --job ID reads another)\n", selection.skipped_text);
    if (world_size == 0)
      for (const auto& r : records) world_size = std::max(world_size, r.world_size);
    for (const auto& r : records) {
      fmt::print(
          "rank {} of {} on {}: step {}, micro-batch {}, {} collectives issued; record taken {:.3f} s after its "
          "communicator started\n  reason: {}\n",
          r.rank, r.world_size, r.host, r.step, r.micro_batch, r.issued_total, r.taken_s, r.reason);
      const std::size_t n = r.entries.size();
      const std::size_t from =
          last == 0 || n <= static_cast<std::size_t>(last) ? 0 : n - static_cast<std::size_t>(last);
      for (std::size_t i = from; i < n; ++i) {
        const auto& e = r.entries[i];
        const std::string ended = e.ended_s >= 0 ? fmt::format("{:10.3f}", e.ended_s) : std::string(10, ' ');
        fmt::print("  {:10.3f} {} {:<9} {}\n", e.issued_s, ended, loom::trace::to_string(e.state),
                   loom::trace::describe(e));
      }
    }
    const auto v = loom::trace::first_divergence(records, world_size);
    fmt::print("verdict: {}\n", v.text);
    return v.diverged ? 1 : 0;
  } catch (const std::exception& e) {
    fmt::print(stderr, "loom-trace: {}\n", e.what());
    return 2;
  }
}
