#include "collectives/device/device_barrier.h"

#include "collectives/barrier_dissemination.h"

namespace torus {

void boundedPhase(Comm& comm, const DevicePath& path, const std::string& phase, const std::function<void()>& exchange) {
  const Deadline collective = comm.deadline();
  const Deadline bound = phaseDeadline(path, collective);
  comm.setDeadline(bound);
  try {
    exchange();
  } catch (const CommError& e) {
    comm.setDeadline(collective);
    if (e.kind() != CommError::Kind::kTimeout || bound == collective) {
      throw;
    }
    throw CommError(e.kind(), kStalledIn + phase + " (stall bound " + std::to_string(path.stallBound().count()) +
                                  " ms): " + e.what());
  }
  comm.setDeadline(collective);
}

void device_barrier(Comm& comm, const DevicePath& path, const DevicePhase& phase) {
  boundedPhase(comm, path, phase.describe(), [&] { barrier_dissemination(comm); });
}

} // namespace torus
