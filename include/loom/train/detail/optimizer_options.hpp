// loom/train/detail/optimizer_options.hpp — the options of every parameter group of a
// torch::optim optimizer as (group, name, value) rows: what the Trainer's replica check compares
// across ranks (loom/train/detail/replica_check.hpp).
//
// Example:
//   torch::optim::SGD sgd(params, torch::optim::SGDOptions(0.1).momentum(0.9));
//   auto rows = loom::detail::optimizer_option_values(sgd);
//   // {0, "lr", 0.1}, {0, "momentum", 0.9}, {0, "dampening", 0}, {0, "weight_decay", 0}, {0, "nesterov", 0}
// Covers SGD, Adam, AdamW, RMSprop, Adagrad and LBFGS options; any other options type gives its
// learning rate (OptimizerOptions::get_lr) under the name "lr", or nothing when the type does not
// implement get_lr. An optimizer without param_groups()
// (loom::StepFunctions) has no rows.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <typeindex>
#include <typeinfo>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <loom/train/options.hpp>

namespace loom::detail {

/// One option of one parameter group (booleans as 0 / 1).
struct OptionValue {
  std::int64_t group = 0;
  const char* name = "";
  double value = 0;
};

/// Whether an options type of the user's implements OptimizerOptions::get_lr (the base throws): tried
/// once per type, remembered.
inline bool has_lr(const torch::optim::OptimizerOptions& o) {
  static std::mutex mutex;
  static std::map<std::type_index, bool> known;
  const std::type_index type(typeid(o));
  {
    std::lock_guard lock(mutex);
    if (auto it = known.find(type); it != known.end()) return it->second;
  }
  bool ok = true;
  try {
    (void)o.get_lr();
  } catch (const c10::Error&) {
    ok = false;
  }
  std::lock_guard lock(mutex);
  known[type] = ok;
  return ok;
}

/// The options of one parameter group, appended to `out`.
inline void append_group_options(std::int64_t g, const torch::optim::OptimizerOptions& o,
                                 std::vector<OptionValue>& out) {
  auto add = [&](const char* name, double v) { out.push_back({g, name, v}); };
  auto add_adam = [&](const auto& a) {  // AdamOptions and AdamWOptions name the same options
    add("lr", a.lr());
    add("beta1", std::get<0>(a.betas()));
    add("beta2", std::get<1>(a.betas()));
    add("eps", a.eps());
    add("weight_decay", a.weight_decay());
    add("amsgrad", a.amsgrad() ? 1 : 0);
  };
  if (const auto* s = dynamic_cast<const torch::optim::SGDOptions*>(&o)) {
    add("lr", s->lr());
    add("momentum", s->momentum());
    add("dampening", s->dampening());
    add("weight_decay", s->weight_decay());
    add("nesterov", s->nesterov() ? 1 : 0);
  } else if (const auto* a = dynamic_cast<const torch::optim::AdamOptions*>(&o)) {
    add_adam(*a);
  } else if (const auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(&o)) {
    add_adam(*w);
  } else if (const auto* r = dynamic_cast<const torch::optim::RMSpropOptions*>(&o)) {
    add("lr", r->lr());
    add("alpha", r->alpha());
    add("eps", r->eps());
    add("weight_decay", r->weight_decay());
    add("momentum", r->momentum());
    add("centered", r->centered() ? 1 : 0);
  } else if (const auto* ad = dynamic_cast<const torch::optim::AdagradOptions*>(&o)) {
    add("lr", ad->lr());
    add("lr_decay", ad->lr_decay());
    add("weight_decay", ad->weight_decay());
    add("initial_accumulator_value", ad->initial_accumulator_value());
    add("eps", ad->eps());
  } else if (const auto* l = dynamic_cast<const torch::optim::LBFGSOptions*>(&o)) {
    add("lr", l->lr());
    add("max_iter", static_cast<double>(l->max_iter()));
    add("tolerance_grad", l->tolerance_grad());
    add("tolerance_change", l->tolerance_change());
    add("history_size", static_cast<double>(l->history_size()));
  } else if (has_lr(o)) {
    add("lr", o.get_lr());
  }
}

/// Every parameter group's options, group by group (empty without param_groups()).
template <class Opt>
std::vector<OptionValue> optimizer_option_values(Opt& optimizer) {
  std::vector<OptionValue> out;
  if constexpr (HasParamGroups<Opt>) {
    std::int64_t g = 0;
    for (const auto& group : optimizer.param_groups()) {
      if (group.has_options()) append_group_options(g, group.options(), out);
      ++g;
    }
  }
  return out;
}

}  // namespace loom::detail
