#include "comm/comm.h"

#include <cstdlib>
#include <new>
#include <stdexcept>

namespace torus {

Comm::Comm(std::shared_ptr<Transport> transport, std::vector<int> members, int self,
           std::shared_ptr<TrafficCounters> traffic)
    : transport_(std::move(transport)), traffic_(std::move(traffic)), members_(std::move(members)), self_(self) {
  if (self_ < 0 || self_ >= size()) {
    throw std::invalid_argument("torus: this process is not a member of the Comm");
  }
  sharedMemory_ = transport_->sharedMemory(members_, traffic_);
}

RequestPtr Comm::isend(int peer, const void* buf, size_t nbytes) {
  if (traffic_) {
    traffic_->count(members_.at(peer), nbytes);
  }
  return transport_->isend(members_.at(peer), tag_, call_, buf, nbytes);
}

RequestPtr Comm::irecv(int peer, void* buf, size_t nbytes) {
  return transport_->irecv(members_.at(peer), tag_, call_, buf, nbytes);
}

void Comm::wait(const RequestPtr& request) {
  transport_->wait({request}, deadline_);
}

void Comm::waitAll(const std::vector<RequestPtr>& requests) {
  transport_->wait(requests, deadline_);
}

void Comm::send(int peer, const void* buf, size_t nbytes) {
  wait(isend(peer, buf, nbytes));
}

void Comm::recv(int peer, void* buf, size_t nbytes) {
  wait(irecv(peer, buf, nbytes));
}

void Comm::sendRecv(int to, const void* sendBuf, size_t sendBytes, int from, void* recvBuf,
                    size_t recvBytes) {
  auto received = irecv(from, recvBuf, recvBytes);
  auto sent = isend(to, sendBuf, sendBytes);
  waitAll({received, sent});
}

Comm Comm::subset(const std::vector<int>& ranks) const {
  std::vector<int> members;
  int self = -1;
  for (int rank : ranks) {
    if (rank == self_) {
      self = static_cast<int>(members.size());
    }
    members.push_back(members_.at(rank));
  }
  Comm comm(transport_, std::move(members), self, traffic_);
  comm.tag_ = tag_;
  comm.call_ = call_;
  comm.deadline_ = deadline_;
  comm.deviceArenas_ = deviceArenas_;
  comm.onFailure_ = onFailure_;
  return comm;
}

void Comm::fail(std::exception_ptr error) const {
  if (onFailure_) {
    (*onFailure_)(error);
    return;
  }
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    transport_->abort(e.what());
  } catch (...) {
    transport_->abort("an exception of unknown type");
  }
}

std::optional<ArenaView> Comm::deviceArenas() const {
  if (!deviceArenas_) {
    return std::nullopt;
  }
  ArenaView view;
  view.bytes = deviceArenas_->bytes();
  for (int member : members_) {
    char* arena = deviceArenas_->arena(member);
    if (arena == nullptr) {
      return std::nullopt;
    }
    view.arenas.push_back(arena);
  }
  return view;
}

Scratch::~Scratch() {
  std::free(data_);
}

void* Scratch::get(size_t nbytes) {
  if (nbytes > capacity_) {
    std::free(data_);
    size_t rounded = (nbytes + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, rounded);
    if (data_ == nullptr) {
      capacity_ = 0;
      throw std::bad_alloc();
    }
    capacity_ = rounded;
  }
  return data_;
}

} // namespace torus
