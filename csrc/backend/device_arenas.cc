#include "backend/device_arenas.h"

#include <unistd.h>

#include <cstring>
#include <fstream>

#include "backend/log.h"
#include "collectives/device/device_barrier.h"
#include "collectives/blocks.h"
#include "collectives/ring_allgather.h"

namespace torus {

namespace {

// What each rank tells the group about its arena: fixed size, so that the allgather's blocks
// are equal.
struct ArenaRecord {
  ArenaHandle handle;
  char machine[96]; // host name and boot id: processes that can map each other's memory at all
  int32_t host; // the group's host index
  int32_t allocated;
  int32_t pid;
};

std::string machineIdentity() {
  char name[64] = {};
  gethostname(name, sizeof(name) - 1);
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  return std::string(name) + "/" + boot;
}

template <typename T>
std::vector<T> allgatherRecords(Comm& group, const T& mine) {
  std::vector<T> all(static_cast<size_t>(group.size()));
  all[static_cast<size_t>(group.rank())] = mine;
  ring_allgather(group, all.data(), evenBlocks(all.size() * sizeof(T), group.size()), 1, Chunking{});
  return all;
}

std::string rankList(const std::vector<int>& ranks) {
  std::string text;
  for (int r : ranks) {
    text += (text.empty() ? "" : ",") + std::to_string(r);
  }
  return text.empty() ? "none" : text;
}

} // namespace

std::shared_ptr<SharedArenas> SharedArenas::exchange(Comm& group, const DevicePath& path,
                                                     const std::vector<int>& hosts,
                                                     std::unique_ptr<ArenaMemory> memory, size_t bytes,
                                                     int logLevel) {
  const int self = group.rank();
  const int size = group.size();
  const std::string device = memory->deviceName();
  std::shared_ptr<SharedArenas> arenas(new SharedArenas(std::move(memory), bytes, size));
  ArenaMemory& mem = *arenas->memory_;
  const auto hostOf = [&](int r) { return hosts.empty() ? 0 : hosts.at(static_cast<size_t>(r)); };

  ArenaRecord mine{};
  std::strncpy(mine.machine, machineIdentity().c_str(), sizeof(mine.machine) - 1);
  mine.host = hostOf(self);
  mine.pid = static_cast<int32_t>(getpid());
  std::string why;
  char* own = mem.allocate(bytes, mine.handle, why);
  mine.allocated = own != nullptr;
  std::vector<std::string> problems;
  if (own == nullptr) {
    problems.push_back("cannot allocate its own arena of " + std::to_string(bytes) + " bytes: " + why);
  }

  std::vector<ArenaRecord> records;
  std::vector<int8_t> completes;
  std::vector<char*> mapped(static_cast<size_t>(size), nullptr);
  int8_t complete = mine.allocated;
  boundedPhase(group, path, "the exchange of device arenas on " + device, [&] {
    records = allgatherRecords(group, mine);
    // This rank's arena counts only if it mapped every host peer's.
    for (int r = 0; r < size && complete; ++r) {
      const ArenaRecord& peer = records[static_cast<size_t>(r)];
      if (r == self || peer.host != mine.host) {
        continue;
      }
      if (!peer.allocated) {
        problems.push_back("rank " + std::to_string(r) + " has no arena");
      } else if (std::strncmp(peer.machine, mine.machine, sizeof(mine.machine)) != 0) {
        problems.push_back("rank " + std::to_string(r) + " is on another machine (" + peer.machine +
                           ") though its host identity is this rank's");
      } else if (peer.pid == mine.pid) {
        problems.push_back("rank " + std::to_string(r) + " is this process");
      } else if ((mapped[static_cast<size_t>(r)] = mem.open(peer.handle, r, bytes, why)) == nullptr) {
        problems.push_back("cannot open rank " + std::to_string(r) + "'s arena: " + why);
      }
      complete = mapped[static_cast<size_t>(r)] != nullptr;
    }
    completes = allgatherRecords(group, complete);
  });
  mem.exchanged();

  std::vector<int> agreed;
  for (int r = 0; r < size; ++r) {
    if (complete && completes[static_cast<size_t>(r)] && records[static_cast<size_t>(r)].host == mine.host) {
      arenas->arenas_[static_cast<size_t>(r)] = r == self ? own : mapped[static_cast<size_t>(r)];
      agreed.push_back(r);
    }
  }
  if (logLevel >= 1) {
    std::string text = "device arenas on " + device + ": ranks with arenas here: " + rankList(agreed) +
                       " (collectives among them go through arenas; any other rank makes a collective staged)";
    for (const std::string& problem : problems) {
      text += "; " + problem;
    }
    logLine(self, text);
  }
  return arenas;
}

} // namespace torus
