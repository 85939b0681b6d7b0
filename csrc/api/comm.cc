// hetccl C API communicator (contracts in comm.h).
#include "comm.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <numeric>

#include "../common.h"
#include "../crash.h"
#include "bootstrap.h"

namespace hetccl {
namespace api {
namespace {

// Tags (below kMaxTag = 2^48): bit 47 marks point-to-point; collectives put their sequence
// number (18 bits, wrapping) above 16 bits of step (the check's steps have the top one set)
// above the engine's 13 bits of chunk index.
constexpr uint64_t kP2PTag = uint64_t(1) << 47;
constexpr int kIndexBits = 13;

std::string get(const std::vector<std::pair<std::string, std::string>>& kv, const std::string& k) {
  for (auto& p : kv)
    if (p.first == k) return p.second;
  return "";
}

}  // namespace

uint64_t Comm::tag(uint64_t seq, uint32_t s, bool check) {
  uint64_t step = (check ? kMaxSteps : 0) | (s & (kMaxSteps - 1));
  return ((seq & 0x3FFFF) << 29) | (step << kIndexBits);
}

Comm::Comm(int nranks, const hetcclUniqueId& id, int r, const std::string* vendor) : rank(r), size(nranks) {
  settings = read_settings();
  if (vendor) settings.vendor = *vendor;
  if (settings.vendor.empty() && !settings.vendor_split.empty()) settings.vendor = split_label(settings.vendor_split, rank);
  if (settings.crash_backtrace) install_crash_backtrace();
  UniqueIdData d = decode_id(id);
  std::string bind = settings.ifname.empty() ? local_addr_towards(d.root) : iface_addr(settings.ifname);
  Options topt{{"secret", to_hex(d.secret)},
               {"nconn", std::to_string(settings.tcp_nconn)},
               {"bind_addr", bind}};
  // shm geometry, unless set: a process whose device runtime is loaded (a GPU process: the
  // drop-in's, a framework's) will move large calls through the rings on the device route
  // (device_route.h), whose copy engines want few large chunks: slots of the device table's
  // largest chunk and 64 MiB per rank, as the torch face's GPU builds; any other process carries
  // host data only: the host table's largest chunk and 8 MiB. Both ends of a ring must agree
  // (the transport refuses a peer of another geometry), as every process of a job is of one kind.
  const bool device_process = device_runtime_loaded(settings.device_runtime, settings.device_library);
  size_t slot = settings.shm_slot_bytes;
  if (!slot)
    for (auto& row : device_process ? settings.device_chunks : settings.host_chunks)
      slot = std::max<size_t>(slot, row.second);
  size_t budget = settings.shm_budget_bytes ? settings.shm_budget_bytes : size_t(device_process ? 64 : 8) << 20;
  topt["slot_bytes"] = std::to_string(slot);
  topt["nslots"] = std::to_string(settings.shm_nslots);
  // one outgoing segment per shm neighbour, at most two: the budget over two (over one for a
  // pair), the same on every rank so that both segments of a pair get one geometry
  topt["seg_budget"] = std::to_string(budget / (size > 2 ? 2 : 1));
  // The transports, by capability from the registry (transport.h; no transport named here):
  // far, the most preferred one that reaches other hosts and connects lazily (a communicator of
  // n ranks connects only the peers it talks to: the C API's scale); near, the most preferred
  // one with zero-copy rings on this host, for ring neighbours (HETCCL_CAPI_SHM=0: none).
  // The choice reads only capability flags that do not depend on the process (zero-copy rings,
  // reach, lazy connections), so every rank picks the same two, whatever else its build has
  // (a UCX of its vendor's own: connects eagerly, never taken here).
  for (auto& c : transport_table()) {
    if (far_name_.empty() && c.other_host && c.lazy_connect) far_name_ = c.name;
    if (near_name_.empty() && c.same_host && c.zero_copy) near_name_ = c.name;
  }
  if (far_name_.empty()) throw CommError("hetccl: no registered transport reaches other hosts with lazy connections");
  topt["lazy"] = "1";
  far_ = std::shared_ptr<Transport>(make_transport(far_name_, rank, size, topt));
  if (settings.shm && size > 1 && !near_name_.empty())
    near_ = std::shared_ptr<Transport>(make_transport(near_name_, rank, size, topt));
  char hn[256] = {0};
  gethostname(hn, sizeof hn - 1);
  std::vector<std::pair<std::string, std::string>> mine{
      {"host_id", host_id()}, {"hostname", hn}, {"pid", std::to_string(getpid())},
      {"vendor", settings.vendor}, {"far", far_->address()}};
  if (near_) mine.emplace_back("near", near_->address());
  // the rings' geometry as asked for (equal asks make equal rings): a neighbour that asked for
  // another (one process with the device runtime loaded, the other without) is reached far
  const std::string geometry = topt["slot_bytes"] + "/" + topt["nslots"] + "/" + topt["seg_budget"];
  mine.emplace_back("near_geometry", geometry);
  // The settings that decide a call's steps (the algorithm, how calls are cut) must be alike on
  // every rank, or the ranks would run different steps and meet only at the timeout: compared
  // once below, refused on every rank alike (each has the whole table).
  const std::string schedule = "HETCCL_CAPI_ALGO=" + settings.algo +
                               " HETCCL_STREAM_CHUNK_BYTES=" + std::to_string(settings.stream_chunk_bytes) +
                               " HETCCL_CAPI_DEVICE_CHUNK_BYTES=" + std::to_string(settings.device_chunk_bytes);
  mine.emplace_back("schedule", schedule);
  int mail_fd = -1;
  std::vector<std::string> table = join(d, rank, size, encode_kv(mine), bind, settings.timeout_ms, &mail_fd, &listeners_);
  secret_ = d.secret;
  mailbox_ = std::make_unique<Mailbox>(mail_fd, d.secret);
  std::vector<std::vector<std::pair<std::string, std::string>>> rows;
  for (auto& e : table) {
    table_bytes_ += e.size();
    rows.push_back(decode_kv(e));
  }
  peers.resize(size);
  for (int p = 0; p < size; ++p) {
    peers[p].host_id = get(rows[p], "host_id");
    peers[p].hostname = get(rows[p], "hostname");
    peers[p].vendor = get(rows[p], "vendor");
    peers[p].pid = std::atoll(get(rows[p], "pid").c_str());
  }
  for (int p = 0; p < size; ++p)
    if (get(rows[p], "schedule") != get(rows[0], "schedule"))
      throw UsageRefusal("hetccl: the ranks' schedule settings differ: rank 0 has " + get(rows[0], "schedule") +
                         ", rank " + std::to_string(p) + " has " + get(rows[p], "schedule") +
                         " (set them alike on every rank)");
  vgroup_of.assign(size, 0);
  vlocal.assign(size, 0);
  {
    std::map<std::string, int> index;
    for (int p = 0; p < size; ++p) {
      auto it = index.emplace(peers[p].vendor, int(vgroups.size())).first;
      if (it->second == int(vgroups.size())) vgroups.emplace_back();
      vgroup_of[p] = it->second;
      vlocal[p] = int(vgroups[it->second].size());
      vgroups[it->second].push_back(p);
    }
    long long l = 1;
    for (auto& g : vgroups) {
      l = l / std::gcd(l, (long long)g.size()) * (long long)g.size();
      if (l > kHierMaxBlocks) break;
    }
    vgroup_lcm = l > kHierMaxBlocks ? 0 : int(l);
  }
  // Which transport reaches each peer: the same verdict on both ends of a pair (neighbourhood
  // and host identity are symmetric, and every rank has both tables).
  std::vector<std::string> far_addr(size), near_addr(size);
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    bool neighbour = p == next() || p == prev();
    std::string na = get(rows[p], "near");
    if (near_ && neighbour && peers[p].host_id == peers[rank].host_id && !na.empty() &&
        get(rows[p], "near_geometry") == geometry) {
      near_addr[p] = na;
      links_[p] = near_;
    } else {
      far_addr[p] = get(rows[p], "far");
      links_[p] = far_;
    }
  }
  bool any_near = std::any_of(near_addr.begin(), near_addr.end(), [](const std::string& a) { return !a.empty(); });
  if (near_ && !any_near) {  // no neighbour on this host: the near transport serves nobody
    near_->close();
    near_.reset();
  }
  if (near_) near_->connect(near_addr, settings.timeout_ms);
  far_->connect(far_addr, settings.timeout_ms);  // lazy: records the addresses only
  EngineOptions eo;
  eo.rank = rank;
  eo.threads = settings.reduce_threads;
  eo.groups = {{}};
  for (int p = 0; p < size; ++p) eo.groups[0].push_back(p);
  eo.group_of.assign(size, 0);
  eo.host_chunks = settings.host_chunks;
  eo.msg_chunks = settings.msg_chunks;
  eo.device_chunks = settings.device_chunks;  // the device route's plans (device_route.h)
  // Message links (tcp) stage device data through pinned slots of their own, made for a link
  // when its first device plan is posted: 4 slots of 1 MiB each way (the engine's default of
  // 8 x 8 MiB is sized for the torch face's few bridge peers).
  eo.device_slot_bytes = size_t(1) << 20;
  eo.device_slots = 4;
  eo.abort_on_device_failure = false;
  engine_ = std::make_unique<Engine>(links_, eo);
}

Comm::~Comm() {
  // Destroy: the calls already issued on streams run first (NCCL's ncclCommDestroy completes
  // them too), bounded by the timeout per call.
  if (stream_path_) stream_path_->finish(false);
  abort();
}

uint64_t Comm::next_shrink(const std::vector<int>& excluded) {
  uint64_t count = ++shrinks_[excluded];
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the set and the count
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  for (int r : excluded) mix(uint64_t(uint32_t(r)));
  mix(~uint64_t(0));
  mix(count);
  return h;
}

void Comm::mail_to(int peer, uint64_t key, const std::string& payload) {
  mail(listeners_.at(size_t(peer)), secret_, key, payload, settings.timeout_ms, "rank " + std::to_string(peer));
}

std::string Comm::mail_from(int leader, uint64_t key) {
  return mailbox_->wait(key, settings.timeout_ms, "rank " + std::to_string(leader) + " (the shrink's leader) to send the new communicator's id");
}

void Comm::interrupt() {
  aborting_.store(true);  // run() refuses calls from now on; wait_request gives up
  StreamPath* sp = nullptr;
  {
    // only read under the lock (a call may be creating it); used outside it, so no lock of the
    // stream path's is ever taken under this one (it is freed only by abort(), after this)
    std::lock_guard<std::mutex> g(stream_path_mu_);
    sp = stream_path_.get();
  }
  if (sp) sp->request_abort();
  if (engine_) engine_->close();  // fails what the executor and the issuing thread wait for
}

bool Comm::wait_calls_left(int own) {
  // bounded: every wait of a call in progress ends at once after interrupt(), but for waits no
  // interrupt reaches (a split's bootstrap join, bounded by its own timeout): the caller then
  // leaves the communicator allocated rather than free it under that call
  for (int i = 0; i < 30000 && calls_.load() > own; ++i) usleep(1000);
  if (calls_.load() <= own) return true;
  log_warn("capi", "hetcclCommAbort: a call on the communicator did not return in 30 s: its memory is "
                   "left allocated (not freed under the call)");
  return false;
}

void Comm::keep_until_closed(std::shared_ptr<void> buf) {
  std::lock_guard<std::mutex> g(kept_mu_);
  kept_.push_back(std::move(buf));
}

void Comm::abort() {
  if (closed_) return;
  closed_ = true;
  interrupt();           // fails what the executor and any caller wait for
  // The executor joined and the route's streams synced first (they copy into the shm rings'
  // slots, which closing the transports unmaps); then the transports, so that a request a
  // failed job left posted into the stream path's staging ends before that memory is freed
  // (reset(): once the callers' streams drained too).
  if (stream_path_) stream_path_->finish(true);
  if (near_) near_->close();
  if (far_) far_->close();
  stream_path_.reset();
  engine_.reset();
  links_.clear();
}

Transport& Comm::link(int peer) {
  auto it = links_.find(peer);
  if (it == links_.end())
    throw CommError("hetccl: rank " + std::to_string(peer) + " is not a peer of rank " +
                    std::to_string(rank) + " in a communicator of " + std::to_string(size));
  return *it->second;
}

uint64_t Comm::post(uint64_t tag_base, const std::vector<Item>& items, bool reduce, ReduceOp op,
                    DType dtype) {
  PlanSpec s;
  for (auto& it : items)
    if (it.nbytes) s.items.push_back(PlanItem{it.peer, it.send, reinterpret_cast<uintptr_t>(it.ptr), it.nbytes});
  if (s.items.empty()) return 0;
  s.tag_base = tag_base;
  s.index_bits = kIndexBits;
  s.reduce = reduce;
  s.op = op == ReduceOp::AVG ? ReduceOp::SUM : op;
  s.dtype = dtype;
  s.timeout_ms = settings.timeout_ms;
  s.what = "collective #" + std::to_string(seq_);
  return engine_->post(s, false);
}

void Comm::post_device(uint64_t tag_base, const std::vector<Item>& items, DeviceRoute& d) {
  PlanSpec s;
  for (auto& it : items)
    if (it.nbytes) s.items.push_back(PlanItem{it.peer, it.send, reinterpret_cast<uintptr_t>(it.ptr), it.nbytes});
  if (s.items.empty()) return;
  s.tag_base = tag_base;
  s.index_bits = kIndexBits;
  s.timeout_ms = settings.timeout_ms;
  s.what = "collective #" + std::to_string(seq_) + " (device route)";
  s.chunk_bytes = settings.device_chunk_bytes;  // 0: the device table; a slot at most either way
  s.device = true;
  s.device_index = d.device;
  s.stream = reinterpret_cast<uintptr_t>(d.main);
  s.side_stream = reinterpret_cast<uintptr_t>(d.side);
  engine_->post(s, false);
}

void Comm::attach_device(std::shared_ptr<DeviceOps> ops, int device_index) {
  engine_->set_device_ops(std::move(ops));
  if (size > 1) engine_->prepare_device(device_index, {next(), prev()});
}

hetcclResult_t Comm::broken_code() {
  hetcclResult_t code = broken_code_.load(std::memory_order_acquire);
  if (code != hetcclSuccess || !engine_) return code;
  try {
    engine_->rethrow_broken();
  } catch (...) {
    note_failure(std::current_exception(), true);
  }
  return broken_code_.load(std::memory_order_acquire);
}

void Comm::wait(uint64_t plan) {
  if (plan) engine_->wait(plan);
}

void Comm::step(uint64_t tag_base, const std::vector<Item>& items, bool reduce, ReduceOp op,
                DType dtype) {
  wait(post(tag_base, items, reduce, op, dtype));
}

RequestPtr Comm::post_send(int peer, const void* buf, size_t nbytes) {
  return link(peer).isend(peer, buf, nbytes, kP2PTag);
}

RequestPtr Comm::post_recv(int peer, void* buf, size_t nbytes) {
  return link(peer).irecv(peer, buf, nbytes, kP2PTag);
}

size_t Comm::wait_request(const RequestPtr& req) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(settings.timeout_ms);
  // Giving up (abort, timeout) withdraws a receive that has not begun, so a late peer cannot
  // write into the caller's buffer after the call returned; one already arriving stays posted
  // (callers whose buffers die with the call keep them: keep_until_closed).
  for (;;) {
    if (aborting_.load()) {
      withdraw(req, /*unpost=*/false);
      throw CommError("hetccl: the communicator was aborted");
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now()).count();
    try {
      return req->wait(std::max<int64_t>(0, std::min<int64_t>(left, 50)));
    } catch (const CommTimeout&) {
      if (left <= 50) {
        withdraw(req, /*unpost=*/false);
        throw CommTimeout("hetccl: Timed out after " + std::to_string(settings.timeout_ms) +
                          " ms waiting for peer rank " + std::to_string(req->peer()) + " (" +
                          std::to_string(req->posted_nbytes()) + " bytes)");
      }
    }
  }
}

