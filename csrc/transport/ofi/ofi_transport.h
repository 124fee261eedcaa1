// OfiTransport: libfabric (OFI) reliable-datagram endpoints between ranks, under the message
// layer (MessageTransport), which frames, matches and flow-controls the messages — so every
// contract of the TCP transport (order per pair and tag, exact sizes, call signatures checked,
// deadlines, abort that tells every peer, a dead peer named, bounded memory for messages nobody
// asked for) holds over any provider: tcp, verbs, psm2/3, cxi, efa, shm.
//
// Each pair of ranks has a stream each way: the sender copies the layer's bytes into chunks of
// kChunkBytes (32 KiB) and sends each with fi_tsend tagged (kStreamTag | sender), into one of
// kSlots (32) receive buffers the receiver keeps posted for it. The provider keeps sends between
// two endpoints in order (FI_ORDER_SAS), so chunks fill the slots in the order they were posted.
// A sender holds one credit per free slot of the receiver and sends no chunk without one; the
// receiver reposts a slot once the layer has read it and returns the credits (kControlTag |
// receiver, 8 bytes) once half the slots are free again. So at most kSlots chunks per peer wait
// anywhere, whatever the peer does. A send completes when the sends of its chunks have
// (Link::sentBytes): then the bytes reach the peer even if this process dies.
//
// Large messages: where the provider offers RMA reads, a message above rmaAbove is lent (its
// buffer registered, FI_REMOTE_READ) and announced with its address and key; the receiver reads
// it with fi_read, 4 MiB at a time, into memory of the stream's own, copies that into the
// receive's buffer, and answers done, which ends the loan. No copy on the sender's side; the
// receiver's one copy is what makes a read given up on safe: it may still land later (a peer
// that serves it late, a provider that finishes it), but never in a buffer its failed receive
// gave back. Elsewhere it goes as a stream of chunks once the receive is posted. Nothing waits
// for the read with the transport's lock held: the layer starts it (Link::startRead) and moves
// it on, one piece at a time, on each pass of its progress loop (continueRead), which releases
// the lock between passes. Each read is bounded by the group's timeout, by the peer's lifeline
// (looked at on every step) and by abort().
// Providers that carry RMA over their sockets stream instead by default.
//
// Setup: each rank publishes "ofi/<rank>" (its lifeline's address and its endpoint's name). The
// first send to or receive from a peer looks it up, inserts it in the address vector, posts the
// slots for it and sends it a hello (kHelloTag, its rank and name) so that the peer makes its
// side without a lookup. A rank keeps receives posted only for the peers it talks to, and where the
// provider directs receives (FI_DIRECTED_RECV, Fabric::directsReceives) each takes chunks and
// credits from the peer's endpoint alone: an endpoint that never proved a hello may send to this
// rank, but nothing it sends is taken.
//
// Dead peers: no provider reliably reports one (BENCHMARKS.md), so each pair also holds a TCP
// lifeline (ofi/lifelines.h) and nothing more is posted to a peer whose lifeline closed, on any
// path (data, credits, hellos, farewells): the shm provider may spin forever on a send to a dead
// peer. A goodbye on the lifeline (the peer destroyed its group) is the peer leaving, also when
// its stream was cut mid-frame or never made. The shm provider keeps each endpoint in a named
// segment of /dev/shm, which it removes only when the endpoint closes: the name goes once every
// peer has sent this rank something (so has the segment open), and a peer that died without a
// farewell has its segment removed by the ranks that talked to it once its process is gone.
//
// Progress is manual: whichever thread waits reads the completion queue; it sleeps in poll() on
// the queue's wait descriptor (fi_trywait), the lifelines and a wake-up eventfd; a provider
// without a wait descriptor is polled with a short sleep. No send is injected (fi_tinject): a
// provider may hold an injected message until it next makes progress, and only a completion
// tells this rank that it must keep making it (the process's progress helper does while a
// send is out, when no thread waits).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "transport/message_transport.h"
#include "transport/rendezvous.h"

namespace torus {

struct OfiOptions {
  // libfabric provider ("tcp", "verbs", "shm", ...); empty: libfabric's first that fits
  // (FI_PROVIDER narrows it).
  std::string provider;
  // The address this rank's endpoint and lifeline bind to and publish.
  std::string address = "127.0.0.1";
  // Bounds looking up and reaching each peer, from the first request that needs it.
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  // Messages above this go by RMA reads where the provider offers them; unset: 256 KiB, but
  // never on providers that carry RMA over the same sockets as messages (tcp, udp, sockets,
  // net), where reads measured slower than the stream (BENCHMARKS.md, issue 31).
  std::optional<size_t> rmaAbove;
  MessageOptions messages;
  // The group's secret (transport/group_secret.h), which every hello, on the fabric and on the
  // lifelines, proves.
  std::string secret;
};

// Whether this build has libfabric.
bool ofiBuilt();
// An OfiTransport; without libfabric in the build, throws std::invalid_argument saying how to
// get it. Throws std::runtime_error when libfabric has no fitting provider here.
std::unique_ptr<MessageTransport> makeOfiTransport(int rank, int size, std::shared_ptr<Rendezvous> rendezvous,
                                                   const OfiOptions& options, std::string* description);

} // namespace torus
