// libFuzzer target for everything loom reads from text a user hands in: the state lines of a
// checkpoint (global cursor, sampler state, loss scaler state) and the launcher's environment
// variables (Environment::from_lookup, CUDA_VISIBLE_DEVICES).
//
// Input: byte 0 picks the reader (mod 4); the rest is its text. For the environment the text is
// NAME=VALUE lines.
// Contract checked (a violation traps, which libFuzzer reports as a crash):
//   - a reader either returns or throws a loom error (InvalidArgument / ConfigError); any other
//     exception escapes and is reported as a crash;
//   - a parsed state is one the library can use: epoch, step, position >= 0; 1 <= num_replicas,
//     0 <= rank < num_replicas; a finite scale > 0 and good_steps >= 0;
//   - it round-trips: parse(to_string(state)) == state;
//   - the text it accepted is well formed by an independent reading (well_formed below): the
//     prefix, then space-separated `name=value` tokens in the expected order, each value digits
//     with a '-' only where the field is signed (or {:a}'s 0x form for the scale), then only
//     spaces and newlines — so "seed=-1" is not read as 2^64 - 1, "epoch= 5" or "seed=7epoch=2"
//     are not read at all, and nothing after a NUL byte is ignored;
//   - an Environment is consistent: 0 <= rank < world_size, 0 <= local_rank < local_world_size,
//     0 <= node_rank < num_nodes.
// Build and run: scripts/fuzz.sh (clang's -fsanitize=fuzzer,address,undefined). Findings become
// cases of tests/sample/test_state_text.cpp.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <optional>
#include <string>
#include <string_view>

#include <loom/accumulate/loss_scaler.hpp>
#include <loom/error.hpp>
#include <loom/launch/environment.hpp>
#include <loom/launch/rank_device.hpp>
#include <loom/sample/concepts.hpp>
#include <loom/sample/global_batch.hpp>

