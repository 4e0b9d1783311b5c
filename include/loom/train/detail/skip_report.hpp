// loom/train/detail/skip_report.hpp — the Trainer's account of skipped steps (SkippedStepOptions):
// counts per epoch and in a row, rank 0's warnings, and the errors the options ask for.
//
// Example (what the Trainer does at each step boundary):
//   loom::detail::SkipReport report(options.skipped_steps, /*loss_scaling=*/false, comm.rank());
//   report.begin_epoch(0);
//   if (skipped) report.skipped(step, "inf/NaN gradients", indices_of_step);  // may throw loom::Error
//   else report.applied();
//   report.end_epoch(steps_in_epoch);                                         // rank 0: the epoch's count
// Output: "loom: warning: ..." lines on stderr, rank 0 only.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/reduce/concepts.hpp>
#include <loom/reduce/options.hpp>
#include <loom/sample/global_plan.hpp>
#include <loom/train/options.hpp>

namespace loom::detail {

/// Dataset indices as a short list: the first `shown`, then how many more.
inline std::string indices_text(const std::vector<int64_t>& indices, std::size_t shown = 16) {
  std::string out;
  for (std::size_t i = 0; i < indices.size() && i < shown; ++i) out += fmt::format("{}{}", i ? ", " : "", indices[i]);
  if (indices.size() > shown) out += fmt::format(" and {} more", indices.size() - shown);
  return out;
}

/// The dataset indices of step `step`'s samples in `plan` (empty without a plan or for a step outside it).
inline std::vector<int64_t> step_indices(const EpochPlan* plan, int64_t step) {
  std::vector<int64_t> out;
  if (plan == nullptr || step < 0 || step >= static_cast<int64_t>(plan->steps.size())) return out;
  const GlobalStep& st = plan->steps[static_cast<std::size_t>(step)];
  for (int64_t b = st.first_batch; b < st.first_batch + st.num_batches; ++b) {
    const auto& indices = plan->batches[static_cast<std::size_t>(b)].indices;
    out.insert(out.end(), indices.begin(), indices.end());
  }
  return out;
}

/// Why a skipped step was skipped, for the warning: `verdict` is skip_grid_overflow or
/// skip_non_finite; a float16 wire (ReducerOptions::wire_dtype) is named as a possible cause.
/// Example: skip_reason(StepVerdict::skip_non_finite, {}) == "inf/NaN gradients".
inline const char* skip_reason(StepVerdict verdict, const ReducerOptions& options) {
  if (verdict == StepVerdict::skip_grid_overflow) return "a gradient too large for the deterministic grid";
  return options.wire_dtype == at::kHalf
             ? "inf/NaN gradients, or a gradient above 65504 on the float16 wire (ReducerOptions::wire_dtype)"
             : "inf/NaN gradients";
}

/// Counts skipped steps and says so (see the file comment).
class SkipReport {
 public:
  SkipReport(SkippedStepOptions options, bool loss_scaling, int rank)
      : options_(options), loss_scaling_(loss_scaling), rank_(rank) {}

  /// This process's rank changed (an elastic job's ranks are renumbered after a rank died): rank 0
  /// of the new group warns.
  void set_rank(int rank) noexcept { rank_ = rank; }

  void begin_epoch(int64_t epoch) {
    epoch_ = epoch;
    in_epoch_ = 0;
  }

  /// An applied step: the run of skipped steps ends.
  void applied() noexcept { consecutive_ = 0; }

  /// A skipped step `step` for `reason`; `indices` are its samples' dataset indices (empty when the
  /// source has no plan). Warns on rank 0 (unless loss scaling), then throws loom::Error on every
  /// rank when SkippedStepOptions::error is set or max_consecutive steps in a row were skipped.
  void skipped(int64_t step, const std::string& reason, const std::vector<int64_t>& indices) {
    ++in_epoch_;
    ++consecutive_;
    const std::string samples =
        indices.empty() ? std::string("its samples are unknown (the batch source has no plan)")
                        : fmt::format("its {} samples are dataset indices {}", indices.size(), indices_text(indices));
    const std::string what =
        fmt::format("epoch {}, step {} was skipped on every rank ({}; gradients zeroed, no optimizer step): {}", epoch_,
                    step, reason, samples);
    if (options_.warn && rank_ == 0 && !loss_scaling_ && !options_.error)
      print(fmt::format("{} (TrainerOptions::skipped_steps.error = true makes this an error)", what));
    if (options_.error) throw Error(fmt::format("Trainer: {} (TrainerOptions::skipped_steps.error is set)", what));
    if (options_.max_consecutive > 0 && consecutive_ >= options_.max_consecutive)
      throw Error(fmt::format(
          "Trainer: {} steps in a row were skipped, the last one {} (TrainerOptions::skipped_steps.max_consecutive = "
          "{}): the run is not training; look for inf/NaN in the data or the loss, or a learning rate too large",
          consecutive_, what, options_.max_consecutive));
  }

  /// The epoch's end: rank 0 prints its count of skipped steps, if any.
  void end_epoch(int64_t steps) const {
    if (in_epoch_ == 0 || !options_.warn || rank_ != 0) return;
    print(fmt::format("epoch {}: {} of {} steps skipped on every rank (inf/NaN gradients{})", epoch_, in_epoch_, steps,
                      loss_scaling_ ? "; with loss scaling the scaler skips steps while it backs off" : ""));
  }

  [[nodiscard]] int64_t in_epoch() const noexcept { return in_epoch_; }

 private:
  static void print(const std::string& line) {
    std::fprintf(stderr, "loom: warning: %s\n", line.c_str());
    std::fflush(stderr);
  }

  SkippedStepOptions options_;
  bool loss_scaling_;
  int rank_;
  int64_t epoch_ = 0;
  int64_t in_epoch_ = 0;
  int64_t consecutive_ = 0;
};

}  // namespace loom::detail
