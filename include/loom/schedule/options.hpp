// loom/schedule/options.hpp — what both generator loaders are told: the device count,
// assignment, prefetch, worker threads, the end-of-data policy, and the state to resume from.
//
// One options type serves both modes: GeneratorLoader (one process, num_devices logical devices)
// and RankGeneratorLoader (one process per rank: this rank feeds its own device, so num_devices
// stays 1, and the world size is the number of devices).
//
// Example:
//   loom::GeneratorLoaderOptions opts{.num_devices = 8, .prefetch_depth = 2, .end = loom::EndPolicy::drain};
//
// Source: the bounded prefetch per device follows torch.utils.data.DataLoader's prefetch_factor
// (batches prefetched per worker); the end policies are zip() and zip_longest().
#pragma once

#include <cstdint>
#include <vector>

#include <loom/schedule/assign.hpp>

namespace loom {

/// What happens when generators have different lengths.
///
/// Example: `loom::GeneratorLoaderOptions{.end = loom::EndPolicy::drain}`.
///  - stop_at_shortest: the loading ends at the first step k at which any generator has no k-th
///    sample; every delivered batch is full. The report says how many samples each generator
///    had left unread: exactly with count_unread (which reads the other generators on after the
///    end, up to count_unread_limit samples each), else a lower bound. (Per-rank mode: the
///    shortest generator over all ranks.)
///  - drain: a generator that ended drops out and its device's later batches have fewer rows
///    (DeviceBatch::partial); a device whose generators all ended gets an empty batch (0 rows,
///    weight 0 for loom::Batch) while other devices still have data; the loading ends when
///    every generator has ended. No sample is dropped.
/// Source: stop_at_shortest is Python's zip(); drain is itertools.zip_longest without fill values.
enum class EndPolicy { stop_at_shortest, drain };

/// Default of GeneratorLoaderOptions::count_unread_limit: samples read per generator, after a
/// stop_at_shortest end, to count the unread ones.
inline constexpr std::int64_t kDefaultCountUnreadLimit = 1'000'000;

/// Where a loader stands, to resume it later: steps delivered and samples delivered per generator.
///
/// Example: `auto s = loader.state(); ... GeneratorLoaderOptions{.resume = s}` continues with step s.steps.
/// Units: steps and samples count from the beginning of the streams (resumes included).
/// Resuming skips `samples[g]` samples of generator g: with g.skip(n) when the generator has it
/// (SkippableSampleGenerator), else by pulling and dropping them — so a resumed loader equals
/// the uninterrupted one when the generators replay the same streams.
struct GeneratorLoaderState {
  std::int64_t steps = 0;               ///< steps delivered
  std::vector<std::int64_t> samples{};  ///< samples delivered per generator id (size = number of generators)
  int num_devices = 0;                  ///< devices (per-rank mode: the world size) when taken; 0 = a fresh start
};

/// Options of GeneratorLoader and RankGeneratorLoader.
///
/// Example: `loom::GeneratorLoaderOptions{.num_devices = 8, .assignment = loom::Assignment::round_robin()}`.
/// Units: prefetch_depth in batches per device; num_workers in threads; count_unread_limit in
///        samples per generator.
/// Host memory: at most prefetch_depth batches per device exist inside the loader (samples
/// being gathered, or collated batches), plus the step the consumer holds; with DefaultCollate
/// their buffers are pooled and reused, prefetch_depth + 2 kept per device.
/// Threads: I/O-bound generators (sleeps, reads) want one worker per generator (the default), so
/// the generators of one device are pulled at the same time; CPU-bound ones want about one per core.
/// Throws (from the loader's constructor): loom::InvalidArgument naming the value for
/// num_devices < 1 (GeneratorLoader) or != 1 (RankGeneratorLoader), prefetch_depth < 1,
/// num_workers < 0, count_unread_limit < 1, or a resume state of another device or generator count.
struct GeneratorLoaderOptions {
  /// Devices this process feeds: GeneratorLoader's logical devices M (>= 1); RankGeneratorLoader:
  /// 1 (a rank feeds its own device; the world size is the number of devices).
  int num_devices = 1;
  Assignment assignment = Assignment::contiguous();  ///< which generators feed which device (rank)
  int prefetch_depth = 2;                            ///< batches per device built ahead (>= 1)
  int num_workers =
      0;  ///< threads pulling this process's generators; 0 = one per generator; generator g -> worker g % W
  EndPolicy end = EndPolicy::stop_at_shortest;  ///< unequal lengths (per-rank mode: decided over all ranks)
  /// stop_at_shortest: after the end, read the other generators on (dropping the samples) to
  /// count their unread samples exactly; report() waits for it. Off by default: a generator may
  /// be endless, and reading it cannot be cut short without losing the count.
  bool count_unread = false;
  /// With count_unread: read at most this many samples per generator after the end (> 0); a
  /// generator that has not ended by then gets a lower bound (GeneratorReport::unread_exact false).
  std::int64_t count_unread_limit = kDefaultCountUnreadLimit;
  GeneratorLoaderState resume = {};  ///< start from a saved state (default: the beginning)
};

}  // namespace loom
