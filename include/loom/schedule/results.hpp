// loom/schedule/results.hpp — what a generator loader hands back: a device's batch, a step of
// every device's batches, the end-of-data report, and the error of a generator that threw.
//
// Example:
//   for (auto& step : loader)                             // loom::GeneratorLoaderStep<loom::Batch>
//     for (auto& db : step.devices) use(db.batch, db.generators);
//   for (const loom::GeneratorReport& g : loader.report().generators)
//     fmt::print("{}: {} unread\n", g.generator, g.unread);
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/schedule/options.hpp>

namespace loom {

/// The batch of one device at one step, with where its rows came from.
///
/// Example: `for (auto& db : step.devices) loss += model(db.batch.data.to(device(db.device)))`.
/// Shape: `batch` is what the collate function made (DefaultCollate: loom::Batch, data N x (sample
///        shape)); `generators` has N entries, the generator id of each row, increasing.
template <class B>
struct DeviceBatch {
  B batch{};                      ///< the collated batch (an empty one if the device ran dry under drain)
  int device = 0;                 ///< logical device index (per-rank mode: the rank)
  std::int64_t step = 0;          ///< step index k (the k-th samples of the device's generators)
  std::vector<int> generators{};  ///< generator id of each row, in row order
  bool partial = false;           ///< drain only: some of the device's generators had ended (fewer rows)
  /// Rows in the batch (samples), 0 for a device that ran dry.
  [[nodiscard]] std::int64_t num_rows() const noexcept { return static_cast<std::int64_t>(generators.size()); }
};

/// One step of the in-process GeneratorLoader: the k-th batch of every device.
///
/// Example: `while (auto s = loader.next()) for (auto& db : s->devices) ...;` (db.device == index).
template <class B>
struct GeneratorLoaderStep {
  std::int64_t index = 0;                 ///< step k, counted from the start of the streams
  std::vector<DeviceBatch<B>> devices{};  ///< devices[d] is device d's batch
  /// True when any device's batch is partial or empty (drain only).
  [[nodiscard]] bool partial() const noexcept {
    return std::any_of(devices.begin(), devices.end(), [](const auto& d) { return d.partial; });
  }
};

/// Per-generator account at the end of the loading.
///
/// Units: samples, counted from the beginning of the stream (resumed samples included).
struct GeneratorReport {
  int generator = 0;           ///< generator id
  int device = 0;              ///< its device (per-rank mode: the rank)
  std::int64_t delivered = 0;  ///< samples that reached the consumer in a batch
  /// Samples of the stream not delivered (prefetched and dropped, or read to count them); exact
  /// only with unread_exact.
  std::int64_t unread = 0;
  /// True when the generator ended (so `unread` is its exact remainder); false when `unread` is a
  /// lower bound (count_unread off, count_unread_limit reached, or the generator threw while
  /// being counted).
  bool unread_exact = true;
  bool ended = false;  ///< the generator reached its end
};

/// How the loading ended, available from report() once next() returned std::nullopt.
///
/// Example: `for (auto& g : loader.report().generators) fmt::print("{}: {} unread\n", g.generator, g.unread);`
struct GeneratorLoaderReport {
  EndPolicy policy = EndPolicy::stop_at_shortest;
  std::int64_t steps = 0;       ///< steps delivered, counted from the beginning of the streams
  int shortest_generator = -1;  ///< stop_at_shortest: the generator whose end stopped the loading; -1 under drain
  std::vector<GeneratorReport> generators{};  ///< in increasing generator id (per-rank mode: this rank's generators)
};

/// A generator threw: rethrown on the consumer's thread, naming the generator, its device and the
/// index of the sample it was asked for. `original()` is the exception it threw.
///
/// Example: `catch (const loom::GeneratorError& e) { e.generator(); std::rethrow_exception(e.original()); }`
/// Source: a RemoteError (loom/error.hpp): another party (a worker thread's generator) failed.
class GeneratorError : public RemoteError {
 public:
  GeneratorError(int generator, int device, std::int64_t sample, const std::string& what, std::exception_ptr original)
      : RemoteError(fmt::format("schedule: generator {} (device {}) threw at its sample {} (0-based): {}", generator,
                                device, sample, what)),
        generator_(generator),
        device_(device),
        sample_(sample),
        original_(std::move(original)) {}

  [[nodiscard]] int generator() const noexcept { return generator_; }
  [[nodiscard]] int device() const noexcept { return device_; }
  [[nodiscard]] std::int64_t sample() const noexcept { return sample_; }
  [[nodiscard]] std::exception_ptr original() const noexcept { return original_; }

 private:
  int generator_;
  int device_;
  std::int64_t sample_;
  std::exception_ptr original_;
};

}  // namespace loom
