// torch.ops.torus: collectives as torch operators on a torus group named by its group name, for
// callers whose every microsecond counts (tensor-parallel inference on CPUs): no ProcessGroup
// dispatch and no Work, and traceable by torch.compile.
//
//   torch.ops.torus.all_reduce_(tensor, group.group_name, "sum")   # in place, returns nothing
#pragma once

#include <memory>
#include <string>

namespace torus {

class ProcessGroupTorus;
struct DirectEntry;

// A group's place among the groups torch.ops.torus reaches by name, for as long as it lives;
// its destruction waits for the op calls on the group in progress, and later calls name the
// group as gone.
class DirectRegistration {
 public:
  // Registers `group` under `name` (torch's group name); a later group of the name replaces it.
  DirectRegistration(const std::string& name, ProcessGroupTorus* group);
  ~DirectRegistration();
  DirectRegistration(const DirectRegistration&) = delete;
  DirectRegistration& operator=(const DirectRegistration&) = delete;

 private:
  std::shared_ptr<DirectEntry> entry_;
};

} // namespace torus
