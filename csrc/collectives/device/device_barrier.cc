#include "collectives/device/device_barrier.h"

#include "collectives/barrier_dissemination.h"

namespace torus {

void device_barrier(Comm& comm, const DevicePath& path, const DevicePhase& phase) {
  const Deadline collective = comm.deadline();
  const Deadline bound = phaseDeadline(path, collective);
  comm.setDeadline(bound);
  try {
    barrier_dissemination(comm);
  } catch (const CommError& e) {
    comm.setDeadline(collective);
    if (e.kind() != CommError::Kind::kTimeout || bound == collective) {
      throw;
    }
    throw CommError(e.kind(), kStalledIn + phase.describe() + " (stall bound " +
                                  std::to_string(path.stallBound().count()) + " ms): " + e.what());
  }
  comm.setDeadline(collective);
}

} // namespace torus
