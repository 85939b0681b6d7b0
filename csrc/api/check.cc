// The C API's argument check: before any data of a collective moves, the ranks agree on the
// call's collective, count, dtype, op and root and on whether any rank already refused it (bad
// root, a stream, an unsupported dtype), so the verdict and its text are the same everywhere.
// Two rounds, the second only when something is wrong:
//  1. summary (the common case): an all_reduce (MIN, int64) of 12 values per rank: each field,
//     its bitwise complement (so the minimum of those is the complement of the maximum), the
//     complement of the rank's refusal kind, and whether it took the device route (the minimum
//     says whether every rank did: device_route.h; never a mismatch). It travels on the
//     transports' tagged path, beside the engine's rings (summary_min). Where every field's minimum equals its maximum
//     and no rank refused, the call proceeds: O(1) bytes and the latency all_reduce's O(log n)
//     steps and peers per rank, whatever n (recursive doubling, folded when n is not 2^m).
//  2. headers (a mismatch or a refusal somewhere, every rank knows it from round 1): every rank's
//     fixed-size header (fields and its refusal's text) to every rank, an all-gather: recursive
//     doubling for n a power of two, Bruck's for any other n (ceil(log2 n) steps); O(n) bytes
//     per rank, on the failing call only. Every rank then composes the same text from the same
//     table: the lowest refusing rank's own text, else the first field on which ranks disagree,
//     in the wording every check of hetccl shares (../check_text.h: ranks grouped by value).
// HETCCL_CAPI_ALGO=ring: the headers' ring all-gather alone (n-1 steps) on every call.
// The communicator stays usable after a mismatch: nothing of the collective was sent. Where
// every rank refused the call itself, the verdict says so (EveryRankRefused: comm.h), and a
// stream call's executor then does not break the communicator either.
// Trade-off: one small all_reduce per collective (HETCCL_CHECK_ARGS=0 removes it; a rank's own
// refusal then returns at once on that rank only, and its peers wait until the timeout, as with
// NCCL).
#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "../check_text.h"
#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {
namespace {

struct Header {
  int64_t f[6];      // collective, count, dtype, op, root, refusal (0 none, 1 argument, 2 usage)
  int64_t route;     // 1: this rank took the device route (device_route.h), 0: the host route
  char error[200];   // this rank's refusal (NUL-terminated, truncated)
};
static_assert(sizeof(Header) == 256, "fixed-size header");


// The summary's all_reduce (MIN, int64): recursive doubling with MPICH's fold for n not a power
// of two (coll_allreduce_rd.cc's steps), each step one exchange on the transports' tagged path
// (Comm::post_tagged) rather than an engine plan: the check of a call must not wait for ring
// slots that an earlier device-route call's chunks still hold until its stream runs
// (device_route.h), or every call would wait for the one before it.
void summary_min(Comm& c, int64_t* v, size_t count) {
  uint64_t seq = c.begin();
  const size_t nb = count * sizeof(int64_t);
  // The exchange's buffers live on the heap: a step given up on (timeout, abort) may leave a
  // request posted into them, so they then stay with the communicator (keep_until_closed)
  // instead of dying with this frame while a late peer's message still lands in them.
  auto buf = std::make_shared<std::vector<int64_t>>(2 * count);
  int64_t* mine = buf->data();
  int64_t* theirs = mine + count;
  std::copy(v, v + count, mine);
  try {
    recursive_doubling(c.size, c.rank, [&](uint32_t step, int peer, bool send, bool recv, bool combine) {
      RequestPtr rs, rr;
      if (recv) rr = c.post_tagged(peer, false, combine ? theirs : mine, nb, Comm::tag(seq, step, true));
      if (send) rs = c.post_tagged(peer, true, mine, nb, Comm::tag(seq, step, true));
      if (rr) c.wait_request(rr);
      if (rs) c.wait_request(rs);
      if (recv && combine)
        for (size_t i = 0; i < count; ++i) mine[i] = std::min(mine[i], theirs[i]);
    });
  } catch (...) {
    c.keep_until_closed(buf);
    throw;
  }
  std::copy(mine, mine + count, v);
}

// A field's value as the mismatch text names it (the datatypes and ops of hetccl.h).
std::string value(int field, int64_t v) {
  static const char* const kTypes[] = {"int8", "uint8", "int32", "uint32", "int64",
                                       "uint64", "float16", "float32", "float64", "bfloat16"};
  static const char* const kOps[] = {"sum", "prod", "max", "min", "avg"};
  if (field == 0) return coll_name(Coll(v));
  if (field == 2 && v >= 0 && v < 10) return kTypes[v];
  if (field == 3 && v >= 0 && v < 5) return kOps[v];
  if (field == 3 && v >= 5) return "premul_sum operator " + std::to_string(v);
  return std::to_string(v);
}

}  // namespace

const char* coll_name(Coll c) {
  switch (c) {
    case Coll::AllReduce: return "all_reduce";
    case Coll::Broadcast: return "broadcast";
    case Coll::AllGather: return "all_gather";
    case Coll::ReduceScatter: return "reduce_scatter";
    case Coll::Reduce: return "reduce";
    case Coll::AllToAll: return "all_to_all";
  }
  return "?";
}

