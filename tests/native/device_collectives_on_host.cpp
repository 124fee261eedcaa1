#include "device_collectives_on_host.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <numeric>
#include <optional>
#include <string>
#include <vector>

#include "backend/device_arenas.h"
#include "backend/host_device/host_device_path.h"
#include "backend/host_device/host_shm_memory.h"
#include "backend/tensor_checks.h"
#include "collectives/blocks.h"
#include "collectives/device/arena_allgather.h"
#include "collectives/device/arena_reduce_scatter.h"
#include "collectives/device/device_collectives.h"
#include "collectives/device/staged_ring_allgather.h"
#include "collectives/device/staged_ring_reduce_scatter.h"
#include "collectives/torus_allreduce.h"
#include "callback_rendezvous.h"
#include "comm/comm.h"
#include "comm/device_path.h"
#include "transport/tcp/tcp_transport.h"

namespace py = pybind11;

namespace torus {

namespace {

ReduceKind reduceKindNamed(const std::string& name) {
  std::string lower = name;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  for (int i = 0; i <= static_cast<int>(ReduceKind::kBxor); ++i) {
    if (lower == reduceKindName(static_cast<ReduceKind>(i))) {
      return static_cast<ReduceKind>(i);
    }
  }
  TORUS_CHECK_ARG(false, "unknown reduce op '", name, "' (sum, product, min, max, band, bor, bxor)");
  return ReduceKind::kSum; // not reached
}

// What each method calls, in the call signature, so that ranks that call different ones fail.
enum CallKind : uint8_t {
  kSetup = 1,
  kAllreduce,
  kReduceScatter,
  kAllgather,
  kArenaReduceScatter,
  kArenaAllgather,
  kStagedReduceScatter,
  kStagedAllgather,
};

// A TCP group with host arenas and a host device path, and the device collectives on Comms over
// any of its ranks.
class DeviceCollectivesOnHost {
 public:
  DeviceCollectivesOnHost(int rank, int size, const std::vector<int>& hosts, CallbackRendezvous::Set set,
                          CallbackRendezvous::Get get, size_t arenaBytes, const std::string& mode,
                          double timeoutSeconds)
      : rank_(rank),
        size_(size),
        timeout_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeoutSeconds))),
        path_(mode == "deferred", std::chrono::duration_cast<std::chrono::milliseconds>(timeout_)) {
    TORUS_CHECK_ARG(mode == "eager" || mode == "deferred", "mode '", mode, "': expected eager or deferred");
    TORUS_CHECK_ARG(size > 0 && rank >= 0 && rank < size, "rank ", rank, " of ", size);
    TORUS_CHECK_ARG(hosts.size() == static_cast<size_t>(size), hosts.size(), " hosts for ", size, " ranks");
    TORUS_CHECK_ARG(arenaBytes > 0, "arena_bytes must be positive");
    TORUS_CHECK_ARG(timeoutSeconds > 0, "timeout_s must be positive");
    auto rendezvous = std::make_shared<CallbackRendezvous>(std::move(set), std::move(get));
    TcpOptions options;
    options.timeout = std::chrono::duration_cast<std::chrono::milliseconds>(timeout_);
    transport_ = std::make_shared<TcpTransport>(rank, size, rendezvous, options);
    std::vector<int> everyone(static_cast<size_t>(size));
    std::iota(everyone.begin(), everyone.end(), 0);
    group_ = std::make_unique<Comm>(transport_, everyone, rank);
    Comm setup = *group_;
    prepare(setup, everyone, CallSignature{kSetup});
    arenas_ = SharedArenas::exchange(setup, path_, hosts, makeHostShmMemory(), arenaBytes, 0);
    group_->attachDeviceArenas(arenas_);
  }

  // The route of the Comm over `ranks` (default: the group), as the debug log names it.
  std::string route(const std::optional<std::vector<int>>& ranks) const {
    return deviceRouteName(deviceRouteFor(commOver(ranks).first));
  }

  std::string allreduce(const at::Tensor& buf, const std::string& op,
                        const std::optional<std::vector<std::vector<int>>>& rows, size_t chunkBytes,
                        const std::optional<std::vector<int>>& ranks) {
    return run(buf, &op, kAllreduce, ranks, [&](Call& call) {
      const std::optional<TorusGrid> grid = rows ? std::optional<TorusGrid>(TorusGrid{*rows}) : std::nullopt;
      return describeRoutes(device_allreduce(call.comm, path_, call.op, call.data, call.count,
                                             grid ? &*grid : nullptr, chunkingOf(chunkBytes)));
    });
  }

  std::string reduceScatter(const at::Tensor& buf, const std::vector<size_t>& counts, const std::string& op,
                            size_t chunkBytes, const std::optional<std::vector<size_t>>& offsets,
                            const std::optional<std::vector<int>>& ranks) {
    return run(buf, &op, kReduceScatter, ranks, [&](Call& call) {
      return std::string(deviceRouteName(device_reduce_scatter(
          call.comm, path_, call.op, call.data, blocksOf(call, counts, offsets), chunkingOf(chunkBytes))));
    });
  }

  std::string allgather(const at::Tensor& buf, const std::vector<size_t>& counts, size_t chunkBytes,
                        const std::optional<std::vector<size_t>>& offsets,
                        const std::optional<std::vector<int>>& ranks) {
    return run(buf, nullptr, kAllgather, ranks, [&](Call& call) {
      return std::string(deviceRouteName(device_allgather(call.comm, path_, call.data, blocksOf(call, counts, offsets),
                                                          call.elementSize, chunkingOf(chunkBytes))));
    });
  }

  void arenaReduceScatter(const at::Tensor& buf, const std::vector<size_t>& counts, const std::string& op,
                          const std::optional<std::vector<size_t>>& offsets,
                          const std::optional<std::vector<int>>& ranks) {
    run(buf, &op, kArenaReduceScatter, ranks, [&](Call& call) {
      arena_reduce_scatter(call.comm, path_, call.op, call.data, blocksOf(call, counts, offsets));
      return std::string();
    });
  }

  void arenaAllgather(const at::Tensor& buf, const std::vector<size_t>& counts,
                      const std::optional<std::vector<size_t>>& offsets, const std::optional<std::vector<int>>& ranks) {
    run(buf, nullptr, kArenaAllgather, ranks, [&](Call& call) {
      arena_allgather(call.comm, path_, call.data, blocksOf(call, counts, offsets), call.elementSize);
      return std::string();
    });
  }

  void stagedReduceScatter(const at::Tensor& buf, const std::vector<size_t>& counts, const std::string& op,
                           size_t chunkBytes, const std::optional<std::vector<size_t>>& offsets,
                           const std::optional<std::vector<int>>& ranks) {
    run(buf, &op, kStagedReduceScatter, ranks, [&](Call& call) {
      staged_ring_reduce_scatter(call.comm, path_, call.op, call.data, blocksOf(call, counts, offsets),
                                 chunkingOf(chunkBytes));
      return std::string();
    });
  }

  void stagedAllgather(const at::Tensor& buf, const std::vector<size_t>& counts, size_t chunkBytes, bool mirrored,
                       const std::optional<std::vector<size_t>>& offsets,
                       const std::optional<std::vector<int>>& ranks) {
    run(buf, nullptr, kStagedAllgather, ranks, [&](Call& call) {
      staged_ring_allgather(call.comm, path_, call.data, blocksOf(call, counts, offsets), call.elementSize,
                            chunkingOf(chunkBytes), mirrored);
      return std::string();
    });
  }

  // The path's reduction alone, on this rank: dst = srcs[0] (op) srcs[1] ..., where dst may be one
  // of the source tensors (the same storage).
  void hostReduce(const at::Tensor& dst, const std::vector<at::Tensor>& srcs, const std::string& op) {
    TORUS_CHECK_ARG(!srcs.empty(), "no sources");
    const DataType dtype = checkBuffer(dst);
    std::vector<Region> regions{Region{static_cast<const char*>(dst.data_ptr()), dst.nbytes(), RegionKind::kDevice,
                                       "dst"}};
    std::vector<const void*> sources;
    for (const at::Tensor& src : srcs) {
      TORUS_CHECK_ARG(checkBuffer(src) == dtype && src.numel() == dst.numel(), "sources like dst");
      regions.push_back(Region{static_cast<const char*>(src.data_ptr()), src.nbytes(), RegionKind::kDevice, "src"});
      sources.push_back(src.data_ptr());
    }
    path_.setRegions(std::move(regions));
    path_.reduce(DeviceReduction{dtype, reduceKindNamed(op)}, dst.data_ptr(), sources.data(),
                 static_cast<int>(sources.size()), static_cast<size_t>(dst.numel()));
    path_.synchronize(Clock::now() + timeout_, {"host_reduce"});
  }

  std::map<std::string, uint64_t> stats() const {
    const PathStats& s = path_.stats();
    return {{"copies", s.copies},
            {"reduces", s.reduces},
            {"synchronizes", s.synchronizes},
            {"staging_allocations", s.stagingAllocations},
            {"arena_bytes_written", s.arenaBytesWritten},
            {"arena_bytes_read", s.arenaBytesRead},
            {"staging_bytes", s.stagingBytes}};
  }
  void resetStats() {
    path_.resetStats();
  }
  size_t arenaBytes() const {
    return arenas_->bytes();
  }
  // Transport ranks whose arena is mapped here.
  std::vector<int> mappedArenas() const {
    std::vector<int> mapped;
    for (int r = 0; r < size_; ++r) {
      if (arenas_->arena(r) != nullptr) {
        mapped.push_back(r);
      }
    }
    return mapped;
  }

 private:
  struct Call {
    Comm comm;
    DeviceReduction op;
    char* data;
    size_t count;
    size_t elementSize;
  };

  static Chunking chunkingOf(size_t chunkBytes) {
    TORUS_CHECK_ARG(chunkBytes > 0, "chunk_bytes must be positive");
    Chunking chunking;
    chunking.chunkBytes = chunkBytes;
    return chunking;
  }

  static DataType checkBuffer(const at::Tensor& buf) {
    TORUS_CHECK_ARG(buf.defined() && buf.device().is_cpu() && buf.layout() == at::kStrided && buf.is_contiguous(),
                    "a contiguous CPU tensor");
    return toDataType(buf.scalar_type(), "buf");
  }

  // The Comm over `ranks` (group ranks, this one among them; default: the whole group) and its
  // members.
  std::pair<Comm, std::vector<int>> commOver(const std::optional<std::vector<int>>& ranks) const {
    if (!ranks) {
      std::vector<int> everyone(static_cast<size_t>(size_));
      std::iota(everyone.begin(), everyone.end(), 0);
      return {*group_, everyone};
    }
    std::vector<bool> seen(static_cast<size_t>(size_), false);
    for (int r : *ranks) {
      TORUS_CHECK_ARG(r >= 0 && r < size_ && !seen[static_cast<size_t>(r)], "ranks ", c10::ArrayRef<int>(*ranks),
                      ": each a distinct rank of the group of ", size_);
      seen[static_cast<size_t>(r)] = true;
    }
    TORUS_CHECK_ARG(seen[static_cast<size_t>(rank_)], "ranks ", c10::ArrayRef<int>(*ranks), " lack this rank ", rank_);
    return {group_->subset(*ranks), *ranks};
  }

  // A tag of the Comm's own: its members' hash above, its own count of collectives below, so
  // that ranks agree on it however many collectives other Comms of theirs ran.
  uint64_t nextTag(const std::vector<int>& members) {
    uint64_t hash = 1469598103934665603ull;
    for (int member : members) {
      hash = (hash ^ static_cast<uint64_t>(member + 1)) * 1099511628211ull;
    }
    return (((hash >> 40) & 0xffffff) << 36) | ++collectives_[members];
  }

  void prepare(Comm& comm, const std::vector<int>& members, const CallSignature& call) {
    comm.setTag(nextTag(members));
    comm.setCall(call);
    comm.setDeadline(Clock::now() + timeout_);
  }

  Blocks blocksOf(const Call& call, const std::vector<size_t>& counts,
                  const std::optional<std::vector<size_t>>& offsets) const {
    const size_t n = static_cast<size_t>(call.comm.size());
    TORUS_CHECK_ARG(counts.size() == n, counts.size(), " block counts for ", n, " ranks");
    Blocks blocks;
    blocks.counts = counts;
    if (offsets) {
      TORUS_CHECK_ARG(offsets->size() == n, offsets->size(), " block offsets for ", n, " ranks");
      blocks.offsets = *offsets;
    } else {
      size_t offset = 0;
      for (size_t count : counts) {
        blocks.offsets.push_back(offset);
        offset += count;
      }
    }
    std::vector<size_t> order(n);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return blocks.offsets[a] < blocks.offsets[b]; });
    size_t end = 0;
    for (size_t b : order) {
      TORUS_CHECK_ARG(blocks.offsets[b] <= call.count && blocks.counts[b] <= call.count - blocks.offsets[b], "block ",
                      b, " [", blocks.offsets[b], ", +", blocks.counts[b], ") lies outside the ", call.count,
                      " elements of buf");
      if (blocks.counts[b] > 0) {
        TORUS_CHECK_ARG(blocks.offsets[b] >= end, "block ", b, " overlaps another");
        end = blocks.offsets[b] + blocks.counts[b];
      }
    }
    return blocks;
  }

  template <typename Body>
  std::string run(const at::Tensor& buf, const std::string* opName, CallKind kind,
                  const std::optional<std::vector<int>>& ranks, Body body) {
    const DataType dtype = checkBuffer(buf);
    ReduceKind op = ReduceKind::kSum;
    if (opName != nullptr) {
      op = reduceKindNamed(*opName);
      TORUS_CHECK_ARG(makeReducer(dtype, op).fn != nullptr, "op ", *opName, " is not defined for ",
                      dataTypeName(dtype));
    }
    auto [comm, members] = commOver(ranks);
    CallSignature signature;
    signature.kind = kind;
    signature.dtype = static_cast<uint8_t>(dtype);
    signature.op = static_cast<uint8_t>(op);
    signature.nbytes = static_cast<uint64_t>(buf.nbytes());
    prepare(comm, members, signature);
    Call call{comm, DeviceReduction{dtype, op}, static_cast<char*>(buf.data_ptr()), static_cast<size_t>(buf.numel()),
              elementSize(dtype)};
    path_.setRegions(regionsFor(call));
    try {
      std::string route = body(call);
      path_.synchronize(call.comm.deadline(), {"the end of the call"});
      return route;
    } catch (...) {
      path_.discard();
      throw;
    }
  }

  // The call's buffer, and each mapped arena's halves (the algorithms use an arena as two halves;
  // a piece that crosses from one into the other is a bug).
  std::vector<Region> regionsFor(const Call& call) const {
    std::vector<Region> regions{Region{call.data, call.count * call.elementSize, RegionKind::kDevice, "the buffer"}};
    const size_t half = arenas_->bytes() / 2;
    for (int r = 0; r < size_; ++r) {
      char* arena = arenas_->arena(r);
      if (arena == nullptr) {
        continue;
      }
      const RegionKind kind = r == rank_ ? RegionKind::kOwnArena : RegionKind::kPeerArena;
      for (int h = 0; h < 2; ++h) {
        regions.push_back(Region{arena + h * half, half, kind,
                                 "half " + std::to_string(h) + " of rank " + std::to_string(r) + "'s arena"});
      }
    }
    return regions;
  }

  const int rank_;
  const int size_;
  const Clock::duration timeout_;
  std::shared_ptr<Transport> transport_;
  std::unique_ptr<Comm> group_;
  std::shared_ptr<SharedArenas> arenas_;
  HostDevicePath path_;
  std::map<std::vector<int>, uint64_t> collectives_;
};

} // namespace

