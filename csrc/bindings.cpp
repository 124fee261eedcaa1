// torch_torus._C: the backend class and its configuration, for the Python shim.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/python.h>

#include "backend/algorithm_catalog.h"
#include "backend/callback_scope.h"
#include "backend/flight_recorder.h"
#include "backend/process_group_torus.h"
#include "collectives/blocks.h"
#include "python_stacks.h"
#include "reduce/streaming_copy.h"
#include "transport/ofi/ofi_transport.h"
#include "transport/shared_memory.h"
#include "transport/shm/shared_tensor_arena.h"
#include "transport/spin_wait.h"
#ifdef TORUS_WITH_CUDA
#include "reduce/cuda/reduce_cuda.h"
#endif

namespace py = pybind11;

#ifdef TORUS_WITH_CUDA
namespace {

// What the kernel hooks' `name` argument names; a ValueError naming it where nothing has that name.
template <class Enum>
Enum namedArgument(std::optional<Enum> found, const std::string& name, const char* what) {
  if (!found) {
    throw py::value_error(std::string("torus: unknown ") + what + " '" + name + "'");
  }
  return *found;
}

torus::DataType dtypeArgument(const std::string& name) {
  return namedArgument(torus::dataTypeNamed(name), name, "dtype");
}

torus::ReduceKind opArgument(const std::string& name) {
  return namedArgument(torus::reduceKindNamed(name), name, "reduce op");
}

} // namespace
#endif

