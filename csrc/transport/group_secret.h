// The group's secret, and the proofs of it that every hello carries (docs/security.md).
//
// Rank 0 draws 32 random bytes when the ranks meet in the group's store (torch_torus/topology.py)
// and hands them to every rank with the meeting's result. A connection's hello
// carries a nonce of its sender's and HMAC-SHA256(secret, what it is | sender | receiver | nonce
// | what it carries): the receiver checks the proof and that it never saw the nonce, so a hello
// taken off the wire and sent again fails as one made up does. An answer that makes a connection
// proves itself the same way over the hello's nonce, which the answerer cannot have seen before.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "transport/hmac.h"
#include "transport/rendezvous.h"
#include "transport/turned_away_log.h"

namespace torus {

constexpr size_t kNonceBytes = 16;
using Nonce = std::array<uint8_t, kNonceBytes>;

// The length of the group's secret.
constexpr size_t kSecretBytes = 32;

// Bytes from the kernel's random source.
Nonce freshNonce();

// What `from` sends `to` to prove it knows `secret`: `purpose` names the message (a TCP hello, a
// lifeline's, ...) so that no proof passes for another's.
Digest prove(const std::string& secret, const char* purpose, int from, int to, const Nonce& nonce,
             const std::string& carried = "");

// A transport's door: checks the proofs its peers' hellos carry, remembers their nonces, and
// counts and reports the connections it turned away (turned_away_log.h).
class Gatekeeper {
 public:
  // `what`: what it turns away ("TCP connection", ...).
  Gatekeeper(std::string secret, int rank, const char* what)
      : secret_(std::move(secret)), door_(TurnedAwayLog::open(rank, what)), rank_(rank) {}

  const std::string& secret() const {
    return secret_;
  }
  // Whether a hello of `purpose` that says it comes from `from`, with `nonce` and `proof`, does,
  // and is no replay (its nonce is then remembered).
  bool admits(const char* purpose, int from, const Nonce& nonce, const Digest& proof,
              const std::string& carried = "");
  // Counts a connection turned away and warns on stderr, saying where it came from and why, at
  // a bounded rate and from another thread: it never writes itself.
  void turnAway(const std::string& from, const std::string& why) {
    TurnedAwayLog::turnedAway(door_, from, why);
  }

 private:
  const std::string secret_;
  const std::shared_ptr<TurnedAwayLog::Door> door_;
  const int rank_;
  std::set<Nonce> seen_;
};

// What a rank that dials a TCP connection (the TCP transport's, a lifeline) sends first; `magic`
// says whose connection it is, and each sets its own `purpose` for the proof.
struct Hello {
  uint32_t magic;
  int32_t rank;
  int32_t size;
  Nonce nonce;
  Digest proof; // prove(purpose, rank, the rank dialed, nonce)

  // Whether it says it is a hello of `magic`'s kind from another rank than `receiver` of a group
  // of `groupSize` ranks (what it proves is Gatekeeper::admits's).
  bool fits(uint32_t kind, int receiver, int groupSize) const {
    return magic == kind && size == groupSize && rank >= 0 && rank < groupSize && rank != receiver;
  }
};

// Why a hello was turned away: it is no hello of this group's (its magic, rank or size)...
std::string foreignHello(uint32_t magic, int rank, int size);
// ... or its proof is wrong, or it was replayed.
std::string unprovenHello(int rank);

// "host:port" of a connected socket's peer, or "an unknown address".
std::string peerAddress(int fd);

} // namespace torus
