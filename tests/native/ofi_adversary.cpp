#include "ofi_adversary.h"

#include <rdma/fi_tagged.h>
#include <sched.h>

#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/ofi/fabric.h"

namespace py = pybind11;

namespace torus {

namespace {

class OfiAdversary {
 public:
  OfiAdversary(const std::string& provider, const std::string& address)
      : fabric_(std::make_unique<ofi::Fabric>(provider, address)) {}

  py::bytes name() const {
    return py::bytes(fabric().name());
  }

  std::string provider() const {
    return fabric().providerName();
  }

  // Sends `payload` tagged `tag` to the endpoint named `to`, making progress until the provider
  // reports the send complete (true) or `timeoutSeconds` pass (false: a message no receive takes
  // may never complete, with providers that wait for the receive; it stays posted until close).
  // Throws std::runtime_error when the send fails.
  bool send(const std::string& to, uint64_t tag, const std::string& payload, double timeoutSeconds) {
    ofi::Fabric& fabric = this->fabric();
    auto found = addresses_.find(to);
    const fi_addr_t address = found != addresses_.end() ? found->second : (addresses_[to] = fabric.insert(to));
    auto message = std::make_unique<Message>();
    message->bytes = payload;
    std::string why;
    if (fabric.registersLocal() &&
        !fabric.registerMemory(message->bytes.data(), message->bytes.size(), FI_SEND, &message->region, &why)) {
      throw std::runtime_error("registering the message: " + why);
    }
    message->posted.owner = message.get();
    Message* sent = message.get();
    inFlight_.push_back(std::move(message));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeoutSeconds);
    py::gil_scoped_release release;
    bool posted = false;
    while (std::chrono::steady_clock::now() < deadline) {
      if (!posted) {
        const ssize_t result = fi_tsend(fabric.endpoint(), sent->bytes.data(), sent->bytes.size(), sent->region.desc,
                                        address, tag, &sent->posted);
        if (result != 0 && result != -FI_EAGAIN) {
          throw std::runtime_error(std::string("the adversary's fi_tsend failed: ") +
                                   ofi::errorText(static_cast<int>(-result)));
        }
        posted = result == 0;
      }
      if (progress() == 0) {
        sched_yield();
      }
      if (posted && sent->state != 0) {
        break;
      }
    }
    if (sent->state < 0) {
      throw std::runtime_error("the adversary's send failed: " + sent->error);
    }
    return sent->state > 0;
  }

  // Makes progress for `seconds`: the provider answers what peers ask of this endpoint (an RMA
  // read of it).
  void progress(double seconds) {
    ofi::Fabric& fabric = this->fabric();
    (void)fabric;
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
    py::gil_scoped_release release;
    while (std::chrono::steady_clock::now() < until) {
      if (progress() == 0) {
        sched_yield();
      }
    }
  }

  // Closes the endpoint, then frees what was still being sent.
  void close() {
    if (fabric_) {
      for (auto& message : inFlight_) {
        fabric_->deregister(message->region);
      }
      fabric_.reset();
    }
    inFlight_.clear();
  }

  ~OfiAdversary() {
    close();
  }

 private:
  ofi::Fabric& fabric() const {
    if (!fabric_) {
      throw std::runtime_error("the adversary's endpoint is closed");
    }
    return *fabric_;
  }

  // A message being sent: its bytes live until its send completes or the endpoint closes.
  struct Message {
    ofi::Posted posted;
    std::string bytes;
    ofi::Region region;
    int state = 0; // 1: sent, -1: failed (error says why)
    std::string error;
  };

  // Reads completions; a message whose send ended goes. Returns how many were read.
  int progress() {
    ofi::Fabric& fabric = *fabric_;
    const int read = fabric.readCompletions(
        16, [](ofi::Posted* posted, size_t) { static_cast<Message*>(posted->owner)->state = 1; },
        [](ofi::Posted* posted, const std::string& why) {
          if (posted != nullptr) {
            auto* message = static_cast<Message*>(posted->owner);
            message->state = -1;
            message->error = why;
          }
        });
    // The last one is kept for send() to look at; it goes with the next.
    for (size_t i = 0; i + 1 < inFlight_.size();) {
      if (inFlight_[i]->state != 0) {
        fabric.deregister(inFlight_[i]->region);
        inFlight_.erase(inFlight_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    return read;
  }

  std::unique_ptr<ofi::Fabric> fabric_;
  std::unordered_map<std::string, fi_addr_t> addresses_;
  std::vector<std::unique_ptr<Message>> inFlight_; // the endpoint closes before they go
};

} // namespace

void defineOfiAdversary(py::module& module) {
  py::class_<OfiAdversary>(module, "OfiAdversary",
                           "A libfabric endpoint that sends crafted messages to a rank's endpoint (test_wire_ofi.py).")
      .def(py::init<const std::string&, const std::string&>(), py::arg("provider"),
           py::arg("address") = "127.0.0.1")
      .def_property_readonly("name", &OfiAdversary::name, "This endpoint's address, as bytes.")
      .def_property_readonly("provider", &OfiAdversary::provider)
      .def("send", &OfiAdversary::send, py::arg("to"), py::arg("tag"), py::arg("payload"),
           py::arg("timeout") = 30.0,
           "Sends payload tagged tag to the endpoint named to; whether its send completed within timeout.")
      .def("progress", py::overload_cast<double>(&OfiAdversary::progress), py::arg("seconds"),
           "Makes progress for seconds: the provider answers what peers ask of this endpoint.")
      .def("close", &OfiAdversary::close);
}

} // namespace torus
