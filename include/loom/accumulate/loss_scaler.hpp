// loom/accumulate/loss_scaler.hpp — LossScaler: dynamic loss scaling for low-precision training.
//
// One sentence: multiply each micro-batch's loss by scale() before backward, unscale the reduced
// gradient once per step (loom::Accumulator does it inside the reduction), and call
// update(found_non_finite) once per step: the scale halves after an overflow and doubles after
// growth_interval clean steps.
//
// Example:
//   loom::LossScaler scaler({.init_scale = 1024});
//   scaler.scale(loss).backward();           // loss * 1024
//   scaler.update(/*found_non_finite=*/true); // scale() == 512
//
// Resume: state() / load_state() (LossScalerState, one line of text with to_string) belong in every
//   checkpoint of a run that scales its loss.
// Units: the scale is a pure factor; growth_interval counts optimizer steps.
// Throws: loom::InvalidArgument for options outside their ranges (named with the value).
// Source: torch.cuda.amp.GradScaler (init 2^16, growth 2, backoff 0.5, interval 2000).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>
#include <string_view>

#include <ATen/ATen.h>
#include <fmt/format.h>

#include <loom/detail/text_fields.hpp>
#include <loom/error.hpp>

namespace loom {

/// Options of LossScaler; use with designated initializers.
///
/// Example: `loom::LossScalerOptions{.init_scale = 1024, .growth_interval = 100}`.
/// Units: factors are pure numbers; growth_interval in optimizer steps.
struct LossScalerOptions {
  double init_scale = 65536.0;          ///< first scale (> 0)
  double growth_factor = 2.0;           ///< applied after growth_interval finite steps (>= 1)
  double backoff_factor = 0.5;          ///< applied once per skipped (non-finite) step, in (0, 1]
  std::int64_t growth_interval = 2000;  ///< finite steps between growths (>= 1)
};

/// What a resumed run needs of a LossScaler: the scale and the finite steps since the last change.
/// Part of a checkpoint: without it a resumed run restarts at init_scale and skips steps the
/// uninterrupted run did not.
///
/// Example: `loom::to_string(s)` -> "loom-loss-scaler v1 scale=512 good_steps=37".
struct LossScalerState {
  double scale = 65536.0;
  std::int64_t good_steps = 0;

  friend bool operator==(const LossScalerState&, const LossScalerState&) = default;
};

/// One line of text for a LossScalerState (for a checkpoint file); the scale is written exactly
/// (hexadecimal floating point).
inline std::string to_string(const LossScalerState& s) {
  return fmt::format("loom-loss-scaler v1 scale={:a} good_steps={}", s.scale, s.good_steps);
}

/// Parses the text of to_string(LossScalerState) (a trailing newline allowed; the grammar is
/// detail::TextFields'). Throws loom::InvalidArgument quoting the text: malformed, a scale that is
/// not finite and > 0, or a negative good_steps.
inline LossScalerState parse_loss_scaler_state(std::string_view text) {
  detail::TextFields f(text, "loom-loss-scaler v1", "loss scaler state");
  LossScalerState s;
  s.scale = f.hex_double("scale");
  s.good_steps = f.integer<std::int64_t>("good_steps");
  f.finish();
  if (!std::isfinite(s.scale) || !(s.scale > 0)) throw f.fail(fmt::format("scale {} must be finite and > 0", s.scale));
  if (s.good_steps < 0) throw f.fail(fmt::format("good_steps {} must be >= 0", s.good_steps));
  return s;
}

/// Dynamic loss scale. See the file comment.
///
/// Example: see the file comment.
/// Throws: loom::InvalidArgument from the constructor.
/// Source: torch.cuda.amp.GradScaler.
class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {}) : options_(options), scale_(options.init_scale) {
    if (!(options_.init_scale > 0) || !std::isfinite(options_.init_scale))
      throw InvalidArgument(fmt::format("LossScaler: init_scale = {} (must be finite and > 0)", options_.init_scale));
    if (!(options_.growth_factor >= 1))
      throw InvalidArgument(fmt::format("LossScaler: growth_factor = {} (must be >= 1)", options_.growth_factor));
    if (!(options_.backoff_factor > 0 && options_.backoff_factor <= 1))
      throw InvalidArgument(
          fmt::format("LossScaler: backoff_factor = {} (must be in (0, 1])", options_.backoff_factor));
    if (options_.growth_interval < 1)
      throw InvalidArgument(fmt::format("LossScaler: growth_interval = {} (must be >= 1)", options_.growth_interval));
  }

  /// The current scale.
  [[nodiscard]] double scale() const noexcept { return scale_; }

  /// `loss * scale()`. Shape: any. Dtype: float16 and bfloat16 losses are promoted to float32
  /// first (as GradScaler's float32 scale tensor promotes them), so a loss above ~1 times 65536
  /// does not overflow float16; float32 and float64 losses keep their dtype.
  [[nodiscard]] at::Tensor scale(const at::Tensor& loss) const {
    if (loss.scalar_type() == at::kHalf || loss.scalar_type() == at::kBFloat16) return loss.to(at::kFloat) * scale_;
    return loss * scale_;
  }

  /// Once per optimizer step: back off after a non-finite step, grow after growth_interval finite ones.
  void update(bool found_non_finite) noexcept {
    if (found_non_finite) {
      scale_ *= options_.backoff_factor;
      good_steps_ = 0;
    } else if (++good_steps_ >= options_.growth_interval) {
      scale_ *= options_.growth_factor;
      good_steps_ = 0;
    }
  }

  /// Finite steps since the last growth or backoff.
  [[nodiscard]] std::int64_t good_steps() const noexcept { return good_steps_; }

  /// The state a resumed run needs (see LossScalerState).
  [[nodiscard]] LossScalerState state() const noexcept { return {.scale = scale_, .good_steps = good_steps_}; }

  /// Continues from a saved state. Throws: loom::InvalidArgument for a scale that is not finite and
  /// > 0, or good_steps outside [0, growth_interval).
  void load_state(const LossScalerState& s) {
    if (!(s.scale > 0) || !std::isfinite(s.scale))
      throw InvalidArgument(fmt::format("LossScaler::load_state: scale = {} (must be finite and > 0)", s.scale));
    if (s.good_steps < 0 || s.good_steps >= options_.growth_interval)
      throw InvalidArgument(fmt::format("LossScaler::load_state: good_steps = {} (must be in [0, {}))", s.good_steps,
                                        options_.growth_interval));
    scale_ = s.scale;
    good_steps_ = s.good_steps;
  }
  [[nodiscard]] const LossScalerOptions& options() const noexcept { return options_; }

 private:
  LossScalerOptions options_;
  double scale_;
  std::int64_t good_steps_ = 0;
};

}  // namespace loom
