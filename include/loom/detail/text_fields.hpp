// loom/detail/text_fields.hpp — the one reader of loom's one-line state texts, the lines a user
// saves in a checkpoint and hands back: "loom-global-cursor v1 seed=7 epoch=2 step=13 fingerprint=9",
// "loom-sampler v1 ...", "loom-loss-scaler v1 scale=0x1p+9 good_steps=37".
//
// Example:
//   loom::detail::TextFields f(text, "loom-loss-scaler v1", "loss scaler state");
//   double scale = f.hex_double("scale");
//   auto good = f.integer<std::int64_t>("good_steps");
//   f.finish();                                        // nothing but spaces / newlines may follow
//
// Grammar: the prefix, then each field as `name=value` in the order read, one or more spaces before
//   each; then only spaces and newlines (a checkpoint line read with its '\n'). Integers are what
//   std::from_chars reads in base 10: an optional '-' (signed types only; an unsigned field refuses
//   "-1" instead of wrapping it to 2^64 - 1), digits, no '+', no spaces, in range of the type.
//   Doubles: hexadecimal floating point as {:a} prints it ("0x1.8p+3", "-0x1p-2"; exact), the
//   binary exponent required.
// Throws: loom::InvalidArgument "<what> '<text>' is malformed: <why>" — the text quoted, cut at 120
//   characters, bytes outside printable ASCII written as \xNN.
// Source: the strict field reading of std::from_chars (no locale, no whitespace skipping), unlike
//   sscanf, whose %llu accepts "-1" and whose overflow is undefined.
#pragma once

#include <algorithm>
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>

#include <fmt/format.h>

#include <loom/error.hpp>

namespace loom::detail {

/// `text` quoted for an error message: at most `limit` characters, non-printable bytes as \xNN.
inline std::string quoted_text(std::string_view text, std::size_t limit = 120) {
  std::string out;
  for (std::size_t i = 0; i < text.size() && i < limit; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f)
      out += static_cast<char>(c);
    else
      out += fmt::format("\\x{:02x}", c);
  }
  if (text.size() > limit) out += fmt::format("... ({} bytes)", text.size());
  return out;
}

/// Reads one state line field by field. See the file comment.
class TextFields {
 public:
  /// Checks that `text` starts with `prefix`. `what` names the text in errors ("global cursor").
  /// Throws: loom::InvalidArgument when it does not.
  TextFields(std::string_view text, std::string_view prefix, std::string_view what)
      : text_(text), rest_(text), what_(what) {
    if (rest_.substr(0, prefix.size()) != prefix) throw fail(fmt::format("it must start with '{}'", prefix));
    rest_.remove_prefix(prefix.size());
  }

  /// The next field, `name=<integer>`. Throws: loom::InvalidArgument (missing, not a number, out of range).
  template <class T>
  requires std::is_integral_v<T> T integer(std::string_view name) {
    take_name(name);
    T value{};
    const auto [ptr, ec] = std::from_chars(rest_.data(), rest_.data() + rest_.size(), value);
    if (ec == std::errc::result_out_of_range) throw fail(fmt::format("field '{}' is out of range", name));
    if (ec != std::errc())
      throw fail(
          fmt::format("field '{}' is not a number{}", name, std::is_signed_v<T> ? "" : " (digits only, no sign)"));
    rest_.remove_prefix(static_cast<std::size_t>(ptr - rest_.data()));
    return value;
  }

  /// The next field, `name=<hexadecimal floating point>`: [-]0x<hex digits>[.<hex digits>]p[+|-]<digits>,
  /// {:a}'s form. Checked before std::from_chars reads it: libstdc++'s accepts "0x1p+-9" as 2^-9,
  /// and "0x1" without an exponent.
  /// Throws: loom::InvalidArgument (missing, not of that form, out of range).
  double hex_double(std::string_view name) {
    take_name(name);
    const std::string_view token = rest_.substr(0, std::min(rest_.find_first_of(" \n"), rest_.size()));
    if (!hex_float_form(token))
      throw fail(fmt::format("field '{}' is not a hexadecimal float as {{:a}} writes it ([-]0x1.8p+3)", name));
    const bool negative = token.front() == '-';
    const std::string_view digits = token.substr(negative ? 3 : 2);
    double value = 0;
    const auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), value, std::chars_format::hex);
    if (ec != std::errc() || ptr != digits.data() + digits.size())
      throw fail(fmt::format("field '{}' is out of range", name));
    rest_.remove_prefix(token.size());
    return negative ? -value : value;
  }

  /// Nothing but spaces and newlines may remain. Throws: loom::InvalidArgument.
  void finish() const {
    if (rest_.find_first_not_of(" \n") != std::string_view::npos) throw fail("unexpected text at the end");
  }

  /// An InvalidArgument "<what> '<text>' is malformed: <why>", for checks of the values read.
  [[nodiscard]] InvalidArgument fail(std::string_view why) const {
    return InvalidArgument(fmt::format("{} '{}' is malformed: {}", what_, quoted_text(text_), why));
  }

 private:
  void take_name(std::string_view name) {
    const std::size_t spaces = rest_.find_first_not_of(' ');
    if (spaces == 0 || spaces == std::string_view::npos) throw fail(fmt::format("expected ' {}='", name));
    rest_.remove_prefix(spaces);
    if (rest_.substr(0, name.size()) != name || rest_.size() <= name.size() || rest_[name.size()] != '=')
      throw fail(fmt::format("expected field '{}'", name));
    rest_.remove_prefix(name.size() + 1);
  }

  static bool hex_float_form(std::string_view t) {
    const auto run = [&t](std::string_view allowed) {  // length of the leading run of `allowed` in t
      const std::size_t n = std::min(t.find_first_not_of(allowed), t.size());
      t.remove_prefix(n);
      return n;
    };
    constexpr std::string_view kHex = "0123456789abcdefABCDEF", kDigits = "0123456789";
    if (!t.empty() && t.front() == '-') t.remove_prefix(1);
    if (t.substr(0, 2) != "0x") return false;
    t.remove_prefix(2);
    if (run(kHex) == 0) return false;
    if (!t.empty() && t.front() == '.') {
      t.remove_prefix(1);
      if (run(kHex) == 0) return false;
    }
    if (t.empty() || t.front() != 'p') return false;
    t.remove_prefix(1);
    if (!t.empty() && (t.front() == '+' || t.front() == '-')) t.remove_prefix(1);
    return run(kDigits) > 0 && t.empty();
  }

  std::string_view text_;
  std::string_view rest_;
  std::string_view what_;
};

}  // namespace loom::detail
