// MessageOptions: the message layer's flow control (see message_transport.h), apart so that
// configuration can name it without the layer.
#pragma once

#include <cstddef>

namespace torus {

struct MessageOptions {
  // Largest message sent before its receive is posted.
  size_t eagerBytes = 512 * 1024;
  // Payload a rank may hold per peer for messages it has not asked for.
  size_t eagerWindowBytes = 4 * 1024 * 1024;
};

} // namespace torus
