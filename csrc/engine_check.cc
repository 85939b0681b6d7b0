// The check-header wire protocol (engine.h, "Argument checks"): what one CheckHeader looks like
// on the wire, posting a plan's header to every cross-vendor peer and receiving theirs on the
// transports' tagged path, comparing them into the text every rank derives alike, and naming a
// mismatch that data revealed first (fail_mismatch).
//
// Contract. A plan with spec.check sends WireHeader (magic, status, for_group, text length,
// waits, the CheckHeader fields) plus at most kMaxText bytes of error text, with the plan's
// header_tag, to every peer of opts_.check_peers that has a link, and posts a receive of kHdrCap
// bytes from each. compare_headers is a pure function of the headers: "" when they agree on the
// fields of compare_mask and nobody reported an error, else the lowest rank's error text or the
// first differing field with the ranks holding each value (hetccl/checks.py words it alike).
//
// Locks: post_headers and a_peer_did_not_wait run on the posting thread without mu_ (the plan
// is not yet shared); compare_headers runs with or without it (it reads only the plan and
// opts_); progress_headers and fail_mismatch expect mu_ held (progress pass).
#include <algorithm>
#include <cstring>

#include "check_text.h"
#include "engine_internal.h"

namespace hetccl {
using namespace engine_detail;
namespace {

constexpr uint32_t kHdrMagic = 0x48434B31;  // "1KCH"
struct WireHeader {
  uint32_t magic;
  uint32_t status;     // 0: ok; 1: the sender knows the call is wrong (text follows)
  uint32_t for_group;  // 1: the sender's whole vendor group has this header (checked natively)
  uint32_t text_len;
  uint32_t waits;      // 1: the sender holds its data until every header is known (wait_check)
  uint32_t reserved;
  int64_t f[CheckHeader::kFields];
};
constexpr size_t kMaxText = 4096;
constexpr size_t kHdrCap = sizeof(WireHeader) + kMaxText;
// fail_mismatch: how long a chunk that does not fit waits for the headers that name why
constexpr int64_t kMismatchHeaderWaitMs = 2000;

static_assert(CheckHeader::kFields == kCheckFields, "check_text.h names every header field");

}  // namespace

// ----------------------------------------------------------------------------- check headers
void Engine::post_headers(Plan& p, bool waits) {
  const PlanSpec& s = p.spec;
  WireHeader h{};
  h.magic = kHdrMagic;
  h.waits = waits ? 1 : 0;
  h.status = s.error.empty() ? 0 : 1;
  h.for_group = s.header_for_group ? 1 : 0;
  std::string text = s.error.substr(0, kMaxText);
  h.text_len = uint32_t(text.size());
  for (int i = 0; i < CheckHeader::kFields; ++i) h.f[i] = s.header.f[i];
  p.my_hdr.resize(sizeof(h) + text.size());
  std::memcpy(p.my_hdr.data(), &h, sizeof(h));
  std::memcpy(p.my_hdr.data() + sizeof(h), text.data(), text.size());
  for (int peer : opts_.check_peers) {
    auto it = links_.find(peer);
    if (it == links_.end()) continue;
    Plan::HdrIn in;
    in.peer = peer;
    in.buf.resize(kHdrCap);
    in.req = it->second->t->irecv(peer, in.buf.data(), in.buf.size(), s.header_tag);
    p.hdr_in.push_back(std::move(in));
  }
  for (int peer : opts_.check_peers) {
    auto it = links_.find(peer);
    if (it == links_.end()) continue;
    p.hdr_out.push_back(it->second->t->isend(peer, p.my_hdr.data(), p.my_hdr.size(), s.header_tag));
  }
  p.headers_done = false;
  // Data is not held back for the headers: data tags carry the arguments' signature, so data of
  // a collective whose arguments differ never matches (message links) or is refused on arrival
  // (zero-copy rings), and the headers, compared as they arrive, name the difference.
}

// "" when every header received matches ours (and nobody reported an error), else the text
// every rank derives alike: the first reported error (lowest rank), or the first field that
// differs with the ranks holding each value.
std::string Engine::compare_headers(Plan& p) {
  const PlanSpec& s = p.spec;
  struct Entry {
    const WireHeader* h;
    std::string text;
  };
  std::map<int, Entry> by_rank;  // rank -> header it holds (whole groups when vouched for)
  auto add = [&](int from, const WireHeader* h, const std::string& text) {
    if (h->for_group && from < int(opts_.group_of.size())) {
      for (int r : opts_.groups[opts_.group_of[from]]) by_rank[r] = Entry{h, text};
    } else {
      by_rank[from] = Entry{h, text};
    }
  };
  const auto* mine = reinterpret_cast<const WireHeader*>(p.my_hdr.data());
  add(opts_.rank, mine, s.error.substr(0, kMaxText));
  for (auto& in : p.hdr_in) {
    size_t n = in.req->nbytes();
    const auto* h = reinterpret_cast<const WireHeader*>(in.buf.data());
    if (n < sizeof(WireHeader) || h->magic != kHdrMagic || sizeof(WireHeader) + h->text_len != n)
      return "hetccl: " + s.what + ": peer rank " + std::to_string(in.peer) +
             " sent a malformed argument header (" + std::to_string(n) +
             " bytes); the ranks run different hetccl versions or collectives";
    add(in.peer, h, std::string(in.buf.data() + sizeof(WireHeader), h->text_len));
  }
  for (auto& kv : by_rank)
    if (kv.second.h->status != 0) return kv.second.text;
  uint32_t mask = s.compare_mask;
  for (int f = 0; f < CheckHeader::kFields; ++f) {
    if (!(mask & (1u << f))) continue;
    bool differs = false;  // (names are made only for a field that differs: every call comes here)
    for (auto& kv : by_rank) differs = differs || kv.second.h->f[f] != by_rank.begin()->second.h->f[f];
    if (!differs) continue;
    std::string coll = std::to_string(mine->f[0]);
    if (!opts_.field_names.empty()) {
      auto it = opts_.field_names[0].find(mine->f[0]);
      if (it != opts_.field_names[0].end()) coll = it->second;
    }
    std::vector<RankValue> rv;
    for (auto& kv : by_rank) {
      int64_t v = kv.second.h->f[f];
      std::string name = std::to_string(v);
      if (f < int(opts_.field_names.size())) {
        auto it = opts_.field_names[f].find(v);
        if (it != opts_.field_names[f].end()) name = it->second;
      }
      rv.emplace_back(kv.first, v, name);
    }
    return mismatch_text(coll, kCheckFieldWhat[f], std::move(rv));  // check_text.h
  }
  return "";
}

// Whether a peer's header says it did not hold its data for the check (it issued the collective
// and its data may already be on the way or in our slots). Call once every header is in.
bool Engine::a_peer_did_not_wait(const Plan& p) const {
  for (auto& in : p.hdr_in) {
    if (in.req->nbytes() < sizeof(WireHeader)) continue;  // malformed: compare_headers says so
    if (!reinterpret_cast<const WireHeader*>(in.buf.data())->waits) return true;
  }
  return false;
}

bool Engine::progress_headers(Plan& p) {
  if (p.headers_done) return false;
  for (auto& in : p.hdr_in)
    if (!in.req->test()) return false;  // test() throws the request's failure
  for (auto& r : p.hdr_out)
    if (!r->test()) return false;  // our header's buffer lives in the plan until it has left
  p.headers_done = true;
  std::string bad = compare_headers(p);
  if (!bad.empty()) {
    // Data of this plan may already sit in our slots or on the streams: the rings are out of
    // step from here on.
    break_engine(bad + " (detected after the collective was issued; the group is unusable "
                       "from here on)",
                 kArg);
    return true;
  }
  p.gate = true;
  return true;
}

// A chunk that does not fit its plan (size or tag): the ranks disagree. When plans carry
// argument headers (HETCCL_CHECK_ARGS=async lets data move before they are compared), the
// headers name the difference (field and values) where the chunk cannot -- this plan's, or an
// earlier plan's still being checked: a device plan returns to its caller before its headers
// are compared, so a mismatching collective with no receive from this peer (a broadcast whose
// ranks disagree on the root) leaves its peer's data in the ring for the next plan to meet.
// A peer posts its header before its data, so the headers have been sent even when our
// receives of them have not completed yet (the transport's own threads complete them): wait
// for them briefly -- bounded, the engine is failing anyway, and a peer at another collective
// may never send the one we expect -- then compare, earliest plan first. Caller holds mu_.
// Throws ArgMismatch with the header text, else PeerFailure(generic).
void Engine::fail_mismatch(Plan& p, const std::string& generic) {
  const int64_t until = now_ms() + kMismatchHeaderWaitMs;
  for (auto& kv : plans_) {  // by id: the earliest plan's verdict first
    if (kv.first > p.id) break;
    Plan& q = *kv.second;
    if (q.hdr_in.empty()) continue;
    bool all = true;
    for (auto& in : q.hdr_in) {
      try {
        in.req->wait(std::max<int64_t>(0, until - now_ms()));
      } catch (const std::exception&) {
        all = false;  // not here in time, or failed
        break;
      }
    }
    if (!all) continue;
    std::string bad = compare_headers(q);
    if (!bad.empty())
      throw ArgMismatch(bad + " (detected after the collective was issued; the group is "
                              "unusable from here on)");
  }
  throw PeerFailure(generic);
}

}  // namespace hetccl
