// The one wording of an argument mismatch: the engine's check (engine_check.cc), the C API's
// (api/check.cc) and the torch face's (hetccl/checks.py, through _C.mismatch_text) all print it,
// so a user reads the same error whichever face or path found it.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace hetccl {

// The compared fields' names, in the order of the engine's check header (engine.h CheckHeader,
// hetccl/checks.py's header()); the C API's check compares the first five.
constexpr int kCheckFields = 6;
extern const char* const kCheckFieldWhat[kCheckFields];

// One rank's value of the compared field: (rank, value, the value's name in the text).
using RankValue = std::tuple<int, int64_t, std::string>;

// rank_values: every rank compared, any order. Returns "" when every rank has the same value,
// else
//   "hetccl: <coll>: <what> differs across ranks (ranks [0, 2]: a; ranks [1]: b). Every rank
//    must call the same collective with matching tensors."
// with the values in the order of their lowest rank (the same text on every rank that has the
// same table), each named by its name -- or, where two different values have one name, every
// value by its number -- and each rank list written with ranges of three or more
// ("0-127, 129"), so the text stays short at any number of ranks.
std::string mismatch_text(const std::string& coll, const std::string& what, std::vector<RankValue> rank_values);

}  // namespace hetccl
