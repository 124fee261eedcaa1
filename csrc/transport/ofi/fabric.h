// Fabric: one libfabric reliable-datagram endpoint (FI_EP_RDM) with tagged messages, and RMA
// reads where the provider offers them, with the objects libfabric needs for it (fabric, domain,
// completion queue, address vector), opened together and closed in order. Knows nothing of
// ranks' streams: OfiTransport posts on it and reads its completions.
#pragma once

#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

namespace torus::ofi {

// The context of every posted operation: libfabric's scratch space first (FI_CONTEXT2 mode),
// then what the poster needs to find its operation again.
struct Posted {
  fi_context2 scratch;
  void* owner = nullptr;
  int kind = 0;
  int index = 0;
};

// Memory registered with the domain: for RMA, and for local buffers where the provider needs
// that (FI_MR_LOCAL).
struct Region {
  fid_mr* mr = nullptr;
  void* desc = nullptr;
  uint64_t key = 0;
};

// libfabric's text for an error number (FI_E*, errno values).
const char* errorText(int error);

class Fabric {
 public:
  // Messages up to this size go eagerly (no rendezvous) through libfabric's rxm layer, whose
  // buffers are raised to hold them (FI_OFI_RXM_BUFFER_SIZE, unless the user set it) before
  // libfabric is loaded.
  static constexpr size_t kEagerBytes = 32 * 1024;

  // Opens an endpoint of `provider` (libfabric's own choice, FI_PROVIDER honoured, when empty)
  // bound to `address` where the provider takes one. Throws std::runtime_error saying what
  // libfabric offers instead.
  Fabric(const std::string& provider, const std::string& address);
  ~Fabric();
  // Closes the endpoint and everything under it (posted receives end with it); idempotent.
  void close();
  Fabric(const Fabric&) = delete;
  Fabric& operator=(const Fabric&) = delete;

  // This endpoint's address, as bytes for a peer's insert().
  const std::string& name() const {
    return name_;
  }
  // A peer's address (its name()) as libfabric's handle for it. Throws std::runtime_error.
  fi_addr_t insert(const std::string& name);
  // "tcp;ofi_rxm on lo (tagged, RMA, directed receives, memory registration: none needed, inject 64 B,
  // libfabric 1.17)".
  std::string describe() const;
  const char* providerName() const;
  bool offersRma() const {
    return rma_;
  }
  // Receives may name the one endpoint they take messages from (FI_DIRECTED_RECV): what any
  // other endpoint sends never matches them. Only where the provider also matches them with what
  // a peer sent before its address was inserted (rxm-based ones: tcp, verbs); elsewhere (shm) a
  // receive takes its messages from any endpoint.
  bool directsReceives() const {
    return directed_;
  }
  // The provider carries RMA over the sockets its messages use (tcp, udp, sockets, net): no
  // hardware reads the memory.
  bool rmaOverSockets() const;
  size_t injectBytes() const;
  size_t maxMessageBytes() const;
  // The provider needs local buffers registered (FI_MR_LOCAL).
  bool registersLocal() const;

  // The shm provider keeps each endpoint in a segment of /dev/shm named after the endpoint's
  // name, which peers open by that name once, when they first reach it; the provider removes it
  // when the endpoint closes, so a killed process leaves it behind. Removes the name of the
  // segment of the endpoint named `name` (this one's, or a dead peer's); those that have it
  // open keep it. Nothing for other providers.
  void unlinkSegment(const std::string& name) const;
  // The process that made the shm segment of the endpoint named `name` (torus names them
  // "torus_<pid>_<n>"); 0 when the name is none of those.
  static int segmentOwner(const std::string& name);

  // Registers [buf, buf + n) for `access` (FI_SEND | FI_RECV | FI_READ, FI_REMOTE_READ). Returns
  // false, with *why set, when the provider refuses.
  bool registerMemory(const void* buf, size_t n, uint64_t access, Region* region, std::string* why);
  void deregister(Region& region);
  // The remote address an RMA read of lent memory at `address` names: the address itself where
  // the provider uses virtual addresses, else the offset in the region (0).
  uint64_t remoteAddress(uint64_t address) const;

  // Reads up to `count` completions: done(Posted*, bytes) for each, failed(Posted*, why) for
  // errors (Posted* may be null). Returns how many it read.
  template <typename Done, typename Failed>
  int readCompletions(int count, Done&& done, Failed&& failed);
  // The completion queue's file descriptor (-1 when the provider has none) and whether
  // blocking on it now is safe (fi_trywait).
  int waitFd() const {
    return waitFd_;
  }
  bool mayBlock();

  fid_ep* endpoint() const {
    return ep_;
  }

 private:
  fi_info* info_ = nullptr;
  fid_fabric* fabric_ = nullptr;
  fid_domain* domain_ = nullptr;
  fid_cq* cq_ = nullptr;
  fid_av* av_ = nullptr;
  fid_ep* ep_ = nullptr;
  int waitFd_ = -1;
  bool rma_ = false;
  bool directed_ = false;
  std::string name_;
  uint64_t nextKey_ = 1;

  // Reads the error completion waiting; returns its context and sets *why.
  Posted* readError(std::string* why);
};

template <typename Done, typename Failed>
int Fabric::readCompletions(int count, Done&& done, Failed&& failed) {
  fi_cq_tagged_entry entries[16];
  const ssize_t got = fi_cq_read(cq_, entries, static_cast<size_t>(std::min(count, 16)));
  if (got > 0) {
    for (ssize_t i = 0; i < got; ++i) {
      done(static_cast<Posted*>(entries[i].op_context), entries[i].len);
    }
    return static_cast<int>(got);
  }
  if (got == -FI_EAVAIL) {
    std::string why;
    Posted* posted = readError(&why);
    failed(posted, why);
    return 1;
  }
  return 0;
}

} // namespace torus::ofi
