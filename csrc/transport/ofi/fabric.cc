#include "transport/ofi/fabric.h"

#include <rdma/fi_cm.h>
#include <rdma/fi_endpoint.h>

#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace torus::ofi {

namespace {

// libfabric's few exported functions (everything else is inline through an object's ops),
// loaded when the first Fabric opens rather than linked: a process that imports torch_torus and
// then MPICH's wheel (mpi4py) would otherwise hold the system's libfabric.so.1 under the soname
// of MPICH's own, newer one, and MPICH fails to load (measured: "version FABRIC_1.9 not found").
struct Library {
  decltype(&fi_getinfo) getinfo = nullptr;
  decltype(&fi_freeinfo) freeinfo = nullptr;
  decltype(&fi_dupinfo) dupinfo = nullptr;
  decltype(&fi_fabric) fabric = nullptr;
  decltype(&fi_strerror) strerror = nullptr;
  decltype(&fi_version) version = nullptr;
};

const Library& library() {
  static const Library loaded = [] {
    // rxm reads its buffer size once, when it loads; its packet header (under 1 KiB) comes on
    // top of the eager payload. A user's setting wins.
    ::setenv("FI_OFI_RXM_BUFFER_SIZE", std::to_string(Fabric::kEagerBytes + 1024).c_str(), 0);
    // A libfabric built with the psm provider loads libinfinipath, which takes over SIGSEGV and
    // friends when it loads: a crash then leaves <program>-<pid>.btr files in the working
    // directory instead of Python's faulthandler stacks. Unless the user asked for them.
    ::setenv("IPATH_NO_BACKTRACE", "1", 0);
    // The build's libfabric first (RUNPATH of this module), else the loader's search path.
    void* handle = ::dlopen("libfabric.so.1", RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) {
      throw std::runtime_error(std::string("torus: the OFI transport cannot load libfabric (") + ::dlerror() +
                               "): install it (Debian/Ubuntu: apt install libfabric1) or put it on LD_LIBRARY_PATH");
    }
    Library library;
    library.getinfo = reinterpret_cast<decltype(&fi_getinfo)>(::dlsym(handle, "fi_getinfo"));
    library.freeinfo = reinterpret_cast<decltype(&fi_freeinfo)>(::dlsym(handle, "fi_freeinfo"));
    library.dupinfo = reinterpret_cast<decltype(&fi_dupinfo)>(::dlsym(handle, "fi_dupinfo"));
    library.fabric = reinterpret_cast<decltype(&fi_fabric)>(::dlsym(handle, "fi_fabric"));
    library.strerror = reinterpret_cast<decltype(&fi_strerror)>(::dlsym(handle, "fi_strerror"));
    library.version = reinterpret_cast<decltype(&fi_version)>(::dlsym(handle, "fi_version"));
    if (!library.getinfo || !library.freeinfo || !library.dupinfo || !library.fabric || !library.strerror ||
        !library.version) {
      throw std::runtime_error("torus: the libfabric.so.1 found lacks fi_getinfo, fi_freeinfo, fi_dupinfo, "
                               "fi_fabric, fi_strerror or fi_version");
    }
    return library;
  }();
  return loaded;
}

// What the transport asks of a provider: tagged messages between reliable-datagram endpoints,
// kept in order between two endpoints (the streams rely on it), and RMA reads and receives that
// name their sender when it has them.
fi_info* hintsFor(const std::string& provider, bool withRma, bool directed) {
  fi_info* hints = library().dupinfo(nullptr);
  hints->ep_attr->type = FI_EP_RDM;
  hints->caps = FI_TAGGED | (withRma ? FI_RMA | FI_READ | FI_REMOTE_READ : 0) | (directed ? FI_DIRECTED_RECV : 0);
  hints->mode = FI_CONTEXT | FI_CONTEXT2;
  // The registration modes this transport honours; the provider answers with those it needs.
  hints->domain_attr->mr_mode = FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY | FI_MR_ENDPOINT;
  hints->domain_attr->threading = FI_THREAD_DOMAIN;
  hints->tx_attr->msg_order = FI_ORDER_SAS;
  hints->rx_attr->msg_order = FI_ORDER_SAS;
  if (!provider.empty()) {
    hints->fabric_attr->prov_name = ::strdup(provider.c_str());
  }
  return hints;
}

// The first endpoint offered for `hints`, bound to `address` where the provider takes one (the
// socket-based ones do; shared memory has no address to bind).
fi_info* firstOffered(fi_info* hints, const std::string& address) {
  fi_info* found = nullptr;
  if (!address.empty() && library().getinfo(FI_VERSION(1, 9), address.c_str(), nullptr, FI_SOURCE, hints, &found) == 0) {
    return found;
  }
  if (library().getinfo(FI_VERSION(1, 9), nullptr, nullptr, 0, hints, &found) == 0) {
    return found;
  }
  return nullptr;
}

// Whether the provider `info` describes matches a receive directed at a peer with what the peer
// sent before this rank inserted its address (a dialing peer's first chunks follow its hello at
// once): rxm does since libfabric 1.15. Others are not known to (shm 1.17 was seen to match a
// receive directed at one endpoint with a message from another endpoint of the same process).
bool matchesEarlyMessages(const fi_info* info) {
  return std::string(info->fabric_attr->prov_name).find("ofi_rxm") != std::string::npos &&
         FI_VERSION_GE(library().version(), FI_VERSION(1, 15));
}

void check(int result, const char* what) {
  if (result != 0) {
    throw std::runtime_error(std::string("torus: libfabric ") + what + " failed: " + errorText(-result));
  }
}

void closeFid(fid* object) {
  if (object != nullptr) {
    fi_close(object);
  }
}

} // namespace

