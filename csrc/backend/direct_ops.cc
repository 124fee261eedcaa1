#include "backend/direct_ops.h"

#include <mutex>
#include <shared_mutex>
#include <unordered_map>

#include <torch/library.h>

#include "backend/process_group_torus.h"
#include "backend/tensor_checks.h"

namespace torus {

// A registered group; `group` is null once it is destroyed. Op calls hold `mutex` shared while
// they run on the group, its destruction holds it exclusively.
struct DirectEntry {
  std::shared_mutex mutex;
  ProcessGroupTorus* group;
};

namespace {

std::mutex registryMutex;
// Weak: an entry goes with its group's registration.
std::unordered_map<std::string, std::weak_ptr<DirectEntry>>& registry() {
  static std::unordered_map<std::string, std::weak_ptr<DirectEntry>> groups;
  return groups;
}

std::shared_ptr<DirectEntry> entryNamed(const std::string& name) {
  std::shared_ptr<DirectEntry> entry;
  {
    std::lock_guard<std::mutex> lock(registryMutex);
    auto found = registry().find(name);
    if (found != registry().end()) {
      entry = found->second.lock();
    }
  }
  TORUS_CHECK_ARG(entry, "torch.ops.torus: group_name '", name,
                  "' names no live torus process group (pass group.group_name of a group created with "
                  "backend=\"torus\")");
  return entry;
}

c10d::ReduceOp reduceOpNamed(c10::string_view name) {
  static const std::pair<const char*, c10d::ReduceOp::RedOpType> ops[] = {
      {"sum", c10d::ReduceOp::SUM}, {"avg", c10d::ReduceOp::AVG},   {"product", c10d::ReduceOp::PRODUCT},
      {"min", c10d::ReduceOp::MIN}, {"max", c10d::ReduceOp::MAX},   {"band", c10d::ReduceOp::BAND},
      {"bor", c10d::ReduceOp::BOR}, {"bxor", c10d::ReduceOp::BXOR}};
  for (const auto& [known, op] : ops) {
    if (name == known) {
      return c10d::ReduceOp(op);
    }
  }
  TORUS_CHECK_ARG(false, "torch.ops.torus.all_reduce_: reduce_op '", std::string(name),
                  "' is not one of sum, avg, product, min, max, band, bor, bxor");
  return {};
}

void allReduceInPlace(at::Tensor tensor, c10::string_view groupName, c10::string_view reduceOp) {
  const c10d::ReduceOp op = reduceOpNamed(reduceOp);
  const std::string name(groupName);
  std::shared_ptr<DirectEntry> entry = entryNamed(name);
  std::shared_lock<std::shared_mutex> alive(entry->mutex);
  TORUS_CHECK_ARG(entry->group != nullptr, "torch.ops.torus: the torus process group '", name,
                  "' has been destroyed");
  entry->group->allreduceHere(tensor, op);
}

// Under torch.compile's fake tensors: nothing to compute, the tensor keeps its shape.
void allReduceInPlaceMeta(at::Tensor, c10::string_view, c10::string_view) {}

} // namespace

DirectRegistration::DirectRegistration(const std::string& name, ProcessGroupTorus* group)
    : entry_(std::make_shared<DirectEntry>()) {
  entry_->group = group;
  std::lock_guard<std::mutex> lock(registryMutex);
  auto& groups = registry();
  for (auto it = groups.begin(); it != groups.end();) {
    it = it->second.expired() ? groups.erase(it) : std::next(it);
  }
  groups.insert_or_assign(name, entry_);
}

DirectRegistration::~DirectRegistration() {
  std::unique_lock<std::shared_mutex> lock(entry_->mutex);
  entry_->group = nullptr;
}

} // namespace torus

TORCH_LIBRARY(torus, m) {
  m.def("all_reduce_(Tensor(a!) tensor, str group_name, str reduce_op=\"sum\") -> ()");
}

TORCH_LIBRARY_IMPL(torus, CPU, m) {
  m.impl("all_reduce_", torus::allReduceInPlace);
}

TORCH_LIBRARY_IMPL(torus, Meta, m) {
  m.impl("all_reduce_", torus::allReduceInPlaceMeta);
}
