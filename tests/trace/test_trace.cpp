// The flight recorder on one process: the ring, the fingerprint, the record file's round trip, and
// first_divergence's rule on records built by hand.
#include <string>
#include <vector>

#include <loom/comm/local.hpp>
#include <loom/trace/all.hpp>

#include "support/recording_communicator.hpp"
#include "support/temp_dir.hpp"

namespace test_trace {

using loom::trace::Context;
using loom::trace::Entry;
using loom::trace::FlightRecorder;
using loom::trace::Op;
using loom::trace::Record;
using loom::trace::State;

namespace {

/// A record of `rank` whose entries are `calls` (seq 0, 1, ...), all completed but the last `open` ones.
Record record_of(int rank, int world, const std::vector<Entry>& calls, int open = 0) {
  FlightRecorder rec(rank, world, "host:1", 64);
  std::vector<std::int64_t> seqs;
  for (const Entry& e : calls) {
    rec.set_position(e.step, e.micro_batch, /*check_step=*/true);
    rec.set_context(e.context, e.index);
    seqs.push_back(rec.issue(e.op, e.dtype, e.numel));
  }
  for (std::size_t i = 0; i + static_cast<std::size_t>(open) < seqs.size(); ++i) rec.complete(seqs[i]);
  return rec.snapshot("test");
}

Entry call(Context c, std::int64_t index, std::int64_t step, std::int64_t numel = 8,
           c10::ScalarType dtype = c10::ScalarType::Float, Op op = Op::all_reduce) {
  Entry e;
  e.op = op;
  e.dtype = dtype;
  e.numel = numel;
  e.context = c;
  e.index = index;
  e.step = step;
  e.micro_batch = 0;
  return e;
}

/// One step of a reducer with two buckets: window meta, bucket 0, bucket 1.
std::vector<Entry> step_calls(std::int64_t step) {
  return {call(Context::reducer_window, -1, step, 8, c10::ScalarType::Long),
          call(Context::reducer_bucket, 0, step, 100), call(Context::reducer_bucket, 1, step, 50)};
}

std::vector<Entry> steps(std::int64_t from, std::int64_t to) {
  std::vector<Entry> out;
  for (std::int64_t s = from; s < to; ++s)
    for (const Entry& e : step_calls(s)) out.push_back(e);
  return out;
}

/// A communicator of one's own that keeps a flight recorder (models TracedCommunicator).
struct OwnRecorder {
  FlightRecorder recorder{0, 1, "h:1", 8};
  FlightRecorder* flight_recorder() { return &recorder; }
};

/// A flight_recorder() member of another type: not a TracedCommunicator.
struct WrongRecorder {
  [[nodiscard]] int* flight_recorder() const { return nullptr; }
};

}  // namespace

static_assert(loom::trace::TracedCommunicator<OwnRecorder>);
static_assert(!loom::trace::TracedCommunicator<const OwnRecorder>, "a non-const flight_recorder() needs a non-const C");
static_assert(!loom::trace::TracedCommunicator<WrongRecorder>, "flight_recorder() must return a FlightRecorder*");
static_assert(!loom::trace::TracedCommunicator<loom::LocalCommunicator>, "LocalCommunicator keeps no recorder");
static_assert(!loom::trace::TracedCommunicator<loom::test::RecordingCommunicator>,
              "the recording test communicator records calls, not a flight record");

TEST_CASE("TracedCommunicator: loom's parts reach a model's recorder, and nothing without one") {
  OwnRecorder own;
  CHECK(loom::trace::recorder_of(own) == &own.recorder);
  loom::trace::set_position(own, 5, 1);
  {
    loom::trace::Scope scope(own, Context::metrics, 2);
    own.recorder.issue(Op::all_reduce, c10::ScalarType::Float, 4);
  }
  const Record r = own.recorder.snapshot();
  REQUIRE(r.entries.size() == 1);
  CHECK(r.entries[0].context == Context::metrics);
  CHECK(r.entries[0].index == 2);
  CHECK(r.entries[0].step == 5);
  CHECK(own.recorder.context().first == Context::user);  // the scope restored it

  loom::LocalCommunicator local;
  CHECK(loom::trace::recorder_of(local) == nullptr);
  loom::trace::set_position(local, 5, 1);  // no effect, no crash
  loom::trace::Scope scope(local, Context::metrics);
  WrongRecorder wrong;
  CHECK(loom::trace::recorder_of(wrong) == nullptr);
}

TEST_CASE("flight recorder: the ring keeps the last entries in order, with contexts, positions and states") {
  FlightRecorder rec(1, 2, "h:1", 4);
  rec.set_position(7, 2);
  std::int64_t first = -1;
  for (int i = 0; i < 6; ++i) {
    loom::trace::Context c = i % 2 == 0 ? Context::metrics : Context::user;
    rec.set_context(c, i);
    const auto seq = rec.issue(Op::all_gather, c10::ScalarType::Double, 10 + i);
    if (i == 0) first = seq;
    if (i != 5) rec.complete(seq);
  }
  rec.complete(first);  // left the ring: no effect, no crash
  const Record r = rec.snapshot("why");
  CHECK(r.issued_total == 6);
  REQUIRE(r.entries.size() == 4);
  CHECK(r.entries.front().seq == 2);
  CHECK(r.entries.back().seq == 5);
  CHECK(r.entries[0].numel == 12);
  CHECK(r.entries[0].context == Context::metrics);
  CHECK(r.entries[1].context == Context::user);
  CHECK(r.entries[1].index == 3);
  CHECK(r.entries[3].state == State::issued);
  CHECK(r.entries[2].state == State::completed);
  CHECK(r.entries[2].ended_s >= r.entries[2].issued_s);
  CHECK(r.entries[3].step == 7);
  CHECK(r.entries[3].micro_batch == 2);
  CHECK(r.reason == "why");
  CHECK_THROWS_AS(FlightRecorder(0, 1, "h", 0), loom::InvalidArgument);
}

TEST_CASE("flight recorder: the fingerprint covers the calls since the last take, not the micro-batch") {
  auto run = [](const std::vector<Entry>& calls, bool check_step = true) {
    FlightRecorder rec(0, 1, "h", 16);
    (void)rec.take_fingerprint();
    for (const Entry& e : calls) {
      rec.set_position(e.step, e.micro_batch, check_step);
      rec.set_context(e.context, e.index);
      rec.issue(e.op, e.dtype, e.numel);
    }
    return rec.take_fingerprint();
  };
  const auto base = run(step_calls(3));
  CHECK(base >= 0);
  CHECK(base < (1 << 20));
  CHECK(run(step_calls(3)) == base);
  auto other_micro = step_calls(3);
  other_micro[1].micro_batch = 5;
  CHECK(run(other_micro) == base);
  CHECK(run(step_calls(4)) != base);                              // the step, when checked
  CHECK(run(step_calls(4), false) == run(step_calls(3), false));  // unchecked: shown only
  auto other_bucket = step_calls(3);
  other_bucket[2].index = 2;
  CHECK(run(other_bucket) != base);
  auto other_size = step_calls(3);
  other_size[1].numel = 101;
  CHECK(run(other_size) != base);
  auto skipped = step_calls(3);
  skipped.pop_back();
  CHECK(run(skipped) != base);
  // A take starts a new run.
  FlightRecorder rec(0, 1, "h", 16);
  rec.issue(Op::barrier, c10::ScalarType::Undefined, 0);
  const auto one = rec.take_fingerprint();
  CHECK(rec.take_fingerprint() != one);
}

TEST_CASE("flight recorder: a record survives its file, and bad files are named errors") {
  loom::test::TempDir dir;
  Record r = record_of(3, 4, steps(0, 2), 1);
  r.reason = "all_reduce timed out\non rank 3";
  r.entries[2].op = Op::barrier;
  r.entries[2].dtype = c10::ScalarType::Undefined;
  const auto path = loom::trace::write_record(dir.path, r);
  CHECK(path.filename() == "loom-trace-rank3.txt");
  const auto back = loom::trace::read_folder(dir.path);
  REQUIRE(back.size() == 1);
  const Record& b = back[0];
  CHECK(b.rank == 3);
  CHECK(b.world_size == 4);
  CHECK(b.host == "host:1");
  CHECK(b.reason == "all_reduce timed out on rank 3");
  CHECK(b.issued_total == 6);
  REQUIRE(b.entries.size() == r.entries.size());
  for (std::size_t i = 0; i < b.entries.size(); ++i) {
    CHECK(b.entries[i].same_call(r.entries[i]));
    CHECK(b.entries[i].micro_batch == r.entries[i].micro_batch);
    CHECK(b.entries[i].state == r.entries[i].state);
  }
  CHECK(b.entries.back().state == State::issued);
  CHECK(b.entries.back().step_checked);
  CHECK(b.entries[2].op == Op::barrier);
  CHECK(b.entries[1].context == Context::reducer_bucket);

  std::string text = loom::trace::to_text(r);
  text += "entry 9 all_reduce Float 3 no_such_context -1 1 1 0 completed 1.0 2.0\n";
  try {
    (void)loom::trace::parse_record(text, "x.txt");
    FAIL("no error");
  } catch (const loom::DataError& e) {
    CHECK(std::string(e.what()).find("x.txt: line") != std::string::npos);
    CHECK(std::string(e.what()).find("no_such_context") != std::string::npos);
  }
  CHECK_THROWS_AS((void)loom::trace::parse_record("hello\n", "y"), loom::DataError);
  CHECK_THROWS_AS((void)loom::trace::read_folder(dir.path / "missing"), loom::Error);
}

TEST_CASE("select_job: a folder with an earlier job's records keeps the newest job's and names what it skipped") {
  loom::test::TempDir dir;
  // The earlier job: 3 ranks, rank 2 skipped a bucket (its file is the only one the later job left).
  for (int rank = 0; rank < 3; ++rank) {
    Record r = record_of(rank, 3, rank == 2 ? steps(0, 1) : steps(0, 2), 1);
    r.job = "0000aaaa";
    r.wall_start_ms = 1'700'000'000'000;
    (void)loom::trace::write_record(dir.path, r);
  }
  // The later job: 2 ranks, the same calls on both, taken a minute later.
  for (int rank = 0; rank < 2; ++rank) {
    Record r = record_of(rank, 2, steps(0, 2), 1);
    r.job = "0000bbbb";
    r.wall_start_ms = 1'700'000'060'000;
    (void)loom::trace::write_record(dir.path, r);
  }
  const auto all = loom::trace::read_folder(dir.path);
  REQUIRE(all.size() == 3);
  CHECK(all[0].job == "0000bbbb");
  CHECK(all[2].job == "0000aaaa");
  const auto newest = loom::trace::select_job(all);
  CHECK(newest.job == "0000bbbb");
  REQUIRE(newest.records.size() == 2);
  CHECK(newest.records[1].rank == 1);
  REQUIRE(newest.skipped.size() == 1);
  CHECK(newest.skipped_text == "skipped 1 record of 1 other job: job 0000aaaa (rank 2)");
  CHECK_FALSE(loom::trace::first_divergence(newest.records, 2).diverged);
  // The earlier job named: its own record only (ranks 0 and 1 were overwritten).
  const auto earlier = loom::trace::select_job(all, "0000aaaa");
  REQUIRE(earlier.records.size() == 1);
  CHECK(earlier.records[0].rank == 2);
  CHECK(earlier.skipped_text == "skipped 2 records of 1 other job: job 0000bbbb (ranks 0, 1)");
  try {
    (void)loom::trace::select_job(all, "0000cccc");
    FAIL("no error");
  } catch (const loom::InvalidArgument& e) {
    CHECK(std::string(e.what()) == "loom: no record of job 0000cccc (the records are of: job 0000aaaa, job 0000bbbb)");
  }
  // A file without a job line (an older loom) reads as job "", a job of its own.
  Record old = record_of(5, 6, steps(0, 1), 1);
  CHECK(loom::trace::parse_record(loom::trace::to_text(old)).job.empty());
  CHECK(loom::trace::to_text(old).find("\njob ") == std::string::npos);
}

TEST_CASE("first_divergence: names the rank that skipped a bucket, at its step") {
  auto others = steps(0, 5);
  auto rank2 = steps(0, 4);
  // Step 4: rank 2 skips bucket 0, so its #13 is bucket 1 while the others' is bucket 0.
  rank2.push_back(step_calls(4)[0]);
  rank2.push_back(step_calls(4)[2]);
  std::vector<Record> records{record_of(0, 4, others, 1), record_of(1, 4, others, 1), record_of(2, 4, rank2, 1),
                              record_of(3, 4, others, 1)};
  const auto v = loom::trace::first_divergence(records, 4);
  CHECK(v.diverged);
  CHECK(v.ranks == std::vector<int>{2});
  CHECK(v.seq == 13);
  CHECK(v.step == 4);
  CHECK(v.missing.empty());
  INFO(v.text);
  CHECK(v.text.find("rank 2 issued all_reduce #13 (reducer bucket 1, step 4") != std::string::npos);
  CHECK(v.text.find("while ranks 0, 1, 3 issued all_reduce #13 (reducer bucket 0, step 4") != std::string::npos);
}

TEST_CASE("first_divergence: a rank outside any collective, a missing rank, no majority, no divergence") {
  SUBCASE("stalled: not in a collective, with its last collective's step") {
    auto others = steps(0, 3);
    others.push_back(step_calls(3)[0]);  // waiting in step 3's window meta
    std::vector<Record> records{record_of(0, 3, others, 1), record_of(1, 3, steps(0, 3), 0),
                                record_of(2, 3, others, 1)};
    const auto v = loom::trace::first_divergence(records, 3);
    CHECK(v.diverged);
    CHECK(v.ranks == std::vector<int>{1});
    CHECK(v.seq == 9);
    CHECK(v.step == 2);
    INFO(v.text);
    CHECK(v.text.find("rank 1 did not issue #9: it was not in a collective (last collective all_reduce #8") !=
          std::string::npos);
    CHECK(v.text.find("at step 2") != std::string::npos);
    CHECK(v.text.find("while ranks 0, 2 issued all_reduce #9 (reducer window, step 3") != std::string::npos);
  }
  SUBCASE("a rank that wrote no record is named; the others agree") {
    std::vector<Record> records{record_of(0, 3, steps(0, 2), 1), record_of(2, 3, steps(0, 2), 1)};
    const auto v = loom::trace::first_divergence(records, 3);
    CHECK_FALSE(v.diverged);
    CHECK(v.missing == std::vector<int>{1});
    CHECK(v.ranks == std::vector<int>{1});
    INFO(v.text);
    CHECK(v.text.find("rank 1 wrote no record") != std::string::npos);
    CHECK(v.text.find("up to #5") != std::string::npos);
  }
  SUBCASE("two ranks that disagree: both listed, none blamed") {
    auto a = steps(0, 1);
    auto b = steps(0, 1);
    b[2].numel = 51;
    const auto v = loom::trace::first_divergence({record_of(0, 2, a), record_of(1, 2, b)}, 2);
    CHECK(v.diverged);
    CHECK(v.ranks.empty());
    CHECK(v.seq == 2);
    INFO(v.text);
    CHECK(v.text.find("no majority") != std::string::npos);
    CHECK(v.text.find("Float x 51") != std::string::npos);
    CHECK(v.text.find("Float x 50") != std::string::npos);
  }
  SUBCASE("unchecked steps (a loop whose ranks may join others' steps) are shown, never compared") {
    auto a = steps(0, 2);
    auto b = steps(0, 2);
    for (auto& e : b) e.step += 5;
    Record ra = record_of(0, 2, a), rb = record_of(1, 2, b);
    for (auto* r : {&ra, &rb})
      for (auto& e : r->entries) e.step_checked = false;
    CHECK_FALSE(loom::trace::first_divergence({ra, rb}, 2).diverged);
    CHECK(loom::trace::first_conflict({ra, rb}) == -1);
    for (auto& e : rb.entries) e.step_checked = true;  // one side unchecked: still not compared
    CHECK(loom::trace::first_conflict({ra, rb}) == -1);
    for (auto& e : ra.entries) e.step_checked = true;
    CHECK(loom::trace::first_conflict({ra, rb}) == 0);
  }
  SUBCASE("the records hold different windows of a long run: only the common part is compared") {
    auto calls = steps(0, 30);  // 90 calls, the ring of 64 keeps 26..89
    const auto v = loom::trace::first_divergence({record_of(0, 2, calls), record_of(1, 2, calls)}, 2);
    CHECK_FALSE(v.diverged);
    CHECK(v.ranks.empty());
  }
}

}  // namespace test_trace