PYBIND11_MODULE(_C, module) {
  module.doc() = "torch-torus: collective communication backend for torch.distributed";
  // c10d's Python types must exist before we derive from them.
  py::module::import("torch.distributed");
  module.attr("built_with_ofi") = torus::ofiBuilt();
  // TORUS_WAIT's choices, the first the default.
  module.attr("WAIT_POLICIES") =
      py::make_tuple(torus::waitPolicyName(torus::WaitPolicy::kAuto), torus::waitPolicyName(torus::WaitPolicy::kPause),
                     torus::waitPolicyName(torus::WaitPolicy::kYield));
  torus::FlightRecorder::setStackProvider(&torus::pythonStacks);

  // The algorithm catalog, for the Python configuration, selection, cost model, tuner and bench.
  module.def("algorithm_catalog", [] {
    py::list entries;
    for (const auto& entry : torus::algorithmCatalog()) {
      py::list needs;
      for (const auto& requirement : entry.needs) {
        needs.append(py::dict(py::arg("need") = torus::needName(requirement.need),
                              py::arg("instead") = torus::algorithmName(requirement.instead)));
      }
      entries.append(py::dict(py::arg("collective") = entry.collective, py::arg("name") = entry.name,
                              py::arg("needs") = needs, py::arg("torus_inner") = entry.torusInner,
                              py::arg("auto_up_to_bytes") = entry.autoUpToBytes));
    }
    return entries;
  });
  // Constants the cost model and the tuner must share with the algorithms.
  module.attr("CHUNKS_IN_FLIGHT") = torus::kChunksInFlight;
  module.attr("DEFAULT_CHUNK_BYTES") = torus::Chunking().chunkBytes;
  module.attr("DEFAULT_EAGER_BYTES") = torus::MessageOptions().eagerBytes;
  module.attr("DEFAULT_EAGER_WINDOW") = torus::MessageOptions().eagerWindowBytes;
  module.attr("DEFAULT_INLINE_BYTES") = torus::kDefaultInlineBytes;
  module.attr("SHM_SLOT_BYTES") = torus::SharedMemory::kSlotBytes;

  py::class_<torus::AlgorithmRule>(module, "AlgorithmRule")
      .def(py::init([](const std::string& algorithm, uint64_t lo, uint64_t hi) {
             return torus::AlgorithmRule{lo, hi, algorithm};
           }),
           py::arg("algorithm"), py::arg("lo"), py::arg("hi"))
      .def_readonly("algorithm", &torus::AlgorithmRule::algorithm)
      .def_readonly("lo", &torus::AlgorithmRule::lo)
      .def_readonly("hi", &torus::AlgorithmRule::hi);

  py::class_<torus::TcpListener, std::shared_ptr<torus::TcpListener>>(module, "TcpListener")
      .def(py::init<const std::string&, int>(), py::arg("address"), py::arg("backlog"))
      .def_property_readonly("address", &torus::TcpListener::address);
  py::class_<torus::TorusConfig>(module, "TorusConfig")
      .def(py::init<>())
      .def_readwrite("transport", &torus::TorusConfig::transport)
      .def_readwrite("address", &torus::TorusConfig::address)
      .def_readwrite("ofi_provider", &torus::TorusConfig::ofiProvider)
      .def_readwrite("ofi_rma_bytes", &torus::TorusConfig::ofiRmaBytes)
      .def_readwrite("chunk_bytes", &torus::TorusConfig::chunkBytes)
      .def_readwrite("eager_bytes", &torus::TorusConfig::eagerBytes)
      .def_readwrite("eager_window", &torus::TorusConfig::eagerWindowBytes)
      .def_readwrite("inline_bytes", &torus::TorusConfig::inlineBytes)
      .def_property(
          "wait", [](const torus::TorusConfig& config) { return torus::waitPolicyName(config.wait); },
          [](torus::TorusConfig& config, const std::string& name) { config.wait = torus::waitPolicyNamed(name); })
      .def_readwrite("algorithms", &torus::TorusConfig::algorithms)
      .def_readwrite("torus_rows", &torus::TorusConfig::torusRows)
      .def_readwrite("torus_inner", &torus::TorusConfig::torusInner)
      .def_readwrite("hosts", &torus::TorusConfig::hosts)
      .def_readwrite("log_level", &torus::TorusConfig::logLevel)
      .def_readwrite("device_stall_ms", &torus::TorusConfig::deviceStallMs)
      .def_readwrite("host_device", &torus::TorusConfig::hostDevice)
      .def_readwrite("trace_buffer", &torus::TorusConfig::traceBuffer)
      .def_readwrite("trace_dir", &torus::TorusConfig::traceDir)
      .def_readwrite("shared_tensor_cache", &torus::TorusConfig::sharedTensorCache)
      .def_readwrite("tcp_listener", &torus::TorusConfig::tcpListener)
      // Bytes, not text: the getter hands back what the setter took.
      .def_property(
          "secret", [](const torus::TorusConfig& config) { return py::bytes(config.secret); },
          [](torus::TorusConfig& config, const py::bytes& secret) { config.secret = secret; });

  py::class_<torus::ProcessGroupTorus, c10d::Backend, c10::intrusive_ptr<torus::ProcessGroupTorus>>(
      module, "ProcessGroupTorus")
      .def(py::init<const c10::intrusive_ptr<c10d::Store>&, int, int, std::chrono::milliseconds, torus::TorusConfig,
                    std::string>(),
           py::arg("store"), py::arg("rank"), py::arg("size"), py::arg("timeout"), py::arg("config"),
           py::arg("group_name"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("config", &torus::ProcessGroupTorus::config)
      .def_property_readonly("transport_description", &torus::ProcessGroupTorus::transportDescription)
      .def(
          "algorithm_for",
          [](const torus::ProcessGroupTorus& group, const std::string& collective, uint64_t nbytes) {
            return std::string(torus::algorithmName(group.algorithmFor(collective, nbytes)));
          },
          py::arg("collective"), py::arg("nbytes"))
      .def("traffic",
           [](const torus::ProcessGroupTorus& group) {
             const auto t = group.traffic();
             return py::dict(py::arg("same_host_bytes") = t.sameHostBytes,
                             py::arg("same_host_messages") = t.sameHostMessages,
                             py::arg("other_host_bytes") = t.otherHostBytes,
                             py::arg("other_host_messages") = t.otherHostMessages);
           })
      .def("reset_traffic", &torus::ProcessGroupTorus::resetTraffic)
      .def("set_global_ranks", &torus::ProcessGroupTorus::setGlobalRanks, py::arg("ranks"))
      .def("set_settings", &torus::ProcessGroupTorus::setSettings, py::arg("settings"))
      // torch.distributed.shrink_group calls it with its pg_options: torch_torus.Options for the new
      // group, or None for the old group's settings. c10d's binding would take only c10d options.
      .def(
          "shrink",
          [](torus::ProcessGroupTorus& group, const std::vector<int64_t>& ranksToExclude, int shrinkFlags,
             const py::object& options) {
            const std::string settings =
                options.is_none() ? group.settings()
                                  : py::module_::import("torch_torus").attr("_settings_text")(options).cast<std::string>();
            py::gil_scoped_release released;
            return group.shrinkWith(ranksToExclude, shrinkFlags, settings);
          },
          py::arg("ranks_to_exclude"), py::arg("shrink_flags") = 0, py::arg("opts_override") = py::none())
      .def(
          "dump_trace",
          [](torus::ProcessGroupTorus& group, const std::string& reason) {
            // The stacks are read now, while this thread holds the GIL and is the current one;
            // the dump itself runs without it.
            const torus::FlightRecorder::PresetStacks stacks(torus::pythonStacks());
            py::gil_scoped_release release;
            return group.dumpTrace(reason);
          },
          py::arg("reason"));
  module.def(
      "shared_memory_stats",
      [] {
        const torus::SharedTensorArena::Stats stats = torus::SharedTensorArena::instance().stats();
        py::dict result;
        result["live_bytes"] = stats.liveBytes;
        result["live_segments"] = stats.liveSegments;
        result["free_bytes"] = stats.freeBytes;
        result["free_segments"] = stats.freeSegments;
        result["limit_bytes"] = stats.limitBytes;
        result["peak_live_bytes"] = stats.peakLiveBytes;
        result["released_segments"] = stats.releasedSegments;
        return result;
      },
      "This process's shared tensor arena (allocate_tensor's memory): torch_torus.shared_memory_stats().");
  module.def(
      "empty_cache", [] { return torus::SharedTensorArena::instance().emptyCache(); },
      py::call_guard<py::gil_scoped_release>(),
      "Gives every free shared tensor segment back to the system; returns their bytes.");
  // The creator a shrink calls: torch_torus._create_shrunk_backend, looked up at each call with the
  // GIL held. Holding the function instead would keep the package's globals, and through them the
  // process's groups, alive past the interpreter's end: their goodbyes were never said.
  torus::ProcessGroupTorus::setGroupCreator([](const torus::ShrunkGroupRequest& request) {
    py::gil_scoped_acquire gil;
    return py::module_::import("torch_torus")
        .attr("_create_shrunk_backend")(request.store, request.rank, request.size, request.timeout, request.groupName,
                                        request.globalRanks, request.settings)
        .cast<c10::intrusive_ptr<torus::ProcessGroupTorus>>();
  });
  module.def("shut_down_groups", &torus::ProcessGroupTorus::shutDownAll, py::call_guard<py::gil_scoped_release>(),
             "Shuts down every torus group of this process (the atexit hook's work).");
  module.def(
      "streaming_copy",
      [](at::Tensor& target, const at::Tensor& source) {
        TORCH_CHECK_VALUE(target.device().is_cpu() && source.device().is_cpu() && target.is_contiguous() &&
                              source.is_contiguous(),
                          "streaming_copy: target and source must be contiguous CPU tensors");
        TORCH_CHECK_VALUE(target.nbytes() == source.nbytes(), "streaming_copy: target has ", target.nbytes(),
                          " bytes, source ", source.nbytes());
        py::gil_scoped_release released;
        torus::streamingCopy(target.data_ptr(), source.data_ptr(), source.nbytes());
      },
      py::arg("target"), py::arg("source"),
      "Copies source into target with non-temporal stores (the bench's memory bound).");

  // torch_torus.callbacks wraps every callback given to then() or add_done_callback(): its place,
  // taken when it is attached, and the scope it opens around the callback.
  static thread_local std::vector<std::unique_ptr<torus::CallbackScope>> pythonScopes;
  py::class_<torus::CallPlace>(module, "_AttachedCallback")
      .def(py::init([] { return torus::CallbackScope::attachCallback(); }))
      .def("__enter__",
           [](const torus::CallPlace& place) {
             pythonScopes.push_back(std::make_unique<torus::CallbackScope>(nullptr, place));
           })
      .def("__exit__", [](const torus::CallPlace&, const py::args&) { pythonScopes.pop_back(); });

#ifdef TORUS_WITH_CUDA
  module.attr("built_with_cuda") = true;
  // The CUDA kernels on raw device pointers and a raw cudaStream_t (torch.cuda.Stream's
  // cuda_stream), so tests can check them against the CPU reference without the backend.
  module.def(
      "_reduce_sources_cuda",
      [](const std::string& dtype, const std::string& op, uintptr_t dst, const std::vector<uintptr_t>& srcs,
         size_t count, uintptr_t stream) {
        std::vector<const void*> pointers;
        for (uintptr_t src : srcs) {
          pointers.push_back(reinterpret_cast<const void*>(src));
        }
        torus::cuda::reduceSourcesOnDevice(dtypeArgument(dtype), opArgument(op), reinterpret_cast<void*>(dst),
                                           pointers.data(), static_cast<int>(pointers.size()), count,
                                           reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("dtype"), py::arg("op"), py::arg("dst"), py::arg("srcs"), py::arg("count"), py::arg("stream"));
  module.def(
      "_scale_cuda",
      [](const std::string& dtype, bool divide, uintptr_t buf, size_t count, double factor, uintptr_t stream) {
        torus::cuda::scaleOnDevice(dtypeArgument(dtype),
                                   divide ? torus::cuda::ScaleKind::kDivide : torus::cuda::ScaleKind::kMultiply,
                                   reinterpret_cast<void*>(buf), count, factor, reinterpret_cast<cudaStream_t>(stream));
      },
      py::arg("dtype"), py::arg("divide"), py::arg("buf"), py::arg("count"), py::arg("factor"), py::arg("stream"));
#else
  module.attr("built_with_cuda") = false;
#endif
}