bool Comm::withdraw(const RequestPtr& req, bool unpost) {
  if (req->peer() < 0 || req->peer() >= size || req->peer() == rank) return false;
  try {
    return link(req->peer()).cancel(req, unpost);
  } catch (...) {
    return false;  // a closed transport: nothing to withdraw
  }
}

bool Comm::settle(const RequestPtr& req, bool recv, int64_t within_ms) {
  if (!req || req->test_nothrow()) return true;
  if (recv && (withdraw(req, /*unpost=*/true) || withdraw(req, /*unpost=*/false))) return true;
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(within_ms);
  while (!req->test_nothrow() && std::chrono::steady_clock::now() < until) usleep(200);
  return req->test_nothrow();
}

RequestPtr Comm::post_tagged(int peer, bool send, void* buf, size_t nbytes, uint64_t tag) {
  const uint64_t t = kP2PTag | tag;
  return send ? link(peer).isend(peer, buf, nbytes, t) : link(peer).irecv(peer, buf, nbytes, t);
}

void Comm::mark_broken(hetcclResult_t code, const std::string& text) {
  {
    std::lock_guard<std::mutex> g(broken_mu_);
    if (broken_code_.load() != hetcclSuccess) return;
    broken_text_ = text;
    broken_code_.store(code, std::memory_order_release);
  }
  // Fail what the transports still hold so that peers waiting on this rank learn it now.
  if (engine_) engine_->close();
}

