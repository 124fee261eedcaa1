#include "transport/sockets.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <mutex>
#include <set>
#include <stdexcept>

namespace torus {

namespace {

class ForkedChildSockets {
 public:
  static ForkedChildSockets& instance() {
    // Never destroyed: fork handlers outlive static destructors.
    static ForkedChildSockets* sockets = [] {
      ::pthread_atfork(&beforeFork, &inParent, &inChild);
      return new ForkedChildSockets();
    }();
    return *sockets;
  }
  void add(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    fds_.insert(fd);
  }
  void remove(int fd) {
    std::lock_guard<std::mutex> lock(mutex_);
    fds_.erase(fd);
  }

 private:
  static void beforeFork() {
    instance().mutex_.lock();
  }
  static void inParent() {
    instance().mutex_.unlock();
  }
  // In the child, with only async-signal-safe calls.
  static void inChild() {
    ForkedChildSockets& sockets = instance();
    const int devNull = ::open("/dev/null", O_RDWR | O_CLOEXEC);
    if (devNull >= 0) {
      for (int fd : sockets.fds_) {
        ::dup3(devNull, fd, O_CLOEXEC);
      }
      ::close(devNull);
    }
    sockets.mutex_.unlock();
  }

  std::mutex mutex_;
  std::set<int> fds_;
};

std::string systemError(const std::string& what, int error) {
  return what + ": " + std::strerror(error);
}

} // namespace

sockaddr_storage parseAddress(const std::string& host, int port, socklen_t* length) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV;
  addrinfo* result = nullptr;
  const std::string service = std::to_string(port);
  if (::getaddrinfo(host.c_str(), service.c_str(), &hints, &result) != 0 || result == nullptr) {
    throw std::invalid_argument("torus: cannot resolve address '" + host + "'");
  }
  sockaddr_storage address{};
  std::memcpy(&address, result->ai_addr, result->ai_addrlen);
  *length = result->ai_addrlen;
  ::freeaddrinfo(result);
  return address;
}

std::string formatAddress(const sockaddr_storage& address) {
  char host[INET6_ADDRSTRLEN] = {0};
  if (address.ss_family == AF_INET6) {
    const auto& v6 = reinterpret_cast<const sockaddr_in6&>(address);
    ::inet_ntop(AF_INET6, &v6.sin6_addr, host, sizeof(host));
    return "[" + std::string(host) + "]:" + std::to_string(ntohs(v6.sin6_port));
  }
  const auto& v4 = reinterpret_cast<const sockaddr_in&>(address);
  ::inet_ntop(AF_INET, &v4.sin_addr, host, sizeof(host));
  return std::string(host) + ":" + std::to_string(ntohs(v4.sin_port));
}

sockaddr_storage parseHostPort(const std::string& where, socklen_t* length) {
  const auto colon = where.rfind(':');
  std::string host = where.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  return parseAddress(host, std::stoi(where.substr(colon + 1)), length);
}

int listenOn(const std::string& address, int backlog, std::string* where) {
  socklen_t length = 0;
  sockaddr_storage bindAddress = parseAddress(address, 0, &length);
  const int fd = ::socket(bindAddress.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    throw std::runtime_error(systemError("torus: socket", errno));
  }
  keepFromForkedChildren(fd);
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (::bind(fd, reinterpret_cast<sockaddr*>(&bindAddress), length) != 0) {
    const int error = errno;
    closeSocket(fd);
    throw std::runtime_error(systemError("torus: cannot listen on address '" + address + "'", error));
  }
  // The kernel caps the backlog at net.core.somaxconn.
  if (::listen(fd, backlog) != 0) {
    const int error = errno;
    closeSocket(fd);
    throw std::runtime_error(systemError("torus: listen", error));
  }
  sockaddr_storage bound{};
  length = sizeof(bound);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&bound), &length);
  *where = formatAddress(bound);
  return fd;
}

bool unacknowledged(int fd) {
  int bytes = 0;
  return ::ioctl(fd, SIOCOUTQ, &bytes) == 0 && bytes > 0;
}

void keepFromForkedChildren(int fd) {
  ForkedChildSockets::instance().add(fd);
}

void closeSocket(int fd) {
  if (fd >= 0) {
    ForkedChildSockets::instance().remove(fd);
    ::close(fd);
  }
}

} // namespace torus
