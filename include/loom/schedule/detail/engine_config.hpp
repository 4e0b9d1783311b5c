// loom/schedule/detail/engine_config.hpp — what LoaderEngine is told (EngineConfig), built from the
// options both generator loaders share, and the checks of those options.
//
// Units: depth in batches per device; count_limit in samples per generator.
// Errors: check_options throws loom::InvalidArgument naming the loader and the bad value.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include <loom/error.hpp>
#include <loom/schedule/options.hpp>

namespace loom::detail {

/// Everything the engine needs besides the generators.
struct EngineConfig {
  std::vector<std::vector<int>> device_generators{};  ///< per core device slot, global generator ids
  std::vector<int> device_labels{};                   ///< per slot, the device index shown to users
  int depth = 2;                                      ///< batches per device inside the core
  int workers = 0;                                    ///< threads; 0 = one per generator
  EndPolicy end = EndPolicy::stop_at_shortest;
  bool count_unread = false;
  std::int64_t count_limit = kDefaultCountUnreadLimit;  ///< count_unread: samples read per generator at most
  std::int64_t start_step = 0;
  std::vector<std::int64_t> skip{};  ///< per global generator id: samples to skip first
};

/// Validates the options both loaders share; throws loom::InvalidArgument naming `who` and the
/// bad value. `num_devices` is the device count of the loading (per-rank mode: the world size),
/// which a resume state must have been taken with.
inline void check_options(const GeneratorLoaderOptions& o, int num_generators, int num_devices, const char* who) {
  if (o.prefetch_depth < 1)
    throw InvalidArgument(
        fmt::format("{}: prefetch_depth is {}, must be >= 1 (batches per device)", who, o.prefetch_depth));
  if (o.num_workers < 0)
    throw InvalidArgument(
        fmt::format("{}: num_workers is {}, must be >= 0 (0 = one per generator)", who, o.num_workers));
  if (o.count_unread_limit < 1)
    throw InvalidArgument(
        fmt::format("{}: count_unread_limit is {}, must be >= 1 (samples per generator)", who, o.count_unread_limit));
  const GeneratorLoaderState& resume = o.resume;
  if (resume.num_devices == 0 && resume.steps == 0 && resume.samples.empty()) return;
  if (resume.num_devices != num_devices)
    throw InvalidArgument(fmt::format("{}: the resume state was taken with {} devices, this loader has {}", who,
                                      resume.num_devices, num_devices));
  if (static_cast<int>(resume.samples.size()) != num_generators)
    throw InvalidArgument(fmt::format("{}: the resume state has {} generators, this loader has {}", who,
                                      resume.samples.size(), num_generators));
  if (resume.steps < 0) throw InvalidArgument(fmt::format("{}: the resume state has steps = {}", who, resume.steps));
  for (std::size_t g = 0; g < resume.samples.size(); ++g)
    if (resume.samples[g] < 0)
      throw InvalidArgument(fmt::format("{}: the resume state has samples[{}] = {}", who, g, resume.samples[g]));
}

/// The engine's configuration for devices (slots) `device_generators`, shown to users as `labels`.
inline EngineConfig engine_config(const GeneratorLoaderOptions& o, std::vector<std::vector<int>> device_generators,
                                  std::vector<int> labels) {
  EngineConfig cfg;
  cfg.device_generators = std::move(device_generators);
  cfg.device_labels = std::move(labels);
  cfg.depth = o.prefetch_depth;
  cfg.workers = o.num_workers;
  cfg.end = o.end;
  cfg.count_unread = o.count_unread;
  cfg.count_limit = o.count_unread_limit;
  cfg.start_step = o.resume.steps;
  cfg.skip = o.resume.samples;
  return cfg;
}

}  // namespace loom::detail