void defineDeviceCollectivesOnHost(py::module& module) {
  const size_t chunkBytes = Chunking().chunkBytes;
  py::class_<DeviceCollectivesOnHost>(module, "DeviceCollectivesOnHost")
      .def(py::init<int, int, const std::vector<int>&, CallbackRendezvous::Set, CallbackRendezvous::Get, size_t,
                    const std::string&, double>(),
           py::arg("rank"), py::arg("size"), py::arg("hosts"), py::arg("store_set"), py::arg("store_get"),
           py::arg("arena_bytes") = size_t(1) << 20, py::arg("mode") = "eager", py::arg("timeout_s") = 60.0)
      .def_property_readonly("arena_bytes", &DeviceCollectivesOnHost::arenaBytes)
      .def("mapped_arenas", &DeviceCollectivesOnHost::mappedArenas)
      .def("route", &DeviceCollectivesOnHost::route, py::arg("ranks") = py::none())
      .def("device_allreduce", &DeviceCollectivesOnHost::allreduce, py::arg("buf"), py::arg("op") = "sum",
           py::arg("grid") = py::none(), py::arg("chunk_bytes") = chunkBytes, py::arg("ranks") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("device_reduce_scatter", &DeviceCollectivesOnHost::reduceScatter, py::arg("buf"), py::arg("counts"),
           py::arg("op") = "sum", py::arg("chunk_bytes") = chunkBytes, py::arg("offsets") = py::none(),
           py::arg("ranks") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("device_allgather", &DeviceCollectivesOnHost::allgather, py::arg("buf"), py::arg("counts"),
           py::arg("chunk_bytes") = chunkBytes, py::arg("offsets") = py::none(), py::arg("ranks") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("arena_reduce_scatter", &DeviceCollectivesOnHost::arenaReduceScatter, py::arg("buf"), py::arg("counts"),
           py::arg("op") = "sum", py::arg("offsets") = py::none(), py::arg("ranks") = py::none(),
           py::call_guard<py::gil_scoped_release>())
      .def("arena_allgather", &DeviceCollectivesOnHost::arenaAllgather, py::arg("buf"), py::arg("counts"),
           py::arg("offsets") = py::none(), py::arg("ranks") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("staged_ring_reduce_scatter", &DeviceCollectivesOnHost::stagedReduceScatter, py::arg("buf"),
           py::arg("counts"), py::arg("op") = "sum", py::arg("chunk_bytes") = chunkBytes,
           py::arg("offsets") = py::none(), py::arg("ranks") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("staged_ring_allgather", &DeviceCollectivesOnHost::stagedAllgather, py::arg("buf"), py::arg("counts"),
           py::arg("chunk_bytes") = chunkBytes, py::arg("mirrored") = false, py::arg("offsets") = py::none(),
           py::arg("ranks") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("host_reduce", &DeviceCollectivesOnHost::hostReduce, py::arg("dst"), py::arg("srcs"),
           py::arg("op") = "sum")
      .def("stats", &DeviceCollectivesOnHost::stats)
      .def("reset_stats", &DeviceCollectivesOnHost::resetStats);
}

} // namespace torus
