// The OFI transport in a build without libfabric (setup.py compiles transport/ofi/ only when it
// finds libfabric).
#include <stdexcept>

#include "transport/ofi/ofi_transport.h"

namespace torus {

bool ofiBuilt() {
  return false;
}

std::unique_ptr<MessageTransport> makeOfiTransport(int rank, int size, std::shared_ptr<Rendezvous> rendezvous,
                                                   const OfiOptions& options, std::string* description) {
  throw std::invalid_argument(
      "TORUS_TRANSPORT=ofi: this torch_torus was built without libfabric. Install it (Debian/Ubuntu: "
      "apt install libfabric-dev; on a cluster, load the site's libfabric so that pkg-config finds it, or "
      "set TORUS_OFI_HOME to its prefix) and reinstall torch_torus (pip install --no-build-isolation -e .)");
}

} // namespace torus
