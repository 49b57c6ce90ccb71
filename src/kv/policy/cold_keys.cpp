// The cold tier as a policy part: what a sequence's hot budget evicts is kept (in memory or in a
// file, in a storage type of its own) and a new turn recalls the slots its queries attend to
// most (kv/cold_tier.h). Its keys are shown, and mean something, only with a tier.
#include "kv/cold_tier.h"
#include "kv/kv_cache.h"
#include "kv/policy/spec_keys.h"

namespace d2o::spec_detail {

namespace {
const std::vector<const char*> kColdWords = {"none", "memory", "disk"};
const std::vector<const char*> kRankingWords = {"max", "sum", "whole"};
const std::vector<const char*> kReachWords = {"turn", "window"};

bool cold_shown(const PolicyConfig& c) {
  return c.cold.enabled();
}
}  // namespace

// Where evicted slots go (cold=), their storage type (cold_type=), how many the tier holds
// (cold_size=, 0: no limit), how many a turn recalls per KV head (recall=), by what it ranks
// them (recall_ranking=), up to what size of a head's tier it recalls all of it instead
// (recall_all_up_to=, 0: never) and which of the turn's rows attend to the recall
// (recall_reach=; printed when not `turn`, what specs recorded before it had).
std::vector<KeyDef> cold_tier_keys() {
  return {
      {"cold",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, key, v, kColdWords, &i));
         c.cold.place = static_cast<ColdPlace>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kColdWords[static_cast<size_t>(c.cold.place)]);
       },
       cold_shown},
      {"cold_type",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         auto t = parse_kv_type(std::string(v));
         if (!t.ok())
           return bad_value(c.name, key, v, "a KV storage type such as q4_0r, q8_0 or f16");
         c.cold.type = *t;
         return Status();
       },
       [](const PolicyConfig& c) { return std::string(kv_type_name(c.cold.type)); }, nullptr,
       cold_shown},
      {"cold_size",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         D2O_RETURN_IF_ERROR(int_key(c.name, key, v, 0, int64_t{1} << 40, &x));
         c.cold.max_slots = x;
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.cold.max_slots); }, nullptr, cold_shown},
      {"recall",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         D2O_RETURN_IF_ERROR(int_key(c.name, key, v, 1, 1 << 20, &x));
         c.cold.recall = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.cold.recall); }, nullptr, cold_shown},
      {"recall_ranking",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, key, v, kRankingWords, &i));
         c.cold.ranking = static_cast<RecallRanking>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kRankingWords[static_cast<size_t>(c.cold.ranking)]);
       },
       nullptr, cold_shown},
      {"recall_all_up_to",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int64_t x = 0;
         D2O_RETURN_IF_ERROR(int_key(c.name, key, v, 0, 1 << 20, &x));
         c.cold.recall_all_up_to = static_cast<int>(x);
         return Status();
       },
       [](const PolicyConfig& c) { return std::to_string(c.cold.recall_all_up_to); }, nullptr,
       cold_shown},
      {"recall_reach",
       [](std::string_view key, std::string_view v, PolicyConfig& c) {
         int i = 0;
         D2O_RETURN_IF_ERROR(word_key(c.name, key, v, kReachWords, &i));
         c.cold.reach = static_cast<RecallReach>(i);
         return Status();
       },
       [](const PolicyConfig& c) {
         return std::string(kReachWords[static_cast<size_t>(c.cold.reach)]);
       },
       [](const PolicyConfig& c) { return c.cold.reach != RecallReach::kTurn; }, cold_shown},
  };
}

}  // namespace d2o::spec_detail
