// torch.ops.torus: collectives as torch operators on a torus group named by its group name, for
// callers whose every microsecond counts (tensor-parallel inference on CPUs): no ProcessGroup
// dispatch and no Work, and traceable by torch.compile.
//
//   torch.ops.torus.all_reduce_(tensor, group.group_name, "sum")   # in place, returns nothing
#pragma once

#include <string>

#include <c10/util/intrusive_ptr.h>

namespace torus {

class ProcessGroupTorus;

// Makes `group` reachable by torch.ops.torus under `name` (torch's group name) for as long as it
// lives; a later group of the same name replaces it.
void registerDirectGroup(const std::string& name, const c10::intrusive_ptr<ProcessGroupTorus>& group);

} // namespace torus
