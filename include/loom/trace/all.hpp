// loom/trace/all.hpp — the flight recorder: what each rank's communicator issued, its record
// files, and the verdict that names the first rank that went its own way (docs/debugging.md).
#pragma once

#include <loom/trace/record.hpp>
#include <loom/trace/record_file.hpp>
#include <loom/trace/recorder.hpp>
#include <loom/trace/verdict.hpp>
