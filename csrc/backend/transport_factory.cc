#include "backend/transport_factory.h"

#include <torch/csrc/distributed/c10d/exception.h>

#include "backend/tensor_checks.h"
#include "transport/group_secret.h"
#include "transport/hybrid_transport.h"
#include "transport/ofi/ofi_transport.h"
#include "transport/tcp/tcp_transport.h"
#include "transport/rendezvous.h"

namespace torus {

namespace {

class StoreRendezvous : public Rendezvous {
 public:
  explicit StoreRendezvous(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto value = store_->get(key);
    return std::string(value.begin(), value.end());
  }
  std::vector<std::string> multiGet(const std::vector<std::string>& keys) override {
    std::vector<std::string> values;
    if (keys.empty()) {
      return values; // no store operation for a rank alone on its host
    }
    values.reserve(keys.size());
    for (const auto& value : store_->multiGet(keys)) {
      values.emplace_back(value.begin(), value.end());
    }
    return values;
  }
  bool looksUpFromAnyThread() const override {
    return true;
  }
  std::optional<std::string> waitFor(const std::string& key, std::chrono::milliseconds timeout) override {
    try {
      store_->wait({key}, timeout);
    } catch (const std::exception&) {
      // Its timeout, or the store failed (a store behind Python throws either as the same
      // type): one look tells them apart, throwing in the second case.
      if (!store_->check({key})) {
        return std::nullopt;
      }
    }
    // TCPStore's get would wait for the key again (a second round trip). compareSet with the
    // same expected and desired value changes nothing and returns the value: one round trip.
    // Only ever on a key known to be set: on an absent one TCPStore wakes the key's waiters.
    const std::vector<uint8_t> same{0};
    auto value = store_->compareSet(key, same, same);
    return std::string(value.begin(), value.end());
  }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

} // namespace

GroupTransport buildTransport(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                              std::chrono::milliseconds timeout, const TorusConfig& config,
                              const std::string& groupName) {
  TORUS_CHECK_ARG(config.transport == "tcp" || config.transport == "shm" || config.transport == "shm+tcp" ||
                      config.transport == "ofi" || config.transport == "shm+ofi",
                  "unknown transport '", config.transport, "'; expected tcp, shm, ofi, shm+tcp or shm+ofi");
  TORUS_CHECK_ARG(config.hosts.empty() || config.hosts.size() == static_cast<size_t>(size), config.hosts.size(),
                  " host indices for a group of ", size, " ranks");
  GroupTransport group;
  group.sameHost.assign(static_cast<size_t>(size), true);
  std::vector<int> hostMembers;
  for (size_t r = 0; r < config.hosts.size(); ++r) {
    group.sameHost[r] = config.hosts[r] == config.hosts[static_cast<size_t>(rank)];
    if (group.sameHost[r]) {
      hostMembers.push_back(static_cast<int>(r));
    }
  }
  auto rendezvous = std::make_shared<StoreRendezvous>(store);
  try {
    const MessageOptions messages{config.eagerBytes, config.eagerWindowBytes};
    TcpOptions tcp;
    tcp.address = config.address;
    tcp.timeout = timeout;
    tcp.messages = messages;
    // Every connection between the ranks proves it knows the group's secret, which rank 0 drew
    // and handed every rank when they met in the store. Shared memory makes no connection: its
    // segments are the ranks' own.
    TORUS_CHECK_ARG(config.transport == "shm" || size == 1 || config.secret.size() == kSecretBytes,
                    "a group of ", size, " ranks over ", config.transport, " needs the group's secret of ",
                    kSecretBytes, " bytes, got ", config.secret.size(), " bytes");
    tcp.secret = config.secret;
    tcp.listener = config.tcpListener;
    if (config.transport == "shm") {
      auto shm = std::make_shared<ShmTransport>(rank, size, *rendezvous, std::vector<int>{}, messages, config.wait);
      group.description = std::string("shared memory (") +
                          (shm->singleCopy() ? "single-copy transfers" : "no single-copy transfers: two_shot off") +
                          ")";
      group.transport = std::move(shm);
    } else if (config.transport == "tcp") {
      group.transport = std::make_shared<TcpTransport>(rank, size, rendezvous, tcp);
      group.description = "tcp (" + config.address + ")";
    } else {
      // The network between hosts: TCP, or libfabric.
      std::unique_ptr<PolledTransport> network;
      std::string networkDescription;
      if (config.transport == "shm+tcp") {
        network = std::make_unique<TcpTransport>(rank, size, rendezvous, tcp);
        networkDescription = "tcp between hosts (" + config.address + ")";
      } else {
        OfiOptions ofi;
        ofi.provider = config.ofiProvider;
        ofi.address = config.address;
        ofi.timeout = timeout;
        if (config.ofiRmaBytes >= 0) {
          ofi.rmaAbove = static_cast<size_t>(config.ofiRmaBytes);
        }
        ofi.messages = messages;
        ofi.secret = tcp.secret;
        try {
          network = makeOfiTransport(rank, size, rendezvous, ofi, &networkDescription);
          if (config.transport == "shm+ofi") {
            networkDescription += " between hosts";
          }
        } catch (const std::invalid_argument& e) {
          C10_THROW_ERROR(ValueError, e.what());
        } catch (const std::runtime_error& e) {
          C10_THROW_ERROR(DistBackendError, std::string("torus: cannot create group '") + groupName + "': " +
                                                e.what());
        }
      }
      if (config.transport == "ofi") {
        group.transport = std::shared_ptr<PolledTransport>(std::move(network));
        group.description = networkDescription;
      } else {
        TORUS_CHECK_ARG(!hostMembers.empty(), "transport ", config.transport, " needs the ranks' hosts");
        group.transport = std::make_shared<HybridTransport>(
            std::move(network), std::make_unique<ShmTransport>(rank, size, *rendezvous, hostMembers, messages, config.wait),
            group.sameHost);
        group.description = "shared memory inside each host, " + networkDescription;
      }
    }
  } catch (const CommError& e) {
    C10_THROW_ERROR(DistBackendError, std::string("torus: cannot create group '") + groupName + "': " + e.what());
  }
  return group;
}

} // namespace torus
