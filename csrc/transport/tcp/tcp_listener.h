// TcpListener: the socket a rank's TCP transport accepts its peers' connections on, opened before
// the transport so that its address can travel in the rank's record when the ranks of a group meet
// (rank 0 then publishes every rank's address at once, and no rank sets its own key). The
// transport takes the socket over; one never taken is closed with its listener.
#pragma once

#include <string>

namespace torus {

class TcpListener {
 public:
  // Listens on `address` (any free port) with room for `backlog` waiting connections. Throws
  // std::runtime_error.
  TcpListener(const std::string& address, int backlog);
  ~TcpListener();
  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;

  // "host:port", as peers connect to it.
  const std::string& address() const {
    return where_;
  }
  // The listening socket, now the caller's to close (closeSocket). Throws std::logic_error when
  // it was taken already.
  int release();

 private:
  int fd_ = -1;
  std::string where_;
};

} // namespace torus
