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

std::string mismatch_text(const std::string& coll, const std::string& what, std::vector<RankValue> rank_values) {
  std::sort(rank_values.begin(), rank_values.end());
  // values in the order of their lowest rank: (value, name, ranks)
  struct Group {
    int64_t value;
    std::string name;
    std::vector<int> ranks;
  };
  std::vector<Group> groups;
  for (auto& [rank, value, name] : rank_values) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const Group& g) { return g.value == value; });
    if (it == groups.end()) {
      groups.push_back({value, name, {rank}});
    } else {
      it->ranks.push_back(rank);
    }
  }
  if (groups.size() <= 1) return "";
  bool by_number = false;  // two different values with one name: every value by its number
  for (size_t i = 0; i < groups.size(); ++i)
    for (size_t j = i + 1; j < groups.size(); ++j) by_number = by_number || groups[i].name == groups[j].name;
  std::string msg = "hetccl: " + coll + ": " + what + " differs across ranks (";
  for (size_t i = 0; i < groups.size(); ++i)
    msg += (i ? "; " : "") + std::string("ranks [") + rank_list(groups[i].ranks) +
           "]: " + (by_number ? std::to_string(groups[i].value) : groups[i].name);
  msg += "). Every rank must call the same collective with matching tensors.";
  return msg;
}

}  // namespace hetccl
