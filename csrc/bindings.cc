// hetccl._C: pybind11 bindings of the bridge core. The Python API here is a contract with
// hetccl's Python backend (see docs/transports.md): keep names and signatures stable.
// Every call that may block (connect, close, wait, wait_all, reduce_into, scale_div, the zc
// waits) releases the GIL. Pointers travel as Python ints (tensor.data_ptr()).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <chrono>
#include <thread>

#include "common.h"
#include "exchange.h"
#include "reduce.h"
#include "transport.h"

namespace py = pybind11;
using namespace hetccl;

namespace {

PyObject* g_comm_error = nullptr;
PyObject* g_comm_timeout = nullptr;
PyObject* g_peer_failure = nullptr;
PyObject* g_truncated = nullptr;

void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// Python-facing transport: owns the C++ one; close() is idempotent and also run on destruction.
class PyTransport {
 public:
  PyTransport(const std::string& name, int rank, int size, const py::dict& options) {
    Options opts;
    for (auto kv : options) opts[py::str(kv.first)] = py::str(kv.second);
    t_ = make_transport(name, rank, size, opts);
  }
  Transport& t() { return *t_; }

 private:
  std::unique_ptr<Transport> t_;
};

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
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
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
      .def_property_readonly("zc_supported", [](PyTransport& s) { return s.t().zc_supported(); })
      .def("zc_regions",
           [](PyTransport& s) {
             std::vector<std::pair<uintptr_t, size_t>> v;
             for (auto& r : s.t().zc_regions()) v.emplace_back(reinterpret_cast<uintptr_t>(r.first), r.second);
             return v;
           })
      .def("zc_send_acquire",
           [](PyTransport& s, int peer, int64_t timeout_ms) {
             auto r = s.t().zc_send_acquire(peer, timeout_ms);
             return std::make_pair(reinterpret_cast<uintptr_t>(r.first), r.second);
           },
           py::arg("peer"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
      .def("zc_send_commit",
           [](PyTransport& s, int peer, size_t nbytes, uint64_t tag) { s.t().zc_send_commit(peer, nbytes, tag); },
           py::arg("peer"), py::arg("nbytes"), py::arg("tag"))
      .def("zc_recv_acquire",
           [](PyTransport& s, int peer, int64_t timeout_ms) {
             auto r = s.t().zc_recv_acquire(peer, timeout_ms);
             return std::make_tuple(reinterpret_cast<uintptr_t>(std::get<0>(r)), std::get<1>(r), std::get<2>(r));
           },
           py::arg("peer"), py::arg("timeout_ms"), py::call_guard<py::gil_scoped_release>())
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

  m.def("transport_names", &transport_names);

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
  m.def("pair_allreduce",
        [](PyTransport& t, int peer, uintptr_t give, size_t give_bytes, uintptr_t keep,
           size_t keep_bytes, const std::string& op, const std::string& dtype, size_t chunk_bytes,
           uint64_t tag, int64_t timeout_ms) {
          ReduceOp o = parse_op(op);
          DType d = parse_dtype(dtype);
          py::gil_scoped_release nogil;
          pair_allreduce(t.t(), peer, as_ptr(give), give_bytes, as_ptr(keep), keep_bytes, o, d,
                         chunk_bytes, tag, timeout_ms);
        },
        py::arg("transport"), py::arg("peer"), py::arg("give_ptr"), py::arg("give_bytes"),
        py::arg("keep_ptr"), py::arg("keep_bytes"), py::arg("op"), py::arg("dtype"),
        py::arg("chunk_bytes"), py::arg("tag"), py::arg("timeout_ms"),
        "Two-rank ring all-reduce of one range with `peer` on the calling thread over the "
        "transport's zero-copy ring (csrc/exchange.h states the contract).");
  m.def("dtype_names", &dtype_names);
  m.def("op_names", &op_names);
}
