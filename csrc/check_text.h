// The one wording of an argument mismatch: the engine's check (engine_check.cc), the C API's
// (api/check.cc) and the torch face's (hetccl/checks.py, through _C.mismatch_text) all print it,
// so a user reads the same error whichever face or path found it.
#pragma once

#include <string>
#include <utility>
#include <vector>

namespace hetccl {

// The compared fields' names, in the order of the engine's check header (engine.h CheckHeader,
// hetccl/checks.py's header()); the C API's check compares the first five.
constexpr int kCheckFields = 6;
extern const char* const kCheckFieldWhat[kCheckFields];

// rank_values: (rank, the field's value as text) for every rank compared, any order. Returns ""
// when every rank has the same text, else
//   "hetccl: <coll>: <what> differs across ranks (ranks [0, 2]: a; ranks [1]: b). Every rank
//    must call the same collective with matching tensors."
// with the values in the order of their lowest rank (the same text on every rank that has the
// same table) and each rank list written with ranges of three or more ("0-127, 129"), so the
// text stays short at any number of ranks.
std::string mismatch_text(const std::string& coll, const std::string& what,
                          std::vector<std::pair<int, std::string>> rank_values);

}  // namespace hetccl
