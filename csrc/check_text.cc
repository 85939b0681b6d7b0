// See check_text.h. Plain string building (no iostreams in the core: their locale machinery is
// one more thing that can differ between the process's C++ runtime and ours).
#include "check_text.h"

#include <algorithm>

namespace hetccl {

const char* const kCheckFieldWhat[kCheckFields] = {"collective", "number of elements", "dtype",
                                                   "reduction op", "root", "device type"};

namespace {
std::string rank_list(const std::vector<int>& ranks) {  // ascending
  std::string s;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!s.empty()) s += ", ";
    if (j - i >= 2) {
      s += std::to_string(ranks[i]) + "-" + std::to_string(ranks[j]);
    } else {
      for (size_t k = i; k <= j; ++k) s += (k > i ? ", " : "") + std::to_string(ranks[k]);
    }
    i = j + 1;
  }
  return s;
}
}  // namespace

std::string mismatch_text(const std::string& coll, const std::string& what,
                          std::vector<std::pair<int, std::string>> rank_values) {
  std::sort(rank_values.begin(), rank_values.end());
  // values in the order of their lowest rank
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (auto& rv : rank_values) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == rv.second; });
    if (it == groups.end()) {
      groups.push_back({rv.second, {rv.first}});
    } else {
      it->second.push_back(rv.first);
    }
  }
  if (groups.size() <= 1) return "";
  std::string msg = "hetccl: " + coll + ": " + what + " differs across ranks (";
  for (size_t i = 0; i < groups.size(); ++i)
    msg += (i ? "; " : "") + std::string("ranks [") + rank_list(groups[i].second) + "]: " + groups[i].first;
  msg += "). Every rank must call the same collective with matching tensors.";
  return msg;
}

}  // namespace hetccl
