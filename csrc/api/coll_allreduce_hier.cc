// all_reduce across vendor groups, hierarchical (never funnelled through one leader): with G
// groups (labels: Comm::vgroups) of sizes m_g and L = lcm(m_g), the buffer is cut into L blocks
// (block_lo over L) and each group's rank j owns its j-th super-block of L/m_g blocks:
//   1. inside every group at once, a ring reduce-scatter over its m_g super-blocks (m_g - 1
//      steps between group neighbours): rank j ends with super-block j reduced over the group;
//   2. across groups: the blocks fall into runs whose owners (one rank per group) do not
//      change; each run is all-reduced among its G owners by a ring in group order (G - 1
//      reduce-scatter steps, then G - 1 all-gather steps over G sub-blocks of the run), every
//      run of a step posted at once (a tag each), so each rank moves only what it owns;
//   3. inside every group, a ring all-gather of the super-blocks (m_g - 1 steps).
// Every element is reduced to its final value by one rank (the owner of its sub-block in step
// 2; AVG divides there by n) and copied to the others, so every rank ends with the same bits.
// Trade-off: the data crosses between groups once each way, spread over every rank that owns
// some of it (2(G-1)/G of its share per rank, the ring's bound), where the flat ring sends all
// of it around a ring whose cross-group links carry 2(n-1)/n of the data each; inside a group
// the steps run between group neighbours (ring neighbours when each group's ranks are
// contiguous, the usual launch). More steps than the ring (m_g - 1 twice, 2(G - 1)): for large
// messages only (select.cc). Peers per rank: its two group neighbours plus, for each run it
// owns part of (at most L / m_g runs), its two neighbours in that run's ring of owners,
// connected on first use.
#include <cstring>
#include <exception>
#include <vector>

#include "comm.h"
#include "ring.h"

namespace hetccl {
namespace api {

void all_reduce_hier(Comm& c, const void* send, void* recv, size_t count, DType dt, size_t es,
                     ReduceOp op) {
  char* buf = static_cast<char*>(recv);
  uint64_t seq;
  if (!c.begin_in_place(send, recv, count * es, seq)) return;
  const int n = c.size;
  const int L = c.vgroup_lcm, G = int(c.vgroups.size());
  if (L <= 0 || G < 2) throw CommError("hetccl: all_reduce_hier: needs two or more vendor groups of at most " +
                                       std::to_string(Comm::kHierMaxBlocks) + " blocks (select.cc)");
  const int g = c.vgroup_of[c.rank], j = c.vlocal[c.rank];
  const std::vector<int>& mine = c.vgroups[g];
  const int m = int(mine.size());
  // element offset of block b (b = L: count)
  auto at = [&](int b) { return block_lo(count, L, b); };
  auto blocks = [&](int b0, int b1) { return std::make_pair(buf + at(b0) * es, (at(b1) - at(b0)) * es); };
  auto super = [&](int q) { return blocks(q * (L / m), (q + 1) * (L / m)); };
  // tags: step 1 in [0, s1), step 2 in [s1, s3), step 3 from s3 (the same numbers on every rank)
  int most = 1;
  for (auto& grp : c.vgroups) most = std::max(most, int(grp.size()));
  const uint32_t s1 = uint32_t(most - 1);

  // 1. reduce-scatter inside the group
  const int nx = mine[(j + 1) % m], pv = mine[(j + m - 1) % m];
  for (int k = 0; k < m - 1; ++k) {
    auto out = super(mod(j - k - 1, m)), in = super(mod(j - k - 2, m));
    c.step(Comm::tag(seq, uint32_t(k)), {{nx, true, out.first, out.second}, {pv, false, in.first, in.second}}, true,
           op, dt);
  }

  // 2. across groups: runs of blocks with one owner per group
  struct Run {
    int b0, b1;
    std::vector<int> owners;  // by group
  };
  std::vector<Run> runs;
  for (int b = 0; b < L; ++b) {
    std::vector<int> owners(G);
    for (int h = 0; h < G; ++h) {
      const auto& grp = c.vgroups[h];
      owners[h] = grp[size_t(b / (L / int(grp.size())))];
    }
    if (!runs.empty() && runs.back().owners == owners) runs.back().b1 = b + 1;
    else runs.push_back(Run{b, b + 1, std::move(owners)});
  }
  const uint32_t per_run = uint32_t(2 * (G - 1));
  const uint32_t s3 = s1 + uint32_t(runs.size()) * per_run;
  if (s3 + uint32_t(most) > Comm::kMaxSteps) throw CommError("hetccl: all_reduce_hier: too many steps for one call");
  std::vector<size_t> mine_runs;
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].owners[g] == c.rank) mine_runs.push_back(i);
  auto sub = [&](const Run& R, int x) {  // sub-block x of G of a run: (pointer, bytes)
    size_t lo = at(R.b0), len = at(R.b1) - lo;
    return std::make_pair(buf + (lo + block_lo(len, G, x)) * es, block_len(len, G, x) * es);
  };
  // step k of every owned run's ring: send sub-block x_out to the next owner, receive x_in
  // from the previous one (reduced into place when `reduce`)
  auto run_step = [&](uint32_t k, bool reduce, int x_out, int x_in) {
    std::vector<uint64_t> plans;
    for (size_t i : mine_runs) {
      const Run& R = runs[i];
      auto out = sub(R, x_out), in = sub(R, x_in);
      plans.push_back(c.post(Comm::tag(seq, s1 + uint32_t(i) * per_run + k),
                             {{R.owners[size_t((g + 1) % G)], true, out.first, out.second},
                              {R.owners[size_t((g + G - 1) % G)], false, in.first, in.second}},
                             reduce, op, dt));
    }
    // every plan is waited for, so none outlives the call; the first failure is rethrown
    std::exception_ptr first;
    for (uint64_t p : plans) {
      try {
        c.wait(p);
      } catch (...) {
        if (!first) first = std::current_exception();
      }
    }
    if (first) std::rethrow_exception(first);
  };
  for (int k = 0; k < G - 1; ++k) run_step(uint32_t(k), true, mod(g - k - 1, G), mod(g - k - 2, G));
  if (op == ReduceOp::AVG)
    for (size_t i : mine_runs) {
      auto own = sub(runs[i], g);
      scale_div(dt, own.first, own.second / es, n, c.settings.reduce_threads);
    }
  for (int k = 0; k < G - 1; ++k) run_step(uint32_t(G - 1 + k), false, mod(g - k, G), mod(g - k - 1, G));

  // 3. all-gather inside the group
  for (int k = 0; k < m - 1; ++k) {
    auto out = super(mod(j - k, m)), in = super(mod(j - k - 1, m));
    c.step(Comm::tag(seq, s3 + uint32_t(k)), {{nx, true, out.first, out.second}, {pv, false, in.first, in.second}});
  }
}

}  // namespace api
}  // namespace hetccl
