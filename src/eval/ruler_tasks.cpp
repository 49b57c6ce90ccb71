// The RULER-style tasks' table (names, answer budgets) and RULER's scoring (src/eval/ruler.h).
#include <cctype>

#include "eval/ruler.h"

namespace d2o::eval {

namespace {

struct TaskInfo {
  RulerTask task;
  const char* name;
  int max_new;
};
// niah: RULER generates up to 128 tokens; a 7-digit value takes at most 8 tokens here, so 32
// (one value) and 64 (four) leave room for the answer's words while keeping decoding short.
constexpr TaskInfo kTasks[] = {{RulerTask::kNiahSingle, "niah_single", 32},
                               {RulerTask::kNiahMultikey, "niah_multikey", 32},
                               {RulerTask::kNiahMultivalue, "niah_multivalue", 64},
                               {RulerTask::kNiahMultiquery, "niah_multiquery", 64},
                               {RulerTask::kVt, "vt", 30},
                               {RulerTask::kCwe, "cwe", 120},
                               {RulerTask::kFwe, "fwe", 50}};

std::string lowercase_ascii(std::string_view s) {
  std::string o(s);
  for (char& c : o) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return o;
}

}  // namespace

const char* ruler_task_name(RulerTask t) {
  for (const TaskInfo& i : kTasks) {
    if (i.task == t) return i.name;
  }
  return "?";
}

int ruler_max_new(RulerTask t) {
  for (const TaskInfo& i : kTasks) {
    if (i.task == t) return i.max_new;
  }
  return 0;
}

Result<RulerTask> parse_ruler_task(std::string_view name) {
  std::string known;
  for (const TaskInfo& i : kTasks) {
    if (name == i.name) return i.task;
    known += (known.empty() ? "" : ", ") + std::string(i.name);
  }
  return invalid_argument("--tasks: unknown task '" + std::string(name) + "' (use " + known + ")");
}

const std::vector<RulerTask>& all_ruler_tasks() {
  static const std::vector<RulerTask> kAll = [] {
    std::vector<RulerTask> v;
    for (const TaskInfo& i : kTasks) v.push_back(i.task);
    return v;
  }();
  return kAll;
}

double ruler_score(std::string_view answer, std::span<const std::string> expected) {
  if (expected.empty()) return 0.0;
  const std::string a = lowercase_ascii(answer);
  int found = 0;
  for (const std::string& e : expected) found += a.find(lowercase_ascii(e)) != std::string::npos;
  return static_cast<double>(found) / static_cast<double>(expected.size());
}

}  // namespace d2o::eval