namespace {

void require(bool ok) {
  if (!ok) __builtin_trap();
}

struct Field {
  std::string_view name;
  enum Kind { unsigned_integer, signed_integer, hex_float } kind;
};

bool digits(std::string_view v) {
  return !v.empty() && v.find_first_not_of("0123456789") == std::string_view::npos;
}

bool hex_float(std::string_view v) {  // [-]0x<hex digits>[.<hex digits>]p[+-]<digits>
  if (!v.empty() && v.front() == '-') v.remove_prefix(1);
  if (v.substr(0, 2) != "0x") return false;
  v.remove_prefix(2);
  const std::size_t p = v.find('p');
  if (p == std::string_view::npos) return false;
  std::string_view mantissa = v.substr(0, p), exponent = v.substr(p + 1);
  const std::size_t dot = mantissa.find('.');
  const auto hex = [](std::string_view h) {
    return !h.empty() && h.find_first_not_of("0123456789abcdefABCDEF") == std::string_view::npos;
  };
  if (!hex(mantissa.substr(0, dot)) || (dot != std::string_view::npos && !hex(mantissa.substr(dot + 1)))) return false;
  if (!exponent.empty() && (exponent.front() == '+' || exponent.front() == '-')) exponent.remove_prefix(1);
  return digits(exponent);
}

/// The independent reading of a state line (see the file comment).
bool well_formed(std::string_view text, std::string_view prefix, std::initializer_list<Field> fields) {
  if (text.substr(0, prefix.size()) != prefix) return false;
  text.remove_prefix(prefix.size());
  for (const Field& f : fields) {
    const std::size_t start = text.find_first_not_of(' ');
    if (start == 0 || start == std::string_view::npos) return false;
    text.remove_prefix(start);
    const std::size_t end = std::min(text.find_first_of(" \n"), text.size());
    const std::string_view token = text.substr(0, end);
    text.remove_prefix(end);
    if (token.substr(0, f.name.size()) != f.name || token.size() <= f.name.size() || token[f.name.size()] != '=')
      return false;
    std::string_view value = token.substr(f.name.size() + 1);
    if (f.kind == Field::hex_float) {
      if (!hex_float(value)) return false;
      continue;
    }
    if (f.kind == Field::signed_integer && !value.empty() && value.front() == '-') value.remove_prefix(1);
    if (!digits(value)) return false;
  }
  return text.find_first_not_of(" \n") == std::string_view::npos;
}

/// The contract for one state reader: `parse` returns or throws InvalidArgument; a result passes
/// `valid`, round-trips through to_string, and came from a well-formed text.
template <class Parse, class Valid>
void state(std::string_view text, Parse parse, Valid valid, std::string_view prefix,
           std::initializer_list<Field> fields) {
  decltype(parse(text)) value;
  try {
    value = parse(text);
  } catch (const loom::InvalidArgument&) {
    return;
  }
  require(valid(value));
  require(parse(loom::to_string(value)) == value);
  require(well_formed(text, prefix, fields));
}

void cursor(std::string_view text) {
  state(
      text, [](std::string_view t) { return loom::parse_global_cursor(t); },
      [](const loom::GlobalCursor& c) { return c.epoch >= 0 && c.step >= 0; }, "loom-global-cursor v1",
      {{"seed", Field::unsigned_integer},
       {"epoch", Field::signed_integer},
       {"step", Field::signed_integer},
       {"fingerprint", Field::unsigned_integer}});
}

void sampler(std::string_view text) {
  state(
      text, [](std::string_view t) { return loom::parse_sampler_state(t); },
      [](const loom::SamplerState& s) {
        return s.epoch >= 0 && s.position >= 0 && s.dataset_size >= 0 && s.num_replicas >= 1 && s.rank >= 0 &&
               s.rank < s.num_replicas;
      },
      "loom-sampler v1",
      {{"seed", Field::unsigned_integer},
       {"epoch", Field::signed_integer},
       {"position", Field::signed_integer},
       {"dataset_size", Field::signed_integer},
       {"num_replicas", Field::signed_integer},
       {"rank", Field::signed_integer},
       {"fingerprint", Field::unsigned_integer}});
}

void scaler(std::string_view text) {
  state(
      text, [](std::string_view t) { return loom::parse_loss_scaler_state(t); },
      [](const loom::LossScalerState& s) { return std::isfinite(s.scale) && s.scale > 0 && s.good_steps >= 0; },
      "loom-loss-scaler v1", {{"scale", Field::hex_float}, {"good_steps", Field::signed_integer}});
}

void environment(std::string_view text) {
  std::map<std::string, std::string, std::less<>> vars;
  while (!text.empty()) {
    const std::size_t end = text.find('\n');
    const std::string_view line = text.substr(0, end);
    if (const std::size_t eq = line.find('='); eq != std::string_view::npos)
      vars[std::string(line.substr(0, eq))] = std::string(line.substr(eq + 1));
    text.remove_prefix(end == std::string_view::npos ? text.size() : end + 1);
  }
  loom::Environment env;
  try {
    env = loom::Environment::from_lookup([&](std::string_view name) -> std::optional<std::string> {
      const auto it = vars.find(name);
      if (it == vars.end()) return std::nullopt;
      return it->second;
    });
  } catch (const loom::ConfigError&) {
    return;
  } catch (const loom::InvalidArgument&) {
    return;
  }
  require(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size);
  require(env.local_world_size >= 1 && env.local_rank >= 0 && env.local_rank < env.local_world_size);
  require(env.num_nodes >= 1 && env.node_rank >= 0 && env.node_rank < env.num_nodes);
  if (const auto it = vars.find("CUDA_VISIBLE_DEVICES"); it != vars.end())
    for (const std::string& entry : loom::parse_visible_devices(it->second))
      require(!entry.empty() && entry.front() != ' ' && entry.back() != ' ' && entry.find(',') == std::string::npos);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  switch (data[0] % 4) {
    case 0: cursor(text); break;
    case 1: sampler(text); break;
    case 2: scaler(text); break;
    default: environment(text); break;
  }
  return 0;
}
