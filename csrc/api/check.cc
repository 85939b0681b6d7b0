// The C API's argument check: before any data of a collective moves, every rank's header goes
// to every rank (a ring all-gather of fixed-size headers: n-1 steps, O(n) bytes per rank, peers
// per rank constant), and every rank compares the same table, so the verdict and its text are
// the same everywhere. A header carries the call's collective, count, dtype, op and root and,
// when this rank already refused the call (bad root, a stream, an unsupported dtype), the text
// of its refusal: the other ranks then fail with that text too instead of waiting for it.
// The communicator stays usable after a mismatch: nothing of the collective was sent.
// For n a power of two the all-gather is recursive doubling instead (log2(n) steps, select.cc).
// Trade-off: n-1 small steps per collective on a ring (HETCCL_CHECK_ARGS=0 removes them; a rank's own
// refusal then returns at once on that rank only, and its peers wait until the timeout, as with
// NCCL).
#include <cstring>
#include <string>
#include <vector>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {
namespace {

struct Header {
  int64_t f[6];      // collective, count, dtype, op, root, refusal (0 none, 1 argument, 2 usage)
  char error[208];   // this rank's refusal (NUL-terminated, truncated)
};
static_assert(sizeof(Header) == 256, "fixed-size header");

const char* kFields[] = {"collective", "count", "dtype", "op", "root"};

std::string value(int field, int64_t v) {
  return field == 0 ? coll_name(Coll(v)) : std::to_string(v);
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
                const std::string& refusal, bool usage) {
  const char* what = coll_name(coll);
  const int n = c.size, r = c.rank;
  std::vector<Header> all(static_cast<size_t>(n));
  Header& mine = all[size_t(r)];
  std::memset(&mine, 0, sizeof mine);
  int64_t f[6] = {int64_t(coll), count, dtype, op, root, refusal.empty() ? 0 : usage ? 2 : 1};
  std::memcpy(mine.f, f, sizeof f);
  std::strncpy(mine.error, refusal.c_str(), sizeof mine.error - 1);
  uint64_t seq = c.begin();
  char* out = reinterpret_cast<char*>(all.data());
  const size_t blk = sizeof(Header);
  if (select_check(c) == Algo::RecursiveDoubling) {
    // n a power of two: at step k this rank holds the 2^k headers of its aligned group and
    // swaps them with the partner group's (rank ^ 2^k): log2(n) steps
    uint32_t k = 0;
    for (int d = 1; d < n; d <<= 1, ++k) {
      int base = r & ~(d - 1), other = base ^ d;
      c.step(Comm::tag(seq, k, true), {{r ^ d, true, out + size_t(base) * blk, size_t(d) * blk},
                                       {r ^ d, false, out + size_t(other) * blk, size_t(d) * blk}});
    }
  } else {
    for (int k = 0; k < n - 1; ++k)
      c.step(Comm::tag(seq, uint32_t(k), true),
             {{c.next(), true, out + size_t(mod(r - k, n)) * blk, blk},
              {c.prev(), false, out + size_t(mod(r - k - 1, n)) * blk, blk}});
  }
  for (int p = 0; p < n; ++p)
    if (all[size_t(p)].f[5]) {
      all[size_t(p)].error[sizeof all[0].error - 1] = 0;
      std::string text = all[size_t(p)].error;
      text += " (refused by rank " + std::to_string(p) + ")";  // the same text on every rank
      if (all[size_t(p)].f[5] == 2) throw UsageRefusal(text);
      throw ArgMismatch(text);
    }
  for (int field = 0; field < 5; ++field) {
    if (field == 4 && Coll(all[0].f[0]) != Coll::Broadcast && Coll(all[0].f[0]) != Coll::Reduce)
      continue;  // root: rooted collectives only
    std::string diff;
    int shown = 0;
    for (int p = 1; p < n; ++p)
      if (all[size_t(p)].f[field] != all[0].f[field] && shown < 3) {
        diff += "; rank " + std::to_string(p) + " has " + value(field, all[size_t(p)].f[field]);
        ++shown;
      }
    if (!diff.empty())
      throw ArgMismatch(std::string("hetccl: ") + what + ": ranks disagree on " + kFields[field] +
                        ": rank 0 has " + value(field, all[0].f[field]) + diff);
  }
}

}  // namespace api
}  // namespace hetccl