std::string Comm::broken_text() {
  std::lock_guard<std::mutex> g(broken_mu_);
  return broken_text_;
}

hetcclResult_t classify(std::exception_ptr e, std::string* text, bool* argument) {
  *argument = false;
  try {
    std::rethrow_exception(e);
  } catch (const UsageRefusal& x) {
    *text = x.what();
    *argument = true;
    return hetcclInvalidUsage;
  } catch (const ArgMismatch& x) {
    *text = x.what();
    *argument = true;
    return hetcclInvalidArgument;
  } catch (const PeerFailure& x) {
    *text = x.what();
    return hetcclRemoteError;
  } catch (const CommTimeout& x) {
    *text = x.what();
    return hetcclRemoteError;
  } catch (const CommError& x) {
    *text = x.what();
    return hetcclSystemError;
  } catch (const std::bad_alloc&) {
    *text = "hetccl: out of memory";
    return hetcclSystemError;
  } catch (const std::exception& x) {
    *text = x.what();
    return hetcclInternalError;
  } catch (...) {
    *text = "hetccl: unknown exception";
    return hetcclInternalError;
  }
}

void Comm::note_failure(std::exception_ptr e, bool arguments_too) {
  try {
    std::rethrow_exception(e);
  } catch (const EveryRankRefused&) {
    return;  // every caller has its refusal; nothing moved
  } catch (...) {
  }
  std::string text;
  bool argument = false;
  hetcclResult_t code = classify(e, &text, &argument);
  if (argument && !arguments_too) return;
  mark_broken(code, text);
}

