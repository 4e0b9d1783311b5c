// loom/dist.hpp — launcher environments, rendezvous and spawn in one include.
//
// Example:
//   #include <loom/dist.hpp>
//   auto env = loom::Environment::from_env();
//   loom::spawn(2, [](const loom::Environment& e) { /* one rank */ });
//
// See docs/launching.md.
#pragma once

#include <loom/dist/environment.hpp>
#include <loom/dist/rendezvous.hpp>
#include <loom/dist/spawn.hpp>
