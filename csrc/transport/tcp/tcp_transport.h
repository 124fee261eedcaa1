// TcpTransport: TCP connections between ranks, under the message layer (MessageTransport), which
// frames, matches and flow-controls the messages on them.
//
// Connections are made when first needed: the first send to a peer, or receive from it, starts
// one (a receive from any peer starts none: its sender connects), and the messages wait in the
// message layer until it is up. So a rank whose algorithms talk to k peers holds k sockets, not
// size - 1, and setup reads no peer's address: each rank's is published ("tcp/<rank>"; by rank 0
// for all when their listeners were opened before the ranks met) and a peer's is read once, when
// a connection to it is first made.
//
// Handshake: the connecting rank sends a Hello (magic, its rank, the group's size, a nonce and
// the proof that it knows the group's secret: group_secret.h); the accepting rank answers with a
// Verdict (accepted, with its own proof over the nonce; refused; or "I gave up on the group:
// <why>", which a rank whose group failed or aborted gives every rank that connects until it is
// destroyed), and only an accepted socket carries messages. Nothing is written to a socket before
// its hello is proven: one whose hello is wrong, unproven or replayed, or that sends none within
// the timeout, is closed unanswered, counted and reported on stderr with the address it came from
// (at a bounded rate: turned_away_log.h). Two ranks may connect
// to each other at once; then both keep the connection the lower rank made and refuse the other.
// A refused rank waits for that connection, trying again now and then in case its peer gave up.
// A peer that refuses to connect at all (its listening socket is gone: it exited, was killed or
// left the group) fails the group naming it, where gloo's lazy connections wait forever.
//
// A payload the receiver has not asked for waits in the sender's buffer past the eager window, so
// the kernel's flow control holds the rest.
//
// Progress has no thread of its own: whichever thread waits drives all pending sends and
// receives, and the connections being made (the process's progress helper does when nobody
// waits); other waiters sleep until it has moved something. Waits spin for a few tens of
// microseconds, yielding the core, then sleep in poll(), so oversubscribed hosts are not burned
// by spinning.
#pragma once

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/group_secret.h"
#include "transport/message_transport.h"
#include "transport/rendezvous.h"
#include "transport/tcp/tcp_listener.h"

namespace torus {

struct TcpOptions {
  // Address to listen on and to publish to peers, e.g. "127.0.0.1" or an interface's address.
  std::string address = "127.0.0.1";
  // Bounds making each connection, from the first request that needs it.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  MessageOptions messages;
  // The group's secret (transport/group_secret.h), which every connection's handshake proves.
  std::string secret;
  // The socket to accept on, opened when the ranks met, its address published for this rank
  // ("tcp/<rank>") by rank 0; null: the transport listens on `address` and publishes its own.
  std::shared_ptr<TcpListener> listener;
};

class TcpTransport : public MessageTransport {
 public:
  // Peers' addresses are looked up in `rendezvous` when first needed where it allows that from
  // any thread; otherwise every peer's is read here.
  TcpTransport(int rank, int size, std::shared_ptr<Rendezvous> rendezvous, const TcpOptions& options);
  ~TcpTransport() override;

  struct Pair;
  // An accepted socket whose Hello has not been answered yet.
  struct Incoming {
    int fd = -1;
    Deadline deadline;
    char hello[60];
    size_t helloRead = 0;
  };

 private:
  // A connection this rank is making to a peer.
  struct Dial {
    enum class Step { kLookUp, kConnect, kAwaitVerdict, kRefused } step = Step::kLookUp;
    int fd = -1;
    Deadline deadline;
    Clock::time_point nextTry; // kRefused: when to connect again; kLookUp: the sleep's latest wake
    int tries = 0;
    int error = 0; // kConnect: connect's own error, when it failed at once
    std::string verdict; // kAwaitVerdict: the bytes read so far
    Nonce nonce; // of the hello sent, which the acceptance proves over
  };
  void wantLink(int peer) override;
  bool hasOwnWork() const override;
  bool checkPeers() override;
  bool sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) override;
  void wakeSleeper() override;
  void announceAbort(const std::string& why) override;

  // One non-blocking step on every connection being made or accepted; true when a Link was
  // attached or a peer failed.
  bool advanceConnections();
  bool advanceDial(int peer, Dial& dial);
  // Accepts the connections waiting and reads their hellos: answers those complete, and closes
  // those broken, silent past the timeout or unproven without a byte written to them; true when
  // one became a Link.
  bool advanceIncoming();
  void acceptWaiting();
  // A Hello arrived on an accepted socket: links it (true), or answers it that this rank refuses
  // it or gave up on the group (a proven one), or turns it away. Takes the socket (its fd then -1)
  // where it linked it or must still deliver the answer (halfMade_).
  bool answerHello(Incoming& incoming);
  void link(int peer, int fd);
  // Pushes out the pairs' farewells and waits until the peers' kernels have them, for at most
  // kFarewellLinger.
  void deliverFarewells();

  const std::chrono::milliseconds timeout_;
  Gatekeeper gate_;
  // Set where peers' addresses are looked up when first needed.
  std::unique_ptr<PublishedLookups> addressLookups_;
  std::vector<std::string> addresses_; // by rank; empty until known
  int listenFd_ = -1;
  int wakeFd_ = -1;
  std::vector<std::unique_ptr<Pair>> pairs_; // indexed by peer rank; null until connected
  std::vector<Pair*> linked_; // the pairs connected, in the order they were
  std::unordered_map<int, Dial> dials_; // connections this rank is making, by peer
  std::vector<Incoming> incoming_; // accepted sockets whose Hello has not been answered
  // Connections half made when the group failed: told why, they wait to be closed.
  std::vector<int> halfMade_;
};

} // namespace torus