StreamPath& Comm::streams() {
  // the runtime and its library by name, as the device registry knows them (device_ops.h)
  std::lock_guard<std::mutex> g(stream_path_mu_);
  if (!stream_path_) stream_path_ = std::make_unique<StreamPath>(*this, settings.device_runtime, settings.device_library);
  return *stream_path_;
}

std::string Comm::info() {
  // Built with std::string, not an ostringstream: the line is the same, and this library then
  // needs no iostream/locale state of the process that loads it (a C ABI library is loaded into
  // programs whose libstdc++ set-up it does not control).
  int n_near = 0, n_far = 0;
  for (auto& kv : links_) (kv.second == near_ ? n_near : n_far)++;
  // links_<transport>: how many peers each of the two transports reaches (0 for near where it
  // serves nobody or none exists)
  std::string o = "rank=" + std::to_string(rank) + " size=" + std::to_string(size) + " links_" + far_name_ +
                  "=" + std::to_string(n_far) +
                  (near_name_.empty() ? std::string() : " links_" + near_name_ + "=" + std::to_string(n_near)) +
                  " vendor=" + (settings.vendor.empty() ? std::string("-") : settings.vendor) +
                  " bootstrap_table_bytes=" + std::to_string(table_bytes_);
  auto add = [&o](const char* prefix, const std::string& key, const std::string& value) {
    o += " ";
    o += prefix;
    o += key + "=" + value;
  };
  const std::string far_p = far_name_ + "_", near_p = near_name_ + "_";
  if (far_)
    for (auto& kv : far_->info()) add(far_p.c_str(), kv.first, kv.second);
  if (near_)
    for (auto& kv : near_->info()) add(near_p.c_str(), kv.first, kv.second);
  if (engine_)
    for (auto& kv : engine_->stats()) add("engine_", kv.first, std::to_string(kv.second));
  for (auto& kv : algo_runs) add("algo_", kv.first, std::to_string(kv.second));
  if (stream_path_)
    for (auto& kv : stream_path_->stats()) add("stream_", kv.first, std::to_string(kv.second));
  return o;
}

}  // namespace api
}  // namespace hetccl
