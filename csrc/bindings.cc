// hetccl._C: pybind11 bindings of the bridge core. The Python API here is a contract with
// hetccl's Python backend (see docs/transports.md): keep names and signatures stable.
// Every call that may block (connect, close, wait, wait_all, reduce_into, scale_div,
// zc_wait) releases the GIL. Pointers travel as Python ints (tensor.data_ptr()).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dirent.h>
#include <dlfcn.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <execinfo.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <thread>

#include "check_text.h"
#include "common.h"
#include "crash.h"
#include "device_ops.h"
#include "engine.h"
#include "reduce.h"
#include "transport.h"

namespace py = pybind11;
using namespace hetccl;

namespace {

PyObject* g_comm_error = nullptr;
PyObject* g_comm_timeout = nullptr;
PyObject* g_peer_failure = nullptr;
PyObject* g_truncated = nullptr;
PyObject* g_arg_mismatch = nullptr;

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// Python-facing transport: owns the C++ one; close() is idempotent and also run on destruction.
class PyTransport {
 public:
  PyTransport(const std::string& name, int rank, int size, const py::dict& options) {
    Options opts;
    for (auto kv : options) opts[py::str(kv.first)] = py::str(kv.second);
    t_ = std::shared_ptr<Transport>(make_transport(name, rank, size, opts));
  }
  Transport& t() { return *t_; }
  std::shared_ptr<Transport> shared() { return t_; }

 private:
  std::shared_ptr<Transport> t_;  // shared with an Engine that drives it
};

// dump_thread_stacks(): every thread of this process prints its native frames (diagnostics of a
// stall, tests/gpu_ucx_probe.py). Each thread in turn gets SIGURG (whose default action is to
// ignore it, so a stray one is harmless) and its handler writes "hetccl-stack <tid> <name>" and
// "hetccl-frame <object> +<offset> <symbol>" lines to stderr; the caller waits up to 0.2 s per
// thread for the handler's done mark (a thread that blocks the signal is skipped after that). A thread blocked in the kernel (a futex inside the CUDA
// driver) runs the handler and goes back to waiting. backtrace() and dladdr() are not formally
// async-signal-safe (both are warmed up first so no library is loaded inside the handler):
// acceptable for a diagnostic taken once the process is stuck anyway.
std::atomic<int> g_stack_done{0};

void stack_handler(int) {
  void* frames[48];
  int n = backtrace(frames, 48);
  char line[640];
  char name[32] = "?";
  prctl(PR_GET_NAME, name, 0, 0, 0);
  int len = snprintf(line, sizeof line, "hetccl-stack %ld %s\n", long(syscall(SYS_gettid)), name);
  if (len > 0) (void)!write(2, line, size_t(len));
  for (int i = 2; i < n; ++i) {  // 0, 1: this handler and the signal trampoline
    Dl_info info;
    if (dladdr(frames[i], &info) && info.dli_fname) {
      len = snprintf(line, sizeof line, "hetccl-frame %s +0x%lx %s\n", info.dli_fname,
                     (unsigned long)((char*)frames[i] - (char*)info.dli_fbase),
                     info.dli_sname ? info.dli_sname : "?");
      if (len > 0) (void)!write(2, line, size_t(std::min<int>(len, int(sizeof line) - 1)));
    }
  }
  g_stack_done.store(1);
}

int dump_thread_stacks() {
  {
    void* warm[2];
    backtrace(warm, 2);
    Dl_info info;
    dladdr(reinterpret_cast<void*>(&stack_handler), &info);
  }
  struct sigaction sa {}, old {};
  sa.sa_handler = stack_handler;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGURG, &sa, &old);
  int done = 0;
  DIR* d = opendir("/proc/self/task");
  std::vector<long> tids;
  for (dirent* e; d && (e = readdir(d));)
    if (e->d_name[0] != '.') tids.push_back(std::atol(e->d_name));
  if (d) closedir(d);
  for (long tid : tids) {
    g_stack_done.store(0);
    if (syscall(SYS_tgkill, getpid(), tid, SIGURG) != 0) continue;
    for (int i = 0; i < 200 && !g_stack_done.load(); ++i) usleep(1000);
    done += g_stack_done.load();
  }
  sigaction(SIGURG, &old, nullptr);
  return done;
}

