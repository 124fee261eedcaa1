// CallbackRendezvous: a Python store's set and get as a Rendezvous, for the test hooks
// (subset_comms.cpp, device_collectives_on_host.cpp) that build transports without a backend.
#pragma once

#include <functional>
#include <string>

#include <pybind11/pybind11.h>

#include "transport/rendezvous.h"

namespace torus {

// Hidden, as pybind11's own types are: it holds pybind11 objects.
class __attribute__((visibility("hidden"))) CallbackRendezvous : public Rendezvous {
 public:
  using Set = std::function<void(const std::string&, const std::string&)>;
  using Get = std::function<pybind11::bytes(const std::string&)>;
  CallbackRendezvous(Set set, Get get) : set_(std::move(set)), get_(std::move(get)) {}
  void set(const std::string& key, const std::string& value) override {
    set_(key, value);
  }
  std::string get(const std::string& key) override {
    return get_(key);
  }

 private:
  Set set_;
  Get get_;
};

} // namespace torus
