// The point-to-point entry points: send, recv and recv from any source, and the batches of them
// batch_isend_irecv makes (startCoalescing, endCoalescing). They bypass the executor: posted
// straight to the transport, so that a rank's isend and irecv never wait for each other or for
// queued collectives.
#include "backend/callback_scope.h"
#include "backend/process_group_torus.h"
#include "backend/tensor_checks.h"
#include "backend/tensor_staging.h"

namespace torus {

namespace {

uint64_t p2pTag(int tag) {
  TORUS_CHECK_ARG(tag >= 0, "point-to-point tags must not be negative, got ", tag);
  return kP2PTagBase + static_cast<uint64_t>(tag);
}

} // namespace

std::string ProcessGroupTorus::p2pContext(const std::string& what, uint64_t number) {
  return "torus:" + what + ", p2p #" + std::to_string(number) + " (rank " + std::to_string(rank_) +
         ", group '" + groupName_ + "')";
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::postPointToPoint(c10d::OpType type, const char* title, int peer,
                                                                   int tag, at::Tensor& tensor, const std::string& what,
                                                                   bool batched) {
  const uint64_t number = ++p2pIssued_;
  const std::string context = p2pContext(what, number);
  failure_->throwIfFailed(context);
  const uint64_t recordId = recorder_->record(
      FlightRecorder::Call{title, true, tensor.scalar_type(), peer,
                           CallbackScope::currentOrigin() != CallSignature::kOriginCaller, nullptr,
                           static_cast<uint64_t>(bytesOf(tensor))},
      {tensor}, {tensor}, number);
  const uint64_t wireTag = p2pTag(tag);
  CommsEvent event; // a batch's is endCoalescing's
  if (!batched && event.active()) {
    const std::vector<at::Tensor> tensors{tensor};
    CommsGroup group = commsGroup();
    group.rank = peer; // as ProcessGroupNCCL gives it: the trace's "Dst Rank" or "Src Rank"
    const char* name = type == c10d::OpType::SEND ? "send" : "recv";
    event.begin(group,
                CommsCall{name, static_cast<int64_t>(number), true, tensor.numel(), tensor.numel(),
                          tensor.scalar_type(), {}, {}, true},
                tensors, tensors);
  }
  RequestPtr request;
  at::Tensor buffer;
  if (tensor.is_cuda()) {
    // Staged through pinned host memory. The copy down waits for the current stream's pending
    // writes to the tensor; a receive's copy up runs on the waiter's current stream when the work
    // completes.
    buffer = at::empty(tensor.sizes(), tensor.options().device(at::kCPU).pinned_memory(true));
    if (type == c10d::OpType::SEND) {
      buffer.copy_(tensor);
    }
  }
  if (type == c10d::OpType::SEND) {
    buffer = buffer.defined() ? buffer : contiguousBuffer(tensor);
    traffic_->count(peer, bytesOf(buffer));
    request = transport_->isend(peer, wireTag, CallSignature{}, buffer.data_ptr(), bytesOf(buffer));
  } else {
    if (!buffer.defined()) {
      buffer = tensor.is_contiguous() ? tensor : at::empty_like(tensor, at::MemoryFormat::Contiguous);
    }
    request = transport_->irecv(peer, wireTag, CallSignature{}, buffer.data_ptr(), bytesOf(buffer));
  }
  // The Work may go before the request completes (an irecv nobody waits on): the transport then
  // still owns the buffer.
  request->holdBuffer(std::make_shared<at::Tensor>(buffer));
  return c10::make_intrusive<TorusP2PWork>(rank_, type, title, transport_, request, tensor, buffer, timeout_.load(), context,
                                           failure_, recorder_, dumps_, recordId);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::issuePointToPoint(c10d::OpType type, const at::Tensor& tensor,
                                                                    const std::function<void()>& check, PostP2P post) {
  std::unique_lock<std::mutex> lock(batchMutex_);
  if (!batch_) {
    lock.unlock();
    check();
    return post(false);
  }
  // In a batch: checked now, posted with the rest by endCoalescing, so that a refused op leaves
  // the whole batch unposted (a good isend before it would otherwise reach the peer's next
  // receive from this rank).
  try {
    check();
  } catch (...) {
    if (!batch_->refused) {
      batch_->refused = std::current_exception();
    }
    return c10::make_intrusive<TorusBatchedOpWork>(rank_, type);
  }
  batch_->posts.push_back(std::move(post));
  (type == c10d::OpType::SEND ? batch_->sent : batch_->received).push_back(tensor);
  return c10::make_intrusive<TorusBatchedOpWork>(rank_, type);
}

void ProcessGroupTorus::startCoalescing() {
  std::lock_guard<std::mutex> lock(batchMutex_);
  // A batch still open is one whose issue raised before its end: none of it was posted.
  batch_.emplace();
  batching_.store(true, std::memory_order_relaxed);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::endCoalescing() {
  P2PBatch batch;
  {
    std::lock_guard<std::mutex> lock(batchMutex_);
    TORUS_CHECK(batch_, "endCoalescing called without startCoalescing (group '", groupName_, "')");
    batch = std::move(*batch_);
    batch_.reset();
    batching_.store(false, std::memory_order_relaxed);
  }
  if (batch.refused) {
    std::rethrow_exception(batch.refused);
  }
  CommsEvent event;
  if (!batch.posts.empty() && event.active()) {
    // In: what the batch sends; out: what it receives. (A collective issued in the batch has its own.)
    const at::ScalarType dtype = !batch.sent.empty()       ? batch.sent[0].scalar_type()
                                : !batch.received.empty() ? batch.received[0].scalar_type()
                                                          : at::kByte;
    event.begin(commsGroup(),
                CommsCall{"coalesced", static_cast<int64_t>(p2pIssued_.load()) + 1, true, totalNumel(batch.sent),
                          totalNumel(batch.received), dtype, {}, {}, true},
                batch.sent, batch.received);
  }
  std::vector<c10::intrusive_ptr<c10d::Work>> works = std::move(batch.collectives);
  for (PostP2P& post : batch.posts) {
    works.push_back(post(true));
  }
  return c10::make_intrusive<TorusBatchWork>(rank_, std::move(works));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  checkSingle(tensors.size(), "send");
  at::Tensor tensor = tensors[0];
  return issuePointToPoint(
      c10d::OpType::SEND, tensor,
      [&] {
        checkPeer(dstRank, rank_, size_, "send dst");
        checkTensor(tensor, "send tensor");
        p2pTag(tag);
      },
      [this, tensor, dstRank, tag](bool batched) mutable {
        return postPointToPoint(c10d::OpType::SEND, "torus:send", dstRank, tag, tensor,
                                "send to rank " + std::to_string(dstRank) + " tag " + std::to_string(tag), batched);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  checkSingle(tensors.size(), "recv");
  at::Tensor tensor = tensors[0];
  return issuePointToPoint(
      c10d::OpType::RECV, tensor,
      [&] {
        checkPeer(srcRank, rank_, size_, "recv src");
        checkOutput(tensor, "recv tensor");
        p2pTag(tag);
      },
      [this, tensor, srcRank, tag](bool batched) mutable {
        return postPointToPoint(c10d::OpType::RECV, "torus:recv", srcRank, tag, tensor,
                                "recv from rank " + std::to_string(srcRank) + " tag " + std::to_string(tag), batched);
      });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkSingle(tensors.size(), "recv");
  at::Tensor tensor = tensors[0];
  return issuePointToPoint(
      c10d::OpType::RECVANYSOURCE, tensor,
      [&] {
        checkOutput(tensor, "recv tensor");
        p2pTag(tag);
      },
      [this, tensor, tag](bool batched) mutable {
        return postPointToPoint(c10d::OpType::RECVANYSOURCE, "torus:recv_anysource", kAnyPeer, tag, tensor,
                                "recv from any rank, tag " + std::to_string(tag), batched);
      });
}

} // namespace torus