Fabric::Fabric(const std::string& provider, const std::string& address) {
  for (int choice = 0; choice < 4 && info_ == nullptr; ++choice) {
    const bool directed = choice < 2;
    const bool withRma = choice % 2 == 0;
    fi_info* hints = hintsFor(provider, withRma, directed);
    info_ = firstOffered(hints, address);
    library().freeinfo(hints);
    if (info_ != nullptr && directed && !matchesEarlyMessages(info_)) {
      library().freeinfo(info_);
      info_ = nullptr;
    }
    if (info_ != nullptr) {
      rma_ = withRma;
      directed_ = directed;
    }
  }
  if (info_ != nullptr && info_->addr_format == FI_ADDR_STR) {
    // Shared memory (shm) names its endpoint after the node given, or one name per process:
    // each group's endpoint needs its own, or the second fails to open (EBUSY).
    static std::atomic<int> endpoints{0};
    const std::string name = "torus_" + std::to_string(::getpid()) + "_" + std::to_string(endpoints++);
    fi_info* hints = hintsFor(info_->fabric_attr->prov_name, rma_, directed_);
    fi_info* named = nullptr;
    if (library().getinfo(FI_VERSION(1, 9), name.c_str(), nullptr, FI_SOURCE, hints, &named) == 0) {
      library().freeinfo(info_);
      info_ = named;
    }
    library().freeinfo(hints);
  }
  if (info_ == nullptr) {
    throw std::runtime_error(
        "torus: libfabric offers no " + (provider.empty() ? std::string("provider") : "provider '" + provider + "'") +
        " with reliable-datagram endpoints, tagged messages and ordered sends here (TORUS_OFI_PROVIDER=" + provider +
        "; `fi_info -t FI_EP_RDM -c FI_TAGGED` lists those that have them, e.g. tcp)");
  }
  try {
    check(library().fabric(info_->fabric_attr, &fabric_, nullptr), "fi_fabric");
    check(fi_domain(fabric_, info_, &domain_, nullptr), "fi_domain");
    fi_cq_attr cqAttr{};
    cqAttr.format = FI_CQ_FORMAT_TAGGED;
    cqAttr.wait_obj = FI_WAIT_FD;
    if (fi_cq_open(domain_, &cqAttr, &cq_, nullptr) != 0) {
      // Providers without a wait object (shm) are polled: the sleep then has a short bound.
      cqAttr.wait_obj = FI_WAIT_NONE;
      check(fi_cq_open(domain_, &cqAttr, &cq_, nullptr), "fi_cq_open");
    } else if (fi_control(&cq_->fid, FI_GETWAIT, &waitFd_) != 0) {
      waitFd_ = -1;
    }
    fi_av_attr avAttr{};
    avAttr.type = FI_AV_TABLE;
    check(fi_av_open(domain_, &avAttr, &av_, nullptr), "fi_av_open");
    check(fi_endpoint(domain_, info_, &ep_, nullptr), "fi_endpoint");
    check(fi_ep_bind(ep_, &cq_->fid, FI_TRANSMIT | FI_RECV), "fi_ep_bind (completion queue)");
    check(fi_ep_bind(ep_, &av_->fid, 0), "fi_ep_bind (address vector)");
    check(fi_enable(ep_), "fi_enable");
    char name[256];
    size_t length = sizeof(name);
    check(fi_getname(&ep_->fid, name, &length), "fi_getname");
    name_.assign(name, length);
  } catch (...) {
    close();
    throw;
  }
}