std::string to_bytes_str(const py::handle& h) {
  if (py::isinstance<py::bytes>(h)) return std::string(py::reinterpret_borrow<py::bytes>(h));
  if (py::isinstance<py::str>(h)) return std::string(py::reinterpret_borrow<py::str>(h));
  throw CommError("hetccl: addresses must be bytes (or str)");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hetccl bridge core: transports (shm, tcp[, ucx]) and host reductions";

  g_comm_error = PyErr_NewException("hetccl._C.CommError", PyExc_RuntimeError, nullptr);
  {
    py::tuple bases = py::make_tuple(py::handle(g_comm_error), py::handle(PyExc_TimeoutError));
    g_comm_timeout = PyErr_NewException("hetccl._C.CommTimeout", bases.ptr(), nullptr);
  }
  g_peer_failure = PyErr_NewException("hetccl._C.PeerFailure", g_comm_error, nullptr);
  g_truncated = PyErr_NewException("hetccl._C.MessageTruncated", g_comm_error, nullptr);
  m.attr("CommError") = py::handle(g_comm_error);
  m.attr("CommTimeout") = py::handle(g_comm_timeout);
  m.attr("PeerFailure") = py::handle(g_peer_failure);
  m.attr("MessageTruncated") = py::handle(g_truncated);
  {
    // Ranks disagree on a collective's arguments: a ValueError (the verdict is the same on every
    // rank and the group stays usable when it is raised synchronously) and a CommError.
    py::tuple bases = py::make_tuple(py::handle(g_comm_error), py::handle(PyExc_ValueError));
    g_arg_mismatch = PyErr_NewException("hetccl._C.ArgMismatch", bases.ptr(), nullptr);
  }
  m.attr("ArgMismatch") = py::handle(g_arg_mismatch);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ArgMismatch& e) {
      PyErr_SetString(g_arg_mismatch, e.what());
    } catch (const MessageTruncated& e) {
      PyErr_SetString(g_truncated, e.what());
    } catch (const PeerFailure& e) {
      PyErr_SetString(g_peer_failure, e.what());
    } catch (const CommTimeout& e) {
      PyErr_SetString(g_comm_timeout, e.what());
    } catch (const CommError& e) {
      PyErr_SetString(g_comm_error, e.what());
    }
  });

  m.attr("MAX_TAG") = py::int_(kMaxTag);

  py::class_<Request, std::shared_ptr<Request>>(m, "Request",
      "One posted operation. Completed by the transport's threads.")
      .def("wait",
           [](Request& r, int64_t timeout_ms) {
             py::gil_scoped_release nogil;
             return r.wait(timeout_ms);
           },
           py::arg("timeout_ms") = -1,
           "Blocks until done; returns the bytes transferred. Raises CommTimeout after "
           "timeout_ms (< 0: no limit; the request stays pending), or the request's error.")
      .def("test", &Request::test, "True once done; raises the request's error if it failed.")
      .def_property_readonly("peer", &Request::peer)
      .def_property_readonly("tag", &Request::tag)
      .def_property_readonly("nbytes", &Request::nbytes,
                             "Posted size while pending; bytes that arrived once done.");

  py::class_<PyTransport>(m, "Transport")
      .def(py::init<const std::string&, int, int, const py::dict&>(), py::arg("name"),
           py::arg("rank"), py::arg("size"), py::arg("options") = py::dict())
      .def_property_readonly("name", [](PyTransport& s) { return s.t().name(); })
      .def("address", [](PyTransport& s) { return py::bytes(s.t().address()); })
      .def("connect",
           [](PyTransport& s, const py::list& addresses, int64_t timeout_ms) {
             std::vector<std::string> a;
             for (auto h : addresses) a.push_back(to_bytes_str(h));
             py::gil_scoped_release nogil;
             s.t().connect(a, timeout_ms);
           },
           py::arg("addresses"), py::arg("timeout_ms"))
      .def("isend",
           [](PyTransport& s, int peer, uintptr_t ptr, size_t nbytes, uint64_t tag) {
             return s.t().isend(peer, as_ptr(ptr), nbytes, tag);
           },
           py::arg("peer"), py::arg("ptr"), py::arg("nbytes"), py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def("irecv",
           [](PyTransport& s, int peer, uintptr_t ptr, size_t nbytes, uint64_t tag) {
             return s.t().irecv(peer, as_ptr(ptr), nbytes, tag);
           },
           py::arg("peer"), py::arg("ptr"), py::arg("nbytes"), py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def("cancel",
           [](PyTransport& s, const RequestPtr& req, bool unpost) {
             return s.t().cancel(req, unpost);
           },
           py::arg("request"), py::arg("unpost") = false, py::call_guard<py::gil_scoped_release>(),
           "Withdraws a posted receive no data has reached yet (True: it failed with "
           "'cancelled' and its buffer is never written; False: it finishes as before). "
           "unpost=True: only if its message then goes to the next receive of (peer, tag).")
      .def("irecv_reduce",
           [](PyTransport& s, int peer, uintptr_t ptr, size_t nbytes, uint64_t tag,
              const std::string& op, const std::string& dtype) {
             ReduceOp o = parse_op(op);
             DType d = parse_dtype(dtype);
             py::gil_scoped_release nogil;
             return s.t().irecv_reduce(peer, as_ptr(ptr), nbytes, tag, o, d);
           },
           py::arg("peer"), py::arg("ptr"), py::arg("nbytes"), py::arg("tag"), py::arg("op"),
           py::arg("dtype"))
      .def("close", [](PyTransport& s) { s.t().close(); }, py::call_guard<py::gil_scoped_release>())
      .def("info", [](PyTransport& s) { return s.t().info(); },
           "What this instance runs with (e.g. UCX's transports in force), key -> text.")
      .def("message_limit", [](PyTransport& s, int peer) { return s.t().message_limit(peer); },
           py::arg("peer"),
           "The largest host message worth sending to peer whole, 0 for no bound (transport.h); "
           "the engine caps its host chunks on the link at it.")
      .def_property_readonly("device_direct", [](PyTransport& s) { return s.t().device_direct(); })
      .def("isend_device",
           [](PyTransport& s, int peer, uintptr_t ptr, size_t nbytes, uint64_t tag) {
             return s.t().isend_device(peer, as_ptr(ptr), nbytes, tag);
           },
           py::arg("peer"), py::arg("ptr"), py::arg("nbytes"), py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def("irecv_device",
           [](PyTransport& s, int peer, uintptr_t ptr, size_t nbytes, uint64_t tag) {
             return s.t().irecv_device(peer, as_ptr(ptr), nbytes, tag);
           },
           py::arg("peer"), py::arg("ptr"), py::arg("nbytes"), py::arg("tag"),
           py::call_guard<py::gil_scoped_release>())
      .def("bind_device",
           [](PyTransport& s, std::shared_ptr<DeviceOps> d, int index, const std::string& memory) {
             s.t().bind_device([d, index] { d->set_device(index); }, memory);
           },
           py::arg("device_ops"), py::arg("device_index"), py::arg("memory"),
           "Transport::bind_device with this runtime's device (what the engine does before its "
           "first direct device message; diagnostics and tests).")
      .def("prepare_device",
           [](PyTransport& s, uintptr_t ptr, size_t nbytes, const std::string& memory) {
             s.t().prepare_device(as_ptr(ptr), nbytes, memory);
           },
           py::arg("ptr"), py::arg("nbytes"), py::arg("memory"),
           py::call_guard<py::gil_scoped_release>(),
           "Transport::prepare_device (what the engine does on the issuing thread for every direct "
           "device buffer; diagnostics and tests).")
      .def_property_readonly("zc_supported", [](PyTransport& s) { return s.t().zc_supported(); })
      .def("zc_regions",
           [](PyTransport& s) {
             std::vector<std::pair<uintptr_t, size_t>> v;
             for (auto& r : s.t().zc_regions()) v.emplace_back(reinterpret_cast<uintptr_t>(r.first), r.second);
             return v;
           })
      .def("zc_send_commit",
           [](PyTransport& s, int peer, size_t nbytes, uint64_t tag) { s.t().zc_send_commit(peer, nbytes, tag); },
           py::arg("peer"), py::arg("nbytes"), py::arg("tag"))
      .def("zc_recv_release", [](PyTransport& s, int peer) { s.t().zc_recv_release(peer); },
           py::arg("peer"))
      .def("zc_send_try",
           [](PyTransport& s, int peer) {
             auto r = s.t().zc_send_try(peer);
             return std::make_pair(reinterpret_cast<uintptr_t>(r.first), r.second);
           },
           py::arg("peer"), "(ptr, capacity) of a free slot, or (0, 0) at once when none is free.")
      .def("zc_recv_try",
           [](PyTransport& s, int peer) {
             auto r = s.t().zc_recv_try(peer);
             return std::make_tuple(reinterpret_cast<uintptr_t>(std::get<0>(r)), std::get<1>(r), std::get<2>(r));
           },
           py::arg("peer"), "(ptr, nbytes, tag) of the next committed slot, or (0, 0, 0) at once.")
      .def("zc_send_counts", [](PyTransport& s, int peer) { return s.t().zc_send_counts(peer); },
           py::arg("peer"), "(slots acquired by this side, slots the peer has released).")
      .def("zc_depth", [](PyTransport& s, int peer) { return s.t().zc_depth(peer); }, py::arg("peer"))
      .def("zc_wait", [](PyTransport& s, int peer, int64_t timeout_ms) { s.t().zc_wait(peer, timeout_ms); },
           py::arg("peer"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyTransport& s, py::args) { py::gil_scoped_release nogil; s.t().close(); })
      .def("__repr__", [](PyTransport& s) { return "<hetccl._C.Transport " + s.t().name() + ">"; });

  m.def("transport_names", &transport_names, "Transports in this build, sorted by name.");
  m.def("mismatch_text", &hetccl::mismatch_text, py::arg("coll"), py::arg("what"), py::arg("rank_values"),
        "The one wording of an argument mismatch (check_text.h): '' when every rank's value text is equal.");
  m.def("check_field_whats", [] {
    return std::vector<std::string>(hetccl::kCheckFieldWhat, hetccl::kCheckFieldWhat + hetccl::kCheckFields);
  }, "The compared fields' names, in the check header's order (check_text.h).");
  m.def("host_id", &host_id, "This process's shared-memory domain (kernel boot id, /dev/shm file system, pid namespace): ranks with equal ids reach each other through shm.");
  m.def("transport_table",
        [] {
          py::list out;
          for (auto& c : transport_table()) {
            py::dict d;
            d["name"] = c.name;
            d["preference"] = c.preference;
            d["same_host"] = c.same_host;
            d["other_host"] = c.other_host;
            d["memory"] = c.memory;
            d["zero_copy"] = c.zero_copy;
            d["lazy_connect"] = c.lazy_connect;
            d["rdma"] = c.rdma;
            d["runtime_free"] = c.runtime_free;
            d["detail"] = c.detail;
            out.append(d);
          }
          return out;
        },
        "Every transport's capabilities (csrc/transport.h TransportCaps), most preferred first.");
  m.def("dump_thread_stacks", &dump_thread_stacks, py::call_guard<py::gil_scoped_release>(),
        "Every thread prints its native frames to stderr (hetccl-stack / hetccl-frame lines; "
        "addr2line -f -e <object> <offset> names a frame); returns the number that answered.");
  m.def("enable_crash_backtrace", [] { install_crash_backtrace(); });

  m.def("wait_all",
        [](std::vector<std::shared_ptr<Request>> reqs, int64_t timeout_ms) {
          py::gil_scoped_release nogil;
          // Waits for the whole set; a failure anywhere is raised promptly even while earlier
          // requests are still pending (checked every 20 ms), the first failed one in list order.
          Deadline d(timeout_ms);
          for (;;) {
            Request* pending = nullptr;
            for (auto& r : reqs)
              if (!r->test() && !pending) pending = r.get();  // test() throws a failed one
            if (!pending) return;
            int64_t slice = std::min<int64_t>(20, d.left_ms());
            if (slice <= 0) {
              pending->wait(0);  // throws CommTimeout naming the request
              continue;
            }
            try {
              pending->wait(slice);
            } catch (const CommTimeout&) {
              if (d.expired()) {
                size_t n = 0;
                for (auto& r : reqs) n += r->test() ? 0 : 1;
                throw CommTimeout("hetccl: wait_all timed out after " + std::to_string(timeout_ms) +
                                  " ms with " + std::to_string(n) + " of " + std::to_string(reqs.size()) +
                                  " requests pending (first: peer rank " + std::to_string(pending->peer()) +
                                  ", tag " + std::to_string(pending->tag()) + ")");
              }
            }
          }
        },
        py::arg("requests"), py::arg("timeout_ms"));

  m.def("reduce_into",
        [](const std::string& op, const std::string& dtype, uintptr_t dst, uintptr_t src, size_t count,
           int threads) {
          ReduceOp o = parse_op(op);
          DType d = parse_dtype(dtype);
          py::gil_scoped_release nogil;
          reduce_into(o, d, as_ptr(dst), as_ptr(src), count, threads);
        },
        py::arg("op"), py::arg("dtype"), py::arg("dst_ptr"), py::arg("src_ptr"), py::arg("count"),
        py::arg("threads") = 0);
  m.def("scale_div",
        [](const std::string& dtype, uintptr_t ptr, size_t count, int64_t n, int threads) {
          DType d = parse_dtype(dtype);
          py::gil_scoped_release nogil;
          scale_div(d, as_ptr(ptr), count, n, threads);
        },
        py::arg("dtype"), py::arg("ptr"), py::arg("count"), py::arg("n"), py::arg("threads") = 0);
  py::class_<DeviceOps, std::shared_ptr<DeviceOps>>(m, "DeviceOps",
      "A vendor runtime's stream memory operations, copies, events and host registration "
      "(csrc/device_ops.h), opened from the library the framework loaded.")
      .def_property_readonly("name", &DeviceOps::name)
      .def_property_readonly("memory_type", &DeviceOps::memory_type)
      .def("wait_geq",
           [](DeviceOps& d, uintptr_t s, uint64_t word, uint64_t counter) {
             d.wait_geq(as_ptr(s), word, counter);
           },
           py::arg("stream"), py::arg("word"), py::arg("counter"),
           "Enqueue a wait on a flag word (device_ops.h's contract; tests).")
      .def("write",
           [](DeviceOps& d, uintptr_t s, uint64_t word, uint64_t counter) {
             d.write(as_ptr(s), word, counter);
           },
           py::arg("stream"), py::arg("word"), py::arg("counter"),
           "Enqueue a write of a flag word (tests).")
      .def("stream_mem_ops", &DeviceOps::stream_mem_ops, py::arg("device_index"))
      .def("host_register",
           [](DeviceOps& d, uintptr_t p, size_t n) { return d.host_register(as_ptr(p), n); },
           py::arg("ptr"), py::arg("nbytes"))
      .def("host_unregister", [](DeviceOps& d, uintptr_t p) { d.host_unregister(as_ptr(p)); },
           py::arg("ptr"))
      .def("device_address", [](DeviceOps& d, uintptr_t p) { return d.device_address(as_ptr(p)); },
           py::arg("ptr"))
      .def("wait_word_alloc",
           [](DeviceOps& d) { return reinterpret_cast<uintptr_t>(d.wait_word_alloc()); },
           "A word for streams to wait on where the runtime requires its own memory (0: any "
           "registered host memory; tests).")
      .def("wait_word_address",
           [](DeviceOps& d, uintptr_t w) { return d.wait_word_address(as_ptr(w)); }, py::arg("word"))
      .def("wait_word_free", [](DeviceOps& d, uintptr_t w) { d.wait_word_free(as_ptr(w)); },
           py::arg("word"))
      .def("set_device", &DeviceOps::set_device, py::arg("device_index"))
      .def("event_create", [](DeviceOps& d) { return reinterpret_cast<uintptr_t>(d.event_create()); })
      .def("event_destroy", [](DeviceOps& d, uintptr_t e) { d.event_destroy(as_ptr(e)); },
           py::arg("event"))
      .def("memcpy_async",
           [](DeviceOps& d, uintptr_t dst, uintptr_t src, size_t n, uintptr_t s) {
             d.memcpy_async(as_ptr(dst), as_ptr(src), n, as_ptr(s));
           },
           py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("stream"))
      .def("emulated_stream",
           [](DeviceOps& d) { return reinterpret_cast<uintptr_t>(emulated_stream(d)); },
           "A new stream of the emulated device (tests).")
      .def("synchronize", [](DeviceOps& d, uintptr_t s) { d.sync(as_ptr(s)); }, py::arg("stream"),
           py::call_guard<py::gil_scoped_release>())
      // the device route's calls (device_ops.h; tests drive a runtime module through them)
      .def("device_route", &DeviceOps::device_route)
      .def("prepare_kernels", &DeviceOps::prepare_kernels, py::call_guard<py::gil_scoped_release>())
      .def("current_device", &DeviceOps::current_device)
      .def("stream_create", [](DeviceOps& d) { return reinterpret_cast<uintptr_t>(d.stream_create()); })
      .def("stream_destroy", [](DeviceOps& d, uintptr_t s) { d.stream_destroy(as_ptr(s)); }, py::arg("stream"))
      .def("mem_alloc_async",
           [](DeviceOps& d, size_t n, uintptr_t s) {
             return reinterpret_cast<uintptr_t>(d.mem_alloc_async(n, as_ptr(s)));
           },
           py::arg("nbytes"), py::arg("stream"))
      .def("mem_free_async", [](DeviceOps& d, uintptr_t p, uintptr_t s) { d.mem_free_async(as_ptr(p), as_ptr(s)); },
           py::arg("ptr"), py::arg("stream"))
      .def("reduce",
           [](DeviceOps& d, uintptr_t dst, uintptr_t src, size_t count, const std::string& dtype,
              const std::string& op, uintptr_t s) {
             d.reduce(as_ptr(dst), as_ptr(src), count, parse_dtype(dtype), parse_op(op), as_ptr(s));
           },
           py::arg("dst"), py::arg("src"), py::arg("count"), py::arg("dtype"), py::arg("op"), py::arg("stream"))
      .def("scale_div",
           [](DeviceOps& d, uintptr_t p, size_t count, const std::string& dtype, int64_t n, uintptr_t s) {
             d.scale_div(as_ptr(p), count, parse_dtype(dtype), n, as_ptr(s));
           },
           py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("n"), py::arg("stream"))
      .def("scale_mul",
           [](DeviceOps& d, uintptr_t p, size_t count, const std::string& dtype, uintptr_t scalar_dev,
              const std::string& scalar_host, uintptr_t s) {
             if (!scalar_dev && scalar_host.size() < dtype_size(parse_dtype(dtype)))
               throw std::invalid_argument("scale_mul: scalar_host has fewer bytes than the dtype");
             d.scale_mul(as_ptr(p), count, parse_dtype(dtype), as_ptr(scalar_dev),
                         scalar_dev ? nullptr : scalar_host.data(), as_ptr(s));
           },
           py::arg("ptr"), py::arg("count"), py::arg("dtype"), py::arg("scalar_dev"), py::arg("scalar_host"),
           py::arg("stream"),
           "scalar_host: the scalar's bytes (used when scalar_dev is 0).");
  m.def("device_ops", &make_device_ops, py::arg("runtime"), py::arg("library") = "");
  m.def("runtime_api",
        [](const std::string& runtime) {
          RuntimeApi a = runtime_api(runtime);
          return py::make_tuple(a.constants, a.functions);
        },
        py::arg("runtime"),
        "The vendor declarations a device runtime module uses (csrc/device_ops.h: runtime_api): "
        "(constants {name: value}, functions {name: [return type, parameter types...]}).");

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine",
      "The progress engine of one multi-vendor group (csrc/engine.h states the contracts).")
      .def(py::init([](const py::dict& transports, int rank, int threads, std::vector<int> check_peers,
                       std::vector<std::vector<int>> groups, std::vector<int> group_of,
                       std::vector<std::map<int64_t, std::string>> field_names,
                       size_t device_slot_bytes, uint32_t device_slots, int msg_window,
                       EngineOptions::Table host_chunks, EngineOptions::Table device_chunks,
                       EngineOptions::Table msg_chunks, uint64_t force_chunk,
                       bool abort_on_device_failure, std::vector<int> device_direct_peers) {
             std::map<int, std::shared_ptr<Transport>> links;
             for (auto kv : transports)
               links[kv.first.cast<int>()] = kv.second.cast<PyTransport&>().shared();
             EngineOptions o;
             o.rank = rank;
             o.threads = threads;
             o.check_peers = std::move(check_peers);
             o.groups = std::move(groups);
             o.group_of = std::move(group_of);
             o.field_names = std::move(field_names);
             o.device_slot_bytes = device_slot_bytes;
             o.device_slots = device_slots;
             o.msg_window = msg_window;
             o.host_chunks = std::move(host_chunks);
             o.device_chunks = std::move(device_chunks);
             o.msg_chunks = std::move(msg_chunks);
             o.force_chunk = force_chunk;
             o.abort_on_device_failure = abort_on_device_failure;
             o.device_direct_peers = std::move(device_direct_peers);
             return std::make_shared<Engine>(std::move(links), std::move(o));
           }),
           py::arg("transports"), py::arg("rank"), py::arg("threads"), py::arg("check_peers"),
           py::arg("groups"), py::arg("group_of"), py::arg("field_names"),
           py::arg("device_slot_bytes"), py::arg("device_slots"), py::arg("msg_window"),
           py::arg("host_chunks"), py::arg("device_chunks"), py::arg("msg_chunks"),
           py::arg("force_chunk"), py::arg("abort_on_device_failure"),
           py::arg("device_direct_peers") = std::vector<int>{},
           "transports: {peer rank: Transport} for every cross-vendor peer; device_direct_peers: "
           "message links whose device data goes to the transport directly.")
      .def("post",
           [](Engine& e, const std::vector<std::tuple<int, bool, uintptr_t, size_t>>& items,
              uint64_t tag_base, uint32_t index_bits, const std::string& op, const std::string& dtype,
              bool reduce, bool roundtrip, size_t chunk_bytes, int64_t timeout_ms, const std::string& what,
              bool check, const std::vector<int64_t>& header, uint32_t compare_mask,
              const std::string& error, bool header_for_group, uint64_t header_tag, bool wait_check,
              bool device, int device_index, uintptr_t stream, uintptr_t side_stream, bool message) {
             PlanSpec s;
             s.items.reserve(items.size());
             for (auto& it : items)
               s.items.push_back(PlanItem{std::get<0>(it), std::get<1>(it), std::get<2>(it), std::get<3>(it)});
             s.tag_base = tag_base;
             s.index_bits = index_bits;
             s.reduce = reduce;
             if (reduce) s.op = parse_op(op);
             if (reduce) s.dtype = parse_dtype(dtype);
             s.roundtrip = roundtrip;
             s.chunk_bytes = chunk_bytes;
             s.timeout_ms = timeout_ms;
             s.what = what;
             s.check = check;
             for (size_t i = 0; i < header.size() && i < size_t(CheckHeader::kFields); ++i)
               s.header.f[i] = header[i];
             s.compare_mask = compare_mask;
             s.error = error;
             s.header_for_group = header_for_group;
             s.header_tag = header_tag;
             s.device = device;
             s.device_index = device_index;
             s.stream = stream;
             s.side_stream = side_stream;
             s.message = message;
             py::gil_scoped_release nogil;
             return e.post(s, wait_check);
           },
           py::arg("items"), py::arg("tag_base"), py::arg("index_bits"), py::arg("op"),
           py::arg("dtype"), py::arg("reduce"), py::arg("roundtrip"), py::arg("chunk_bytes"),
           py::arg("timeout_ms"), py::arg("what"), py::arg("check"), py::arg("header"),
           py::arg("compare_mask"), py::arg("error"), py::arg("header_for_group"),
           py::arg("header_tag"), py::arg("wait_check"), py::arg("device"), py::arg("device_index"),
           py::arg("stream"), py::arg("side_stream"), py::arg("message") = false,
           "Posts one plan (items: (peer, is_send, ptr, nbytes)); returns its id. message: a "
           "point-to-point message of device data (engine.h, PlanSpec::message).")
      .def("wait", &Engine::wait, py::arg("plan"), py::call_guard<py::gil_scoped_release>())
      .def("test", &Engine::test, py::arg("plan"), py::call_guard<py::gil_scoped_release>())
      .def("set_device_ops", &Engine::set_device_ops, py::arg("ops"))
      .def("_set_position_base", &Engine::set_position_base, py::arg("base"),
           "Tests: message links start at this position (wrap-around of positions).")
      .def("stream_join", &Engine::stream_join, py::arg("device_index"), py::arg("waiter"),
           py::arg("waitee"))
      .def("drain", &Engine::drain, py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>(),
           "Waits (bounded) until no device plan or message is pending; see engine.h.")
      .def("broken", &Engine::broken)
      .def("stats", &Engine::stats)
      .def("close", &Engine::close, py::call_guard<py::gil_scoped_release>())
      .def("unregister_rings", &Engine::unregister_rings, py::call_guard<py::gil_scoped_release>(),
           "After close(), before the transports close, with no stream work left on the rings "
           "(engine.h).");

}
