#include "transport/group_secret.h"

#include <sys/random.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "transport/sockets.h"

namespace torus {

namespace {

void fillRandom(uint8_t* out, size_t n) {
  for (size_t done = 0; done < n;) {
    const ssize_t got = ::getrandom(out + done, n - done, 0);
    if (got < 0 && errno != EINTR) {
      throw std::runtime_error(std::string("torus: no random bytes for the group's secret: ") + std::strerror(errno));
    }
    done += got > 0 ? static_cast<size_t>(got) : 0;
  }
}

void appendInt(std::string& message, int value) {
  const int32_t v = value;
  message.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

} // namespace

Nonce freshNonce() {
  Nonce nonce;
  fillRandom(nonce.data(), nonce.size());
  return nonce;
}

Digest prove(const std::string& secret, const char* purpose, int from, int to, const Nonce& nonce,
             const std::string& carried) {
  std::string message(purpose);
  message += '\0';
  appendInt(message, from);
  appendInt(message, to);
  message.append(reinterpret_cast<const char*>(nonce.data()), nonce.size());
  message += carried;
  return hmacSha256(secret, message);
}

bool Gatekeeper::admits(const char* purpose, int from, const Nonce& nonce, const Digest& proof,
                        const std::string& carried) {
  return sameDigest(proof, prove(secret_, purpose, from, rank_, nonce, carried)) && seen_.insert(nonce).second;
}

std::string foreignHello(uint32_t magic, int rank, int size) {
  return "its hello is none of this group's: magic " + std::to_string(magic) + ", rank " + std::to_string(rank) +
         ", size " + std::to_string(size);
}

std::string unprovenHello(int rank) {
  return "its hello as " + rankName(rank) + " has a wrong proof, or was replayed";
}

std::string peerAddress(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    return "an unknown address";
  }
  return formatAddress(address);
}

} // namespace torus