Fabric::~Fabric() {
  close();
}

void Fabric::close() {
  closeFid(ep_ ? &ep_->fid : nullptr);
  closeFid(av_ ? &av_->fid : nullptr);
  closeFid(cq_ ? &cq_->fid : nullptr);
  closeFid(domain_ ? &domain_->fid : nullptr);
  closeFid(fabric_ ? &fabric_->fid : nullptr);
  if (info_ != nullptr) {
    library().freeinfo(info_);
  }
  ep_ = nullptr;
  av_ = nullptr;
  cq_ = nullptr;
  domain_ = nullptr;
  fabric_ = nullptr;
  info_ = nullptr;
}

fi_addr_t Fabric::insert(const std::string& name) {
  fi_addr_t address = FI_ADDR_UNSPEC;
  if (fi_av_insert(av_, name.data(), 1, &address, 0, nullptr) != 1) {
    throw std::runtime_error("torus: libfabric cannot take a peer's address (fi_av_insert failed)");
  }
  return address;
}

const char* Fabric::providerName() const {
  return info_->fabric_attr->prov_name;
}

size_t Fabric::injectBytes() const {
  return info_->tx_attr->inject_size;
}

size_t Fabric::maxMessageBytes() const {
  return info_->ep_attr->max_msg_size;
}

bool Fabric::rmaOverSockets() const {
  const std::string name = providerName();
  for (const char* socketBased : {"tcp", "udp", "sockets", "net"}) {
    if (name == socketBased || name.rfind(std::string(socketBased) + ";", 0) == 0) {
      return true;
    }
  }
  return false;
}

bool Fabric::registersLocal() const {
  return (info_->domain_attr->mr_mode & FI_MR_LOCAL) != 0;
}

std::string Fabric::describe() const {
  // The process may hold another libfabric than the build's: an MPI's, loaded first.
  const uint32_t version = library().version();
  const int mode = info_->domain_attr->mr_mode;
  std::string registration;
  for (auto [bit, name] : {std::pair{FI_MR_LOCAL, "local"}, {FI_MR_VIRT_ADDR, "virtual addresses"},
                           {FI_MR_PROV_KEY, "provider keys"}, {FI_MR_ENDPOINT, "bound to the endpoint"},
                           {FI_MR_ALLOCATED, "allocated memory"}}) {
    if (mode & bit) {
      registration += (registration.empty() ? "" : ", ") + std::string(name);
    }
  }
  return std::string(providerName()) + " on " + info_->domain_attr->name + " (tagged" +
         (rma_ ? ", RMA" : ", no RMA") + (directed_ ? ", directed receives" : "") + ", memory registration: " + (registration.empty() ? "none needed" : registration) + ", inject " +
         std::to_string(injectBytes()) + " B" + (waitFd_ < 0 ? ", polled" : "") + ", libfabric " +
         std::to_string(FI_MAJOR(version)) + "." + std::to_string(FI_MINOR(version)) + ")";
}