void check_args(Comm& c, Coll coll, int64_t count, int64_t dtype, int64_t op, int64_t root,
                const std::string& refusal, bool usage, bool device_route, bool* all_device) {
  const char* what = coll_name(coll);
  const int n = c.size, r = c.rank;
  int64_t f[6] = {int64_t(coll), count, dtype, op, root, refusal.empty() ? 0 : usage ? 2 : 1};
  if (all_device) *all_device = device_route;
  const Algo algo = select_check(c);
  if (algo != Algo::Ring) {
    const bool rooted = coll == Coll::Broadcast || coll == Coll::Reduce;
    int64_t v[12];
    for (int i = 0; i < 5; ++i) {
      int64_t x = i == 4 && !rooted ? 0 : f[i];  // root: rooted collectives only
      v[i] = x;
      v[5 + i] = ~x;
    }
    v[10] = ~f[5];
    v[11] = device_route ? 1 : 0;  // its minimum: 1 only where every rank took the device route
    ++c.algo_runs["check_summary"];
    summary_min(c, v, 12);
    bool agree = ~v[10] == 0;
    for (int i = 0; i < 5; ++i) agree = agree && v[i] == ~v[5 + i];
    if (all_device) *all_device = v[11] == 1;
    if (agree) return;
  }
  std::vector<Header> all(static_cast<size_t>(n));
  Header& mine = all[size_t(r)];
  std::memset(&mine, 0, sizeof mine);
  std::memcpy(mine.f, f, sizeof f);
  mine.route = device_route ? 1 : 0;
  std::strncpy(mine.error, refusal.c_str(), sizeof mine.error - 1);
  char* out = reinterpret_cast<char*>(all.data());
  const size_t blk = sizeof(Header);
  ++c.algo_runs[algo == Algo::RecursiveDoubling ? "check_headers_rd" : algo == Algo::Bruck ? "check_headers_bruck" : "check_ring"];
  if (algo == Algo::RecursiveDoubling) {
    uint64_t seq = c.begin();
    // n a power of two: at step k this rank holds the 2^k headers of its aligned group and
    // swaps them with the partner group's (rank ^ 2^k): log2(n) steps
    uint32_t k = 0;
    for (int d = 1; d < n; d <<= 1, ++k) {
      int base = r & ~(d - 1), other = base ^ d;
      c.step(Comm::tag(seq, k, true), {{r ^ d, true, out + size_t(base) * blk, size_t(d) * blk},
                                       {r ^ d, false, out + size_t(other) * blk, size_t(d) * blk}});
    }
  } else if (algo == Algo::Bruck) {
    // any n: Bruck's all-gather (coll_allgather_bruck.cc: reads this rank's header before it
    // writes any block, so in place is fine)
    all_gather_bruck(c, &mine, all.data(), 1, sizeof(Header));
  } else {
    uint64_t seq = c.begin();
    for (int k = 0; k < n - 1; ++k)
      c.step(Comm::tag(seq, uint32_t(k), true),
             {{c.next(), true, out + size_t(mod(r - k, n)) * blk, blk},
              {c.prev(), false, out + size_t(mod(r - k - 1, n)) * blk, blk}});
  }
  if (all_device)
    for (int p = 0; p < n; ++p) *all_device = *all_device && all[size_t(p)].route == 1;
  bool everyone = true;  // every rank refused the call itself (EveryRankRefused)
  for (int p = 0; p < n; ++p) everyone = everyone && all[size_t(p)].f[5] != 0;
  for (int p = 0; p < n; ++p)
    if (all[size_t(p)].f[5]) {
      all[size_t(p)].error[sizeof all[0].error - 1] = 0;
      std::string text = all[size_t(p)].error;
      text += " (refused by rank " + std::to_string(p) + ")";  // the same text on every rank
      if (all[size_t(p)].f[5] == 2) {
        if (everyone) throw UsageRefusedEverywhere(text);
        throw UsageRefusal(text);
      }
      if (everyone) throw ArgRefusedEverywhere(text);
      throw ArgMismatch(text);
    }
  for (int field = 0; field < 5; ++field) {
    if (field == 4 && Coll(all[0].f[0]) != Coll::Broadcast && Coll(all[0].f[0]) != Coll::Reduce)
      continue;  // root: rooted collectives only
    bool differs = false;  // (names are made only for a field that differs)
    for (int p = 1; p < n; ++p) differs = differs || all[size_t(p)].f[field] != all[0].f[field];
    if (!differs) continue;
    std::vector<RankValue> rv;
    for (int p = 0; p < n; ++p) {
      int64_t v = all[size_t(p)].f[field];
      rv.emplace_back(p, v, value(field, v));
    }
    // the one wording (check_text.h), shared with the engine's and the torch face's checks
    throw ArgMismatch(mismatch_text(what, kCheckFieldWhat[field], std::move(rv)));
  }
}

}  // namespace api
}  // namespace hetccl
