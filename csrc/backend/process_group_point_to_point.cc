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
                                                                   int tag, at::Tensor& tensor,
                                                                   const std::string& what) {
  const uint64_t number = ++p2pIssued_;
  const std::string context = p2pContext(what, number);
  failure_->throwIfFailed(context);
  const uint64_t recordId = recorder_->record(
      FlightRecorder::Call{title, true, tensor.scalar_type(), peer,
                           CallbackScope::currentOrigin() != CallSignature::kOriginCaller},
      {tensor}, {tensor});
  recorder_->started(recordId, number);
  const uint64_t wireTag = p2pTag(tag);
  const bool sending = type == c10d::OpType::SEND;
  std::unique_lock<std::mutex> batchLock(batchMutex_);
  const bool batched = batch_.has_value();
  if (!batched) {
    batchLock.unlock();
  }
  CommsEvent event;
  if (!batched && event.active()) {
    const std::vector<at::Tensor> tensors{tensor};
    CommsGroup group = commsGroup();
    group.rank = peer; // as ProcessGroupNCCL gives it: the trace's "Dst Rank" or "Src Rank"
    event.begin(group,
                CommsCall{sending ? "send" : "recv", static_cast<int64_t>(number), true, tensor.numel(), tensor.numel(),
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
  auto work = c10::make_intrusive<TorusP2PWork>(rank_, type, title, transport_, request, tensor, buffer, timeout_.load(),
                                                context, failure_, recorder_, recordId);
  if (batched) {
    batch_->firstNumber = batch_->works.empty() ? number : batch_->firstNumber;
    batch_->works.push_back(work);
    (sending ? batch_->sent : batch_->received).push_back(tensor);
  }
  return work;
}

void ProcessGroupTorus::startCoalescing() {
  std::lock_guard<std::mutex> lock(batchMutex_);
  TORUS_CHECK(!batch_, "startCoalescing called twice without endCoalescing between (group '", groupName_, "')");
  batch_.emplace();
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::endCoalescing() {
  P2PBatch batch;
  {
    std::lock_guard<std::mutex> lock(batchMutex_);
    TORUS_CHECK(batch_, "endCoalescing called without startCoalescing (group '", groupName_, "')");
    batch = std::move(*batch_);
    batch_.reset();
  }
  CommsEvent event;
  if (event.active()) {
    // In: what the batch sends; out: what it receives.
    const at::ScalarType dtype = !batch.sent.empty()       ? batch.sent[0].scalar_type()
                                : !batch.received.empty() ? batch.received[0].scalar_type()
                                                          : at::kByte;
    event.begin(commsGroup(),
                CommsCall{"coalesced", static_cast<int64_t>(batch.firstNumber), true, totalNumel(batch.sent),
                          totalNumel(batch.received), dtype, {}, {}, true},
                batch.sent, batch.received);
  }
  return c10::make_intrusive<TorusBatchWork>(rank_, std::move(batch.works));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::send(std::vector<at::Tensor>& tensors, int dstRank, int tag) {
  checkSingle(tensors.size(), "send");
  checkPeer(dstRank, rank_, size_, "send dst");
  checkTensor(tensors[0], "send tensor");
  return postPointToPoint(c10d::OpType::SEND, "torus:send", dstRank, tag, tensors[0],
                          "send to rank " + std::to_string(dstRank) + " tag " + std::to_string(tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::recv(std::vector<at::Tensor>& tensors, int srcRank, int tag) {
  checkSingle(tensors.size(), "recv");
  checkPeer(srcRank, rank_, size_, "recv src");
  checkOutput(tensors[0], "recv tensor");
  return postPointToPoint(c10d::OpType::RECV, "torus:recv", srcRank, tag, tensors[0],
                          "recv from rank " + std::to_string(srcRank) + " tag " + std::to_string(tag));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupTorus::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  checkSingle(tensors.size(), "recv");
  checkOutput(tensors[0], "recv tensor");
  return postPointToPoint(c10d::OpType::RECVANYSOURCE, "torus:recv_anysource", kAnyPeer, tag, tensors[0],
                          "recv from any rank, tag " + std::to_string(tag));
}

} // namespace torus
