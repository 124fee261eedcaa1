// MessageTransport: the message layer every byte-moving transport (TCP sockets, shared-memory
// rings) sits under. It owns, once, what makes bytes into tagged messages: matching receives to
// messages (per peer and from any peer, first-in first-out per tag), the queue of messages nobody
// has asked for yet, call-signature checks and probes, flow control, and failing every request
// when a peer fails or the group aborts. A transport gives it one Link per peer and a way to
// sleep until something happens.
//
// On each Link, a message is a 64-byte header (WireHeader) and, for some kinds, a payload:
//   eager            header + payload: the sender does not wait for the receive.
//   ready-to-send    header only: the payload waits in the sender's buffer. The receiver answers
//                    once a receive matches it: clear-to-send (the sender then sends a data frame,
//                    header + payload, straight into the receive's buffer) or, when the header
//                    carries the buffer's address and the Link reads the peer's memory, by
//                    reading it directly (the header also carries the key the sender's Link lent
//                    it with) and sending done, which ends the loan.
//   done             completes a ready-to-send send without data (read directly, or refused).
//   unread           fails a ready-to-send send whose payload the receiver could not read
//                    directly (payload: why; the sender's buffer may have been freed meanwhile).
//   credit           returns eager bytes the receiver has consumed.
//   probe            "I wait for you in the collective tagged <sequence> with this call".
//   goodbye / fault  the sender destroyed its group / gave up on it (payload: why).
//
// Flow control: a message goes eager only when it is at most eagerBytes and the sender's eager
// bytes not yet credited back stay within eagerWindowBytes; every other message waits for its
// receive. So a rank holds at most eagerWindowBytes of payload per peer that it has not asked
// for, however far ahead the peer runs, and the kernel's own flow control is never defeated.
//
// A send completes once its Link has handed its last byte on for good (Link::sentBytes): to the
// kernel for sockets and shared memory as soon as it is written, to the fabric when its send
// completes for OFI. So a rank that returns from a collective and dies leaves nothing undelivered
// that its peers wait for, as with TCP.
//
// Ordering: matching happens when a header arrives, in stream order, so messages of one tag
// between two ranks match receives in the order they were sent whichever protocol each took.
#pragma once

#include <chrono>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "transport/link.h"
#include "transport/message_options.h"
#include "transport/polled_transport.h"

namespace torus {

enum FrameKind : uint32_t {
  kEagerFrame = 1,
  kReadyToSendFrame,
  kClearToSendFrame,
  kDataFrame,
  kDoneFrame,
  kCreditFrame,
  kProbeFrame,
  kGoodbyeFrame,
  kFaultFrame,
  kUnreadFrame,
};
// A fault or unread frame's text is cut to this.
constexpr size_t kFaultTextBytes = 1024;

// The header of every frame on a Link.
struct WireHeader {
  uint64_t tag = 0;
  uint64_t nbytes = 0; // the message's size (eager, ready-to-send, data) or the fault or unread text's
  uint64_t sequence = 0; // ready-to-send and its answers: which send; credit: bytes; probe: tag
  uint64_t address = 0; // ready-to-send: the payload's address, when the peer may read it
  CallSignature call;
  uint32_t kind = 0;
  uint32_t reserved = 0;
  uint64_t key = 0; // ready-to-send with an address: what the Link lent the payload with
};
static_assert(sizeof(WireHeader) == 64, "a frame header is one cache line");

class MessageTransport : public PolledTransport {
 public:
  MessageTransport(int rank, int size, MessageOptions options);
  ~MessageTransport() override;

  int rank() const final {
    return rank_;
  }
  int size() const final {
    return size_;
  }

  RequestPtr isend(int peer, uint64_t tag, const CallSignature& call, const void* buf, size_t nbytes) final;
  RequestPtr irecv(int peer, uint64_t tag, const CallSignature& call, void* buf, size_t nbytes) final;
  void abort(const std::string& why) final;
  std::optional<StrayMessage> strayMessage(uint64_t upToTag) final;

 protected:
  // A transport's sleep with nothing to do ends after this, so that the idle checks run.
  static constexpr int kIdleCheckMs = 100;
  // How long destroying a transport waits at most for its last words (a fault or goodbye frame,
  // a farewell) to reach the peers: closing a socket with unread bytes resets the connection,
  // and a reset drops what the kernel has not delivered yet.
  static constexpr auto kFarewellLinger = std::chrono::seconds(1);

  // Makes `peer` reachable through `link`, which the transport owns and keeps until destroyed.
  void attach(int peer, Link* link);
  // Makes `peer` reachable before it has a Link: its messages wait until the transport attaches
  // one, which it is asked for (wantLink) when the first send or receive for the peer is posted.
  void addPeer(int peer);

  // ---- What a transport implements. All run with mutex_ held. ----
  // Sleeps (lock released) until something may have happened on a Link or the deadline;
  // false when nothing happened at all (the layer then runs its idle checks and whenIdle()).
  virtual bool sleep(std::unique_lock<std::mutex>& lock, Deadline deadline) = 0;
  // Before each attempt on the Links: looks for peers that failed out of band; true when one did.
  virtual bool checkPeers() {
    return false;
  }
  // After a sleep in which nothing happened.
  virtual void whenIdle() {}
  // abort(): tells the peers why, before their requests fail.
  virtual void announceAbort(const std::string& why) = 0;
  // abort() was called, by any thread, before it takes mutex_ (without it): a wait of the
  // transport's that holds mutex_ ends now.
  virtual void abortRequested() {}
  // Whether a look at every Link costs no system call (then strayMessage reads them first).
  virtual bool readsCheaply() const {
    return false;
  }
  // A send to or receive from `peer`, added without a Link, was posted: the transport starts
  // making one (and attaches it, or fails the peer), without blocking.
  virtual void wantLink(int peer) {}
  // Work of the transport's own that needs progress driven though no request is pending (a
  // peer waiting for this rank to accept its connection).
  virtual bool hasOwnWork() const {
    return false;
  }

