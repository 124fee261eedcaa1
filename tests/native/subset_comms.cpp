#include "subset_comms.h"

#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collectives/blocks.h"
#include "collectives/one_shot_allreduce.h"
#include "collectives/single_copy_allgather.h"
#include "collectives/single_copy_reduce_scatter.h"
#include "collectives/two_shot_allreduce.h"
#include "callback_rendezvous.h"
#include "comm/comm.h"
#include "transport/hybrid_transport.h"
#include "transport/tcp/tcp_transport.h"

namespace py = pybind11;

namespace torus {

namespace {

// A group over shm+tcp (hosts[r]: rank r's host), and Comms over any of its ranks.
class SubsetComms {
 public:
  SubsetComms(int rank, int size, const std::vector<int>& hosts, CallbackRendezvous::Set set,
              CallbackRendezvous::Get get)
      : rank_(rank) {
    auto rendezvous = std::make_shared<CallbackRendezvous>(std::move(set), std::move(get));
    std::vector<bool> sameHost;
    std::vector<int> hostMembers;
    for (int r = 0; r < size; ++r) {
      sameHost.push_back(hosts.at(r) == hosts.at(rank));
      if (sameHost.back()) {
        hostMembers.push_back(r);
      }
    }
    transport_ = std::make_shared<HybridTransport>(std::make_unique<TcpTransport>(rank, size, rendezvous, TcpOptions{}),
                                                   std::make_unique<ShmTransport>(rank, size, *rendezvous, hostMembers),
                                                   std::move(sameHost));
  }

  bool sharesMemory(const std::vector<int>& ranks) const {
    return commOver(ranks).sharedMemory() != nullptr;
  }

  // Each runs its algorithm on the Comm over `ranks` (group ranks, this one among them), summing
  // buf's float32 or float64 elements.
  void oneShotAllreduce(const std::vector<int>& ranks, const at::Tensor& buf) {
    Call call = begin(ranks, buf);
    one_shot_allreduce(call.comm, buf.data_ptr(), call.count, call.reducer, chunking_, scratch_);
  }
  void twoShotAllreduce(const std::vector<int>& ranks, const at::Tensor& buf) {
    Call call = begin(ranks, buf);
    two_shot_allreduce(call.comm, buf.data_ptr(), call.count, call.reducer, chunking_, scratch_);
  }
  void reduceScatter(const std::vector<int>& ranks, const at::Tensor& buf) {
    Call call = begin(ranks, buf);
    single_copy_reduce_scatter(call.comm, buf.data_ptr(), evenBlocks(call.count, call.comm.size()), call.reducer,
                               scratch_);
  }
  void allgather(const std::vector<int>& ranks, const at::Tensor& buf) {
    Call call = begin(ranks, buf);
    single_copy_allgather(call.comm, buf.data_ptr(), evenBlocks(call.count, call.comm.size()),
                          call.reducer.elementSize);
  }

 private:
  struct Call {
    Comm comm;
    Reducer reducer;
    size_t count;
  };

  Comm commOver(const std::vector<int>& ranks) const {
    const auto self = std::find(ranks.begin(), ranks.end(), rank_);
    return Comm(transport_, ranks, static_cast<int>(self - ranks.begin()));
  }

  // The Comm for the next collective: a tag of its own, a call that names buf's size (so that
  // ranks that pass different sizes fail as mismatched), a deadline.
  Call begin(const std::vector<int>& ranks, const at::Tensor& buf) {
    TORCH_CHECK(buf.is_contiguous() && (buf.scalar_type() == at::kFloat || buf.scalar_type() == at::kDouble),
                "a contiguous float32 or float64 tensor");
    Call call{commOver(ranks),
              makeReducer(buf.scalar_type() == at::kFloat ? DataType::kFloat32 : DataType::kFloat64, ReduceKind::kSum),
              static_cast<size_t>(buf.numel())};
    CallSignature signature;
    signature.kind = 1;
    signature.nbytes = static_cast<uint64_t>(buf.nbytes());
    call.comm.setTag(++collectives_);
    call.comm.setCall(signature);
    call.comm.setDeadline(Clock::now() + std::chrono::seconds(60));
    return call;
  }

  const int rank_;
  std::shared_ptr<Transport> transport_;
  uint64_t collectives_ = 0;
  Scratch scratch_;
  Chunking chunking_;
};

} // namespace

void defineSubsetComms(py::module& module) {
  py::class_<SubsetComms>(module, "SubsetComms")
      .def(py::init<int, int, const std::vector<int>&, CallbackRendezvous::Set, CallbackRendezvous::Get>(),
           py::arg("rank"), py::arg("size"), py::arg("hosts"), py::arg("store_set"), py::arg("store_get"))
      .def("shares_memory", &SubsetComms::sharesMemory, py::arg("ranks"))
      .def("one_shot_allreduce", &SubsetComms::oneShotAllreduce, py::arg("ranks"), py::arg("buf"),
           py::call_guard<py::gil_scoped_release>())
      .def("two_shot_allreduce", &SubsetComms::twoShotAllreduce, py::arg("ranks"), py::arg("buf"),
           py::call_guard<py::gil_scoped_release>())
      .def("single_copy_reduce_scatter", &SubsetComms::reduceScatter, py::arg("ranks"), py::arg("buf"),
           py::call_guard<py::gil_scoped_release>())
      .def("single_copy_allgather", &SubsetComms::allgather, py::arg("ranks"), py::arg("buf"),
           py::call_guard<py::gil_scoped_release>());
}

} // namespace torus
