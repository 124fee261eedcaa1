// The device arenas of a group's ranks on one host, shared the same way by every device layer
// (CUDA IPC, and the host layer's POSIX shared memory): each rank allocates its arena and
// exports a handle; the group allgathers every rank's handle, process, machine and host; each
// rank opens the handles of the other ranks of its host; a second allgather says which ranks
// opened all of theirs, and only those ranks' arenas count, on every rank. So a Comm has arenas on
// all of its ranks or on none, and its ranks agree on its route. A failure to allocate or open
// leaves ranks unmapped (logged at info with its cause), never the group failed; a transport
// failure, or the exchange stalling past the stall bound, raises.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "comm/comm.h"
#include "comm/device_path.h"

namespace torus {

// What names an arena to other processes: a cudaIpcMemHandle_t, a shared-memory name.
struct ArenaHandle {
  char bytes[64];
};

// One device layer's arena memory: this rank's arena and the peers' it has opened, released
// with the object.
class ArenaMemory {
 public:
  virtual ~ArenaMemory() = default;
  // "cuda:0", "host": for logs.
  virtual std::string deviceName() const = 0;
  // Allocates this rank's arena of `bytes` and fills `handle`; nullptr, with `why`, when it cannot.
  virtual char* allocate(size_t bytes, ArenaHandle& handle, std::string& why) = 0;
  // Maps the arena `handle` names (of `rank`, `bytes` long); nullptr, with `why`, when it cannot.
  virtual char* open(const ArenaHandle& handle, int rank, size_t bytes, std::string& why) = 0;
  // Once every rank has opened what it could (a shared-memory name can go then).
  virtual void exchanged() {}
};

class SharedArenas : public DeviceArenas {
 public:
  // Collective over `group` (the whole group: comm rank = transport rank). `hosts`: each rank's
  // host index (TorusConfig::hosts; empty: all on one host), so that ranks told apart by
  // TORUS_HOST_ID never share arenas. Bounded by the group's deadline and `path`'s stall bound.
  static std::shared_ptr<SharedArenas> exchange(Comm& group, const DevicePath& path, const std::vector<int>& hosts,
                                                std::unique_ptr<ArenaMemory> memory, size_t bytes, int logLevel);

  size_t bytes() const override {
    return bytes_;
  }
  char* arena(int transportRank) const override {
    return arenas_.at(static_cast<size_t>(transportRank));
  }

 private:
  SharedArenas(std::unique_ptr<ArenaMemory> memory, size_t bytes, int size)
      : memory_(std::move(memory)), bytes_(bytes), arenas_(static_cast<size_t>(size), nullptr) {}

  std::unique_ptr<ArenaMemory> memory_;
  const size_t bytes_;
  std::vector<char*> arenas_; // by transport rank: mapped and agreed on, or nullptr
};

} // namespace torus