bool Fabric::registerMemory(const void* buf, size_t n, uint64_t access, Region* region, std::string* why) {
  const uint64_t requested = (info_->domain_attr->mr_mode & FI_MR_PROV_KEY) ? 0 : nextKey_++;
  int result = fi_mr_reg(domain_, buf, n, access, 0, requested, 0, &region->mr, nullptr);
  if (result == 0 && (info_->domain_attr->mr_mode & FI_MR_ENDPOINT)) {
    result = fi_mr_bind(region->mr, &ep_->fid, 0);
    if (result == 0) {
      result = fi_mr_enable(region->mr);
    }
    if (result != 0) {
      fi_close(&region->mr->fid);
    }
  }
  if (result != 0) {
    region->mr = nullptr;
    *why = std::string("libfabric cannot register ") + std::to_string(n) + " bytes: " + errorText(-result);
    return false;
  }
  region->desc = fi_mr_desc(region->mr);
  region->key = fi_mr_key(region->mr);
  if (region->key == FI_KEY_NOTAVAIL) {
    deregister(*region);
    *why = "the provider's memory keys do not fit 64 bits";
    return false;
  }
  return true;
}

void Fabric::deregister(Region& region) {
  if (region.mr != nullptr) {
    fi_close(&region.mr->fid);
  }
  region = Region{};
}

const char* errorText(int error) {
  return library().strerror(error);
}

namespace {

// The segment an shm endpoint's name (its address: "[fi_shm://]<name>", NUL-padded) lives in.
std::string segmentName(const std::string& name) {
  std::string segment = name.substr(0, name.find('\0'));
  const auto scheme = segment.find("://");
  return scheme == std::string::npos ? segment : segment.substr(scheme + 3);
}

constexpr const char* kSegmentPrefix = "torus_";

} // namespace

void Fabric::unlinkSegment(const std::string& name) const {
  if (std::string(providerName()) == "shm" && segmentOwner(name) > 0) {
    ::shm_unlink(segmentName(name).c_str());
  }
}

int Fabric::segmentOwner(const std::string& name) {
  const std::string segment = segmentName(name);
  if (segment.rfind(kSegmentPrefix, 0) != 0) {
    return 0;
  }
  // A pid has at most 9 digits here (pid_max is at most 2^22); the name may come from a peer.
  int pid = 0;
  for (size_t i = std::strlen(kSegmentPrefix), end = std::min(segment.size(), i + 9);
       i < end && std::isdigit(static_cast<unsigned char>(segment[i])); ++i) {
    pid = pid * 10 + (segment[i] - '0');
  }
  return pid;
}

uint64_t Fabric::remoteAddress(uint64_t address) const {
  return (info_->domain_attr->mr_mode & FI_MR_VIRT_ADDR) ? address : 0;
}

bool Fabric::mayBlock() {
  fid* waiting[1] = {&cq_->fid};
  return waitFd_ >= 0 && fi_trywait(fabric_, waiting, 1) == FI_SUCCESS;
}

Posted* Fabric::readError(std::string* why) {
  fi_cq_err_entry entry{};
  if (fi_cq_readerr(cq_, &entry, 0) != 1) {
    *why = "libfabric reported an error it could not describe";
    return nullptr;
  }
  const char* detail = fi_cq_strerror(cq_, entry.prov_errno, entry.err_data, nullptr, 0);
  *why = std::string(errorText(entry.err)) + (detail && *detail ? std::string(" (") + detail + ")" : "");
  return static_cast<Posted*>(entry.op_context);
}

} // namespace torus::ofi
