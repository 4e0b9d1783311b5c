// loom/trace/record.hpp — what a flight recorder holds: one recorded collective (Entry: its
// operation, dtype and size, the loom part, step and micro-batch that issued it, its state) and a
// rank's record (Record: its entries oldest first, where the rank stood, when it was read), with
// the names records and messages print.
//
// Example:
//   loom::trace::Record r = comm.flight_recorder()->snapshot();
//   for (const loom::trace::Entry& e : r.entries) std::puts(loom::trace::describe(e).c_str());
//   // all_reduce #812 (reducer bucket 3, step 41, float32 x 1024)
//
// Units: times in seconds on the recorder's clock (steady, zero when the recorder was created);
// sizes in elements.
// Source: the entries of PyTorch's NCCL flight recorder, with loom's context and step.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <c10/core/ScalarType.h>
#include <fmt/format.h>

namespace loom::trace {

/// Which loom part issued a collective. `user` is any call outside a Scope.
enum class Context : std::uint8_t {
  user,
  reducer_window,       ///< the reducer's window meta as an all-reduce of its own (deterministic mode, no room)
  reducer_bucket,       ///< a gradient bucket's all-reduce (index: the bucket)
  parameter_check,      ///< the reducer's check that every rank holds the same parameters
  parameter_broadcast,  ///< rank 0's parameters and buffers sent to every rank
  buffer_broadcast,     ///< the reducer's per-window buffer broadcast (BatchNorm statistics)
  bucket_order,         ///< the reducer's broadcast of rank 0's gradient ready order (once)
  progress,             ///< loom::Progress's global sample count
  metrics,              ///< loom::sync_metrics / NamedMetrics
  logger,               ///< loom::Logger's gathered lines
  sampler_check,        ///< the epoch plan check (dealing, world size, dataset size)
  generator_loader,     ///< RankGeneratorLoader's per-batch agreement
  checkpoint,           ///< loom's checkpoint save/load
  evaluation,           ///< loom::evaluate / dist_sync of evaluation outputs
  main_process_first,   ///< loom::main_process_first's failure flags
  kCount
};

/// The name of a Context, as records and messages print it ("reducer bucket", "metrics", ...).
constexpr std::string_view to_string(Context c) noexcept {
  switch (c) {
    case Context::user: return "user";
    case Context::reducer_window: return "reducer window";
    case Context::reducer_bucket: return "reducer bucket";
    case Context::parameter_check: return "parameter check";
    case Context::parameter_broadcast: return "parameter broadcast";
    case Context::buffer_broadcast: return "buffer broadcast";
    case Context::bucket_order: return "bucket order";
    case Context::progress: return "progress";
    case Context::metrics: return "metrics";
    case Context::logger: return "logger";
    case Context::sampler_check: return "sampler check";
    case Context::generator_loader: return "generator loader";
    case Context::checkpoint: return "checkpoint";
    case Context::evaluation: return "evaluation";
    case Context::main_process_first: return "main process first";
    case Context::kCount: break;
  }
  return "?";
}

/// The collective of an entry.
enum class Op : std::uint8_t { all_reduce, broadcast, all_gather, barrier, kCount };

/// The name of an Op ("all_reduce", ...), as the communicators' messages spell it.
constexpr std::string_view to_string(Op op) noexcept {
  switch (op) {
    case Op::all_reduce: return "all_reduce";
    case Op::broadcast: return "broadcast";
    case Op::all_gather: return "all_gather";
    case Op::barrier: return "barrier";
    case Op::kCount: break;
  }
  return "?";
}

/// Where an entry's collective is: issued (in flight, or its handle never waited on), completed, failed.
enum class State : std::uint8_t { issued, completed, failed, kCount };

constexpr std::string_view to_string(State s) noexcept {
  switch (s) {
    case State::issued: return "issued";
    case State::completed: return "completed";
    case State::failed: return "failed";
    case State::kCount: break;
  }
  return "?";
}

/// One recorded collective.
/// Units: times in seconds since the recorder was created (steady clock); numel in elements.
/// `step` and `micro_batch` are the position set_position last gave (-1: never set); `index` the
/// context's own number (the bucket; -1 when the context has none).
struct Entry {
  std::int64_t seq = 0;  ///< 0, 1, 2, ... per communicator, in issue order
  Op op = Op::all_reduce;
  c10::ScalarType dtype = c10::ScalarType::Float;  ///< Undefined for a barrier
  std::int64_t numel = 0;
  Context context = Context::user;
  std::int64_t index = -1;
  std::int64_t step = -1;
  std::int64_t micro_batch = -1;
  bool step_checked = false;  ///< the position came from a plan every rank shares (see set_position)
  State state = State::issued;
  double issued_s = 0;
  double ended_s = -1;   ///< completed or failed; -1 while issued
  double waited_s = -1;  ///< when a wait for it began (-1: nobody waited yet); recorder memory only

  /// Whether two ranks issued the same collective: operation, dtype, element count, context, index,
  /// and the step when both ranks' steps are checked (not the micro-batch, whose count may differ
  /// between ranks in a step).
  [[nodiscard]] bool same_call(const Entry& o) const noexcept {
    return seq == o.seq && op == o.op && dtype == o.dtype && numel == o.numel && context == o.context &&
           index == o.index && (!step_checked || !o.step_checked || step == o.step);
  }
};

/// "all_reduce #812 (reducer bucket 3, step 41, float32 x 1024)".
inline std::string describe(const Entry& e) {
  std::string what(to_string(e.context));
  if (e.index >= 0) what += fmt::format(" {}", e.index);
  if (e.step >= 0) what += fmt::format(", step {}", e.step);
  if (e.micro_batch >= 0) what += fmt::format(", micro-batch {}", e.micro_batch);
  if (e.op != Op::barrier) what += fmt::format(", {} x {}", c10::toString(e.dtype), e.numel);
  return fmt::format("{} #{} ({})", to_string(e.op), e.seq, what);
}

/// What one rank's recorder held when it was read: its entries oldest first, where it stood, when.
struct Record {
  std::string job;  ///< the job's id, the same on every rank of one job ("": not known, e.g. an older file)
  int rank = 0;
  int world_size = 1;
  std::string host;        ///< "host:pid"
  std::int64_t step = -1;  ///< the last position set
  std::int64_t micro_batch = -1;
  double taken_s = 0;              ///< when the snapshot was taken, on the recorder's clock
  std::int64_t wall_start_ms = 0;  ///< the recorder's clock zero, in ms since the Unix epoch
  std::int64_t issued_total = 0;   ///< collectives issued over the recorder's life (entries hold the last ones)
  std::string reason;              ///< why it was written (the error, or "requested by rank r: ...")
  std::vector<Entry> entries;
};

}  // namespace loom::trace
