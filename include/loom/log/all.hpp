// loom/log/all.hpp — everything of loom's logging folder: sinks, rank policies, the Logger,
// main_process_first, weighted metrics over ranks, and global progress.
//
// Example:
//   #include <loom/log/all.hpp>
//   loom::Logger log{loom::StreamSink{}, loom::rank_info(loom::Environment::from_env())};
//   log.info("hello from the job's rank 0");
// Guide: docs/log.md.
#pragma once

#include <loom/log/logger.hpp>
#include <loom/log/main_process_first.hpp>
#include <loom/log/metrics.hpp>
#include <loom/log/named_metrics.hpp>
#include <loom/log/progress.hpp>
#include <loom/log/rank.hpp>
#include <loom/log/sink.hpp>
