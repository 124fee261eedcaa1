// Builds a group's transport from its configuration: TCP or libfabric (OFI) between any two ranks,
// shared memory when every rank shares this host, or both (shared memory inside each host, TCP or
// OFI between hosts).
// The one place in the backend that names concrete transports, as torch's GlooDeviceFactory is.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "backend/torus_config.h"
#include "transport/transport.h"

namespace torus {

struct GroupTransport {
  std::shared_ptr<Transport> transport;
  // sameHost[r]: rank r shares this process's host.
  std::vector<bool> sameHost;
  // For the log: "tcp (10.0.0.1)", "shared memory (single-copy transfers)", ...
  std::string description;
};

// Connects this rank to the group's others through `store`. Raises DistBackendError naming the
// group when the peers cannot be reached; c10::ValueError for a configuration that cannot work.
GroupTransport buildTransport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                              std::chrono::milliseconds timeout, const TorusConfig& config,
                              const std::string& groupName);

} // namespace torus
