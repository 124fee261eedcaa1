// Link: what a transport gives the message layer for one peer: an ordered, reliable byte stream
// each way, read and written without blocking, and optionally a way to read the peer's memory
// directly. A Link knows nothing of messages, tags or matching (MessageTransport does that once
// for every transport).
#pragma once

#include <sys/types.h>
#include <sys/uio.h>

#include <cstddef>
#include <cstdint>
#include "transport/departure.h"

namespace torus {

class Link {
 public:
  virtual ~Link() = default;

  // Takes a prefix of the bytes in parts[0..count); returns how many (0 when the stream is full
  // for now). Throws CommError (kPeer) when the stream broke.
  virtual size_t write(const iovec* parts, int count) = 0;
  // Reads up to n bytes; returns how many (0 when none are waiting), or -1 when the peer closed
  // its end. Throws CommError (kPeer) when the stream broke.
  virtual ssize_t read(char* dst, size_t n) = 0;
  // After writes: makes them visible to the peer and wakes it.
  virtual void flush() {}
  // How many of the bytes written the Link has handed on for good, so that they reach the peer
  // even if this process dies now, or that the peer said it read (UINT64_MAX: every byte, as
  // soon as write() takes it).
  virtual uint64_t sentBytes() const {
    return UINT64_MAX;
  }
  // After reads: frees what they consumed and wakes a peer waiting for the space.
  virtual void consumed() {}
  // After read() returned -1: the peer left the group (destroyed it), which the Link learned
  // out of band, though no goodbye frame came on the stream (it left mid-frame, or before it
  // had a stream to this process).
  virtual bool peerSaidGoodbye() const {
    return false;
  }
  // ... and how it left, when peerSaidGoodbye().
  virtual Departure peerDeparture() const {
    return Departure::kGroupDestroyed;
  }

  // Messages larger than this go by the peer reading this process's memory (startRead on its
  // side) instead of through the stream; SIZE_MAX: never.
  virtual size_t peerReadsAbove() const {
    return SIZE_MAX;
  }
  // Before a message above peerReadsAbove() is announced: lets the peer read the n bytes at buf
  // until endLoan(key); returns the key its startRead needs besides the address (0 where
  // the Link needs none). Throws CommError when the memory cannot be lent.
  virtual uint64_t lend(const void* buf, size_t n) {
    return 0;
  }
  // The peer has read the lent memory, or will not: it may be reused or freed.
  virtual void endLoan(uint64_t key) {}
  // Reading the peer's memory: n bytes at `address` (lent with `key`) into dst, one read at a
  // time per Link. startRead begins it and continueRead moves it on without waiting (the
  // message layer calls it on every pass, with its lock held, so it never blocks): true once
  // all n bytes are in dst. Both throw CommError when the read can end well no more (the peer
  // died or gave up, the read's deadline passed, the group is being aborted). abandonRead gives
  // up on a read begun and not finished: nothing lands in dst afterwards.
  virtual void startRead(uint64_t address, uint64_t key, char* dst, size_t n);
  virtual bool continueRead() {
    return true;
  }
  virtual void abandonRead() {}
};

} // namespace torus
