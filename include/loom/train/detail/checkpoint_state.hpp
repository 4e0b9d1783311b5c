// loom/train/detail/checkpoint_state.hpp — the parts of a checkpoint beyond tensors and counters:
// every parameter group's options (LibTorch before 2.4 does not restore them from the optimizer's
// own archive), and the loader's plan options by name (so a resume refused for another plan names
// the option that changed and both values). Both are staged: read and checked first, applied later.
#pragma once

#include <concepts>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <memory>
#include <string>
#include <typeinfo>
#include <utility>
#include <vector>

#include <c10/util/Type.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/optimizer.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <loom/accumulate/loss_scaler.hpp>
#include <loom/error.hpp>
#include <loom/reduce/parameters.hpp>
#include <loom/sample/global_batch.hpp>
#include <loom/train/detail/checkpoint_file.hpp>
#include <loom/train/options.hpp>

namespace loom::detail {

/// The dynamic type of a parameter group's options, e.g. "torch::optim::SGDOptions".
inline std::string options_type(const torch::optim::OptimizerOptions& o) {
  return c10::demangle(typeid(o).name());
}

/// Writes every parameter group's options through their own serialize() (param_group_count,
/// param_group_<i>_type, param_group_<i>_size, param_group_<i>_options); an optimizer that is no
/// torch::optim::Optimizer writes a count of 0 (its own save() holds what it has).
/// Throws: loom::InvalidArgument naming the group and the options type when the type cannot
///         serialize itself (a torch::optim::OptimizerOptions without serialize(OutputArchive&)).
template <class Opt>
void write_param_groups(torch::serialize::OutputArchive& archive, const Opt& optimizer) {
  if constexpr (std::derived_from<Opt, torch::optim::Optimizer>) {
    const auto& groups = optimizer.param_groups();
    archive.write("param_group_count", c10::IValue(static_cast<int64_t>(groups.size())));
    for (std::size_t i = 0; i < groups.size(); ++i) {
      const torch::optim::OptimizerOptions& o = groups[i].options();
      torch::serialize::OutputArchive options(archive.compilation_unit());
      try {
        o.serialize(options);
      } catch (const std::exception& e) {
        throw InvalidArgument(fmt::format(
            "parameter group {}'s options ({}) cannot be stored: the options type must implement "
            "serialize(torch::serialize::OutputArchive&) and serialize(torch::serialize::InputArchive&), as "
            "torch::optim's own options do: {}",
            i, options_type(o), first_line(e.what())));
      }
      archive.write(fmt::format("param_group_{}_type", i), c10::IValue(options_type(o)));
      archive.write(fmt::format("param_group_{}_size", i),
                    c10::IValue(static_cast<int64_t>(groups[i].params().size())));
      archive.write(fmt::format("param_group_{}_options", i), options);
    }
  } else {
    archive.write("param_group_count", c10::IValue(int64_t{0}));
  }
}

/// A checkpoint's parameter group options, checked against the optimizer (group count, options
/// type, parameters per group) and read into copies of the optimizer's options; apply() reads them
/// into the optimizer's own options objects (references to them stay valid).
template <class Opt>
class StagedParamGroups {
 public:
  StagedParamGroups(CheckpointReader& read, Opt& optimizer) {
    if constexpr (std::derived_from<Opt, torch::optim::Optimizer>) {
      const int64_t count = read.integer("param_group_count");
      auto& groups = optimizer.param_groups();
      const std::string& file = read.file().string();
      if (count != static_cast<int64_t>(groups.size()))
        throw InvalidArgument(
            fmt::format("load_checkpoint: {} holds {} parameter groups of the optimizer, but this optimizer has {}",
                        file, count, groups.size()));
      for (std::size_t i = 0; i < groups.size(); ++i) {
        torch::optim::OptimizerOptions& mine = groups[i].options();
        const std::string type = read.text(fmt::format("param_group_{}_type", i));
        if (type != options_type(mine))
          throw InvalidArgument(fmt::format(
              "load_checkpoint: {}: parameter group {}'s options are {} there but {} in this optimizer (another "
              "optimizer type)",
              file, i, type, options_type(mine)));
        const int64_t size = read.integer(fmt::format("param_group_{}_size", i));
        if (size != static_cast<int64_t>(groups[i].params().size()))
          throw InvalidArgument(
              fmt::format("load_checkpoint: {}: parameter group {} holds {} parameters there but {} in this optimizer",
                          file, i, size, groups[i].params().size()));
        torch::serialize::InputArchive options;
        read.archive(fmt::format("param_group_{}_options", i), options);
        try {
          std::unique_ptr<torch::optim::OptimizerOptions> copy = mine.clone();
          copy->serialize(options);
        } catch (const std::exception& e) {
          throw DataError(fmt::format("load_checkpoint: {}: parameter group {}'s options ({}) cannot be read: {}", file,
                                      i, type, first_line(e.what())));
        }
        archives_.push_back(std::move(options));
      }
    }
  }