  // A frame of the transport's own, as bytes for a Link: a header of `kind`, then `text` as its
  // payload.
  static std::string ownFrame(FrameKind kind, const std::string& text = "");
  // The goodbye frame this process says now (its sequence: the Departure).
  static std::string goodbyeFrame();
  // A fault frame saying `why` (cut to kFaultTextBytes).
  static std::string faultFrame(const std::string& why);

  // ---- What transports call, with mutex_ held. ----
  // One non-blocking attempt on every peer's Link; true when a request completed.
  bool tryAll() final;
  // One non-blocking attempt on one peer's Link; true when a request completed.
  bool tryPeer(int peer);
  // The peer has frames waiting to go out.
  bool wantsToWrite(int peer) const;
  // No frame to `peer` is partly written: a transport's own frame may go between.
  bool betweenFrames(int peer) const;
  // A copy of the unwritten rest of the frame partly written to `peer` (also of one whose send
  // failed with the group): what must go out before the stream can carry a transport's own frame.
  // Empty between frames.
  std::string restOfFrame(int peer) const;
  // Why `peer` failed; empty while it has not.
  const std::string& peerFailure(int peer) const;
  // `peer` may still hear from this rank: it did not fail or leave itself (it may have failed
  // with the group, for another peer's failure).
  bool canTell(int peer) const;
  // `peer` died or broke the group: every request of every peer fails naming it.
  void failPeer(int peer, const std::string& why);
  // `peer`'s stream ended, broke or could not be made, without a word of why. A rank that gives
  // up tells every peer it can why, so another peer may be telling this rank the cause while
  // this is only a consequence: for at most kReasonGrace the other peers are read for a reason,
  // which then fails the group in its place; then failPeer.
  void peerVanished(int peer, const std::string& why);
  // `peer` left (destroyed its group): its requests fail, the others live on.
  void peerLeft(int peer, const std::string& why);
  // Fails posted receives of `tag` whose call disagrees with `call`, which `sender` runs there;
  // true when one failed.
  bool failDisagreeing(int sender, uint64_t tag, const CallSignature& call);
  // The call of the oldest message of `tag` from `peer` that nobody asked for, after reading
  // what the peer's Link holds.
  std::optional<CallSignature> arrivedCall(int peer, uint64_t tag);
  const std::string& abortReason() const {
    return abortReason_;
  }
  // Why the group failed here (aborted, or a peer failed it); empty while it has not. A peer
  // that left (destroyed its group) fails only its own requests and is no failure of the group.
  const std::string& groupFailure() const {
    return abortReason_.empty() ? failure_ : abortReason_;
  }

 private:
  struct Op;
  struct Frame;
  struct Held;
  struct Peer;

  void progress(std::unique_lock<std::mutex>& lock, Deadline deadline) final;
  bool hasPending() const final;
  // The peer, after asking the transport for a Link if it has none.
  Peer& linkedPeer(int rank);
  bool trySend(Peer& peer);
  // Completes the sends whose bytes the Link has handed on for good; true when one completed.
  bool confirmSends(Peer& peer);
  bool tryRecv(Peer& peer);
  // Moves the reads of the peer's lent memory on; true when one ended (done, or failed).
  bool advanceReads(Peer& peer);
  // tryRecv by a thread that is not driving progress (it wakes the one that is).
  void readOutOfTurn(Peer& peer);
  // Queues a frame and pushes it out at once where the Link takes it.
  void queue(Peer& peer, Frame frame);
  // A complete header arrived; true when a request completed.
  bool onHeader(Peer& peer);
  // The payload that followed it arrived; true when a request completed.
  bool onPayload(Peer& peer);
  // A message (ready-to-send) matched receive `op`: fetches its payload or asks for it.
  void answerReadyToSend(Peer& peer, const std::shared_ptr<Op>& op, const WireHeader& header, bool accepted);
  // Consumed eager payload: returned to the sender once enough has gathered.
  void credit(Peer& peer, size_t nbytes);
  std::shared_ptr<Op> matchPosted(Peer& peer, uint64_t tag);
  bool takeHeld(Peer& peer, const std::shared_ptr<Op>& op);
  void failPending(Peer& peer, CommError::Kind kind, const std::string& why);
  // The peer read the send's payload or never will: the Link's loan of it ends.
  void endLoan(Peer& peer, Op& op);
  // The peer sent `what`, which the protocol never sends (a corrupt or forged frame): fails it,
  // as a peer failure, before anything of the frame is written or acted on; returns true.
  bool brokeProtocol(Peer& peer, const std::string& what);
  void peerClosed(Peer& peer);
  void checkHeldCalls();
  void probeWaits();

  const int rank_;
  const int size_;
  const MessageOptions options_;
  std::vector<std::unique_ptr<Peer>> peers_; // indexed by rank; null for self and unreachable
  // The peers that have a Link or have been asked for one: what progress, idle checks and stray
  // checks look at, so their cost grows with the peers an algorithm uses, not the group's size.
  std::vector<Peer*> used_;
  std::map<uint64_t, std::deque<std::shared_ptr<Op>>> anyPeerReceives_;
  std::string abortReason_;
  std::string failure_; // the first failPeer's reason
  bool awaitingReason_ = false; // in peerVanished's grace
};

} // namespace torus
