// Lifelines: a TCP connection to each peer a rank talks to over the fabric, which carries no data,
// only the peer's last word: no libfabric provider reliably reports a peer that died (measured,
// BENCHMARKS.md), but the kernel closes a dead process's sockets at once, and keepalive probes
// find a host that went down.
//
// The rank that first needs a peer dials it (a Hello: magic, rank, group size, a nonce and the
// proof that it knows the group's secret: group_secret.h), and writes that Hello before it posts
// anything on the fabric to the peer (helloSent); the peer accepts whenever it next makes
// progress, and answers with a proof of its own over the nonce, which comes before anything else
// it writes on that line. A line whose hello is wrong, unproven or replayed, or that sends none in
// time, is closed, counted and reported on stderr; a dialed line whose answer is unproven ends its
// peer. A rank that leaves or gives up writes a Farewell on each of
// its lifelines — goodbye or fault, the bytes it put on the fabric stream to that peer and those
// it read from the peer's, and why — then closes them; one that dies just closes them. So a
// peer knows how much of the stream to read before the end is the end, which of its sends
// arrived, and why the peer went when it can say.
#pragma once

#include <poll.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "transport/group_secret.h"
#include "transport/departure.h"

namespace torus::ofi {

struct Farewell {
  enum Kind : uint32_t { kGoodbye = 1, kFault = 2 };
  Kind kind = kGoodbye;
  uint64_t streamBytes = 0; // what the peer wrote on its fabric stream to this rank, in all
  // What the peer read of this rank's stream: those sends are delivered even where the fabric
  // reports their completion only after the peer's endpoint closed (rxm over tcp does).
  uint64_t readBytes = 0;
  std::string why; // kFault: the reason the peer gave up; kGoodbye: goodbyeWhy of how it left
};

// A goodbye's text: how the rank leaves (empty: it destroyed its group).
std::string goodbyeWhy(Departure departure);

class Lifelines {
 public:
  // Listens on `address` (any free port); a line accepted is closed unless its hello, proving
  // `secret`, comes within `helloWait`. Throws std::runtime_error.
  Lifelines(const std::string& address, int rank, int size, const std::string& secret,
            std::chrono::milliseconds helloWait);
  ~Lifelines();

  // "host:port" peers dial.
  const std::string& where() const {
    return where_;
  }
  // Starts a lifeline to `peer`, listening at `where`, without blocking.
  void dial(int peer, const std::string& where);
  // Accepts lifelines, reads hellos and farewells, finishes dials, notices closed ones, without
  // blocking; true when a peer ended since the last check (also where dial or helloSent ended it).
  bool check();
  // Every line this rank dialed to `peer` has its Hello written (or the peer ended), finishing
  // dials that connected since, without blocking. A dialer says nothing on the fabric before:
  // a peer that hears from it can then always tell when it dies (the Hello reaches the peer's
  // kernel before the dialer's end does), also where it dies before its next check().
  bool helloSent(int peer);
  // The descriptors a sleep should watch for check().
  void watch(std::vector<pollfd>& fds) const;
  // A peer is dialing this rank, or its Hello has not been read: progress must be made to
  // answer it (also on a rank whose group failed, which tells it why).
  bool peerWaiting() const;

  // The peer's lifeline closed (it exited, was killed, left or gave up), or could not be made.
  bool ended(int peer) const {
    return peers_[peer].ended;
  }
  // Why, when the peer ended without a farewell.
  const std::string& endedWhy(int peer) const {
    return peers_[peer].why;
  }
  const std::optional<Farewell>& farewell(int peer) const {
    return peers_[peer].farewell;
  }

  // This rank's last word to `peer`, on each of its lifelines, also those made later (best
  // effort, once).
  void sayFarewell(int peer, const Farewell& farewell);
  // Closes every lifeline, first waiting (at most `linger`) until the peers' kernels have the
  // farewells: closing a socket with unread bytes resets it, and a reset drops what the kernel
  // has not delivered yet.
  void closeAll(std::chrono::milliseconds linger);

 private:
  struct Line {
    int fd = -1;
    bool connecting = false; // dialed, not connected yet
    bool dialed = false; // by this rank, and connected
    bool helloRead = false; // accepted: its Hello arrived; dialed: the peer's proof of accepting it
    bool saidFarewell = false;
    Nonce nonce; // dialed: of its Hello
    std::string where; // dialed: the peer's address
    std::chrono::steady_clock::time_point deadline; // accepted: for its Hello
    std::string inbound; // accepted, before the Hello: its bytes; else the farewell's
  };
  struct Peer {
    std::vector<Line> lines;
    bool ended = false;
    std::string why;
    std::optional<Farewell> farewell; // the peer's
    std::string farewellBytes; // this rank's, once said: every line of the peer gets it
  };

  // Reads what the line holds; false when it closed or broke, or (*unproven then says why) its
  // peer did not prove it belongs to the group.
  bool readLine(Line& line, int* peer, std::string* unproven);
  void end(int peer, const std::string& why);
  // A dialed line whose connect ended: writes its Hello. False when the peer refused it (ended).
  bool finishDial(int peer, Line& line);
  void deliverFarewell(Peer& p, Line& line);

  const int rank_;
  const int size_;
  const std::chrono::milliseconds helloWait_;
  Gatekeeper gate_;
  int listenFd_ = -1;
  std::string where_;
  std::vector<Peer> peers_;
  std::vector<Line> unknown_; // accepted, Hello not read yet
  bool endedUnreported_ = false; // a peer ended that check() has not reported
};

} // namespace torus::ofi