  /// Sets every group's options to the checkpoint's.
  void apply(Opt& optimizer) {
    if constexpr (std::derived_from<Opt, torch::optim::Optimizer>) {
      auto& groups = optimizer.param_groups();
      for (std::size_t i = 0; i < archives_.size(); ++i) groups[i].options().serialize(archives_[i]);
    }
  }

 private:
  std::vector<torch::serialize::InputArchive> archives_;
};

/// The model and the optimizer under a checkpoint's keys: param_<i> / param_name_<i> / buffer_<i>,
/// the parameter groups' options, and the optimizer's own archive ("optimizer").
template <class Opt>
void write_model_and_optimizer(torch::serialize::OutputArchive& archive, const ParameterList& list, Opt& optimizer) {
  write_parameters(archive, list);
  write_param_groups(archive, optimizer);
  torch::serialize::OutputArchive own;
  optimizer.save(own);
  archive.write("optimizer", own);
}

/// A Trainer's state under a checkpoint's keys: trainer_steps, trainer_skipped_steps, loss_scaler
/// (when it scales the loss), grid_exponents (when deterministic; comma-separated).
inline void write_trainer_state(torch::serialize::OutputArchive& archive, const TrainerState& state) {
  archive.write("trainer_steps", c10::IValue(state.steps));
  archive.write("trainer_skipped_steps", c10::IValue(state.skipped_steps));
  if (state.loss_scaler) archive.write("loss_scaler", c10::IValue(to_string(*state.loss_scaler)));
  if (!state.grid_exponents.empty())
    archive.write("grid_exponents", c10::IValue(fmt::format("{}", fmt::join(state.grid_exponents, ","))));
}

/// What write_trainer_state wrote. Throws: loom::DataError naming the file and the key.
inline TrainerState read_trainer_state(CheckpointReader& read) {
  TrainerState state;
  state.steps = read.integer("trainer_steps");
  state.skipped_steps = read.integer("trainer_skipped_steps");
  if (auto scaler = read.optional_text("loss_scaler")) state.loss_scaler = parse_loss_scaler_state(*scaler);
  if (auto grid = read.optional_text("grid_exponents")) state.grid_exponents = parse_grid_exponents(read.file(), *grid);
  return state;
}

/// The loader's plan options by name (plan_field_count, plan_name_<i>, plan_value_<i>; plan_fields).
inline void write_plan_fields(torch::serialize::OutputArchive& archive, const GlobalBatchSampler& sampler) {
  const auto fields = plan_fields(sampler.shapes(), sampler.options());
  archive.write("plan_field_count", c10::IValue(static_cast<int64_t>(fields.size())));
  for (std::size_t i = 0; i < fields.size(); ++i) {
    archive.write(fmt::format("plan_name_{}", i), c10::IValue(fields[i].first));
    archive.write(fmt::format("plan_value_{}", i), c10::IValue(fields[i].second));
  }
}

/// When `cursor` (the checkpoint's) has another fingerprint than `sampler`, names every plan field
/// that differs with both values.
/// Throws: loom::InvalidArgument naming the file and the fields (none found: the sampler's own
///         check_resume error follows); loom::DataError for a missing key.
inline void check_plan_fields(CheckpointReader& read, const GlobalBatchSampler& sampler, const GlobalCursor& cursor) {
  if (cursor.seed != sampler.options().seed || cursor.fingerprint == sampler.cursor().fingerprint) return;
  const auto mine = plan_fields(sampler.shapes(), sampler.options());
  const int64_t count = read.integer("plan_field_count");
  std::vector<std::string> differences;
  for (int64_t i = 0; i < count; ++i) {
    const std::string name = read.text(fmt::format("plan_name_{}", i));
    const std::string value = read.text(fmt::format("plan_value_{}", i));
    for (const auto& [my_name, my_value] : mine) {
      if (my_name != name || my_value == value) continue;
      differences.push_back(name == "shapes"
                                ? fmt::format("the shapes differ (FNV-1a {} there, {} here)", value, my_value)
                                : fmt::format("{} = {} there, {} here", name, value, my_value));
    }
  }
  if (!differences.empty())
    throw InvalidArgument(fmt::format(
        "load_checkpoint: {}: this loader plans other steps than the run that saved it: {} (a resume needs the "
        "batching options and the samples' shapes, in order, of that run)",
        read.file().string(), fmt::join(differences, "; ")));
}

}  // namespace loom::detail
