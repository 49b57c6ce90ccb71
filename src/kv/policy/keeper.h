// The keeper: the part of a policy that says which of a KV head's S kept slots are protected,
// whatever their scores, and how many go by score.
//
// Every selector keeps, of a head holding n slots, the first t slots (sinks), the last r (the
// recent or observation window) and the `top` best-scored candidates of [t, n - r) (select_top:
// ties keep the older slot), with t + top + r = S. The rules differ only in r:
//   all     r = S - t, nothing ranked (StreamingLLM, CaM)
//   split   N:M split of S - t between heavy hitters and recent slots (H2O, RoCo, D2O)
//   window  r = min(window, S - t) (SnapKV, PyramidKV: t = 0; prompt_ranking=window: the sinks)
//   fixed   r = min(recent, S - t) (KeyDiff)
#pragma once

#include <cstdint>

#include "kv/policy/config.h"

namespace d2o {

class Scorer;
struct HeadView;
struct SelectScratch;

struct KeepShape {
  int sinks = 0;   // t
  int top = 0;     // chosen by score
  int recent = 0;  // r
};

class Keeper {
 public:
  enum class Recent { kAll, kSplit, kWindow, kFixed };

  Keeper() = default;
  Keeper(Recent rule, int sinks, int recent, int nm_n = 1, int nm_m = 1)
      : rule_(rule), sinks_(sinks), recent_(recent), nm_n_(nm_n), nm_m_(nm_m) {}
  // The keeper of a configuration's selector (the prompt phase's is prompt_keeper()).
  static Keeper of(const PolicyConfig& cfg);
  // prompt_ranking=window: the sinks, the last `window` slots, the rest by score.
  static Keeper prompt_window(const PolicyConfig& cfg);

  KeepShape shape(int S) const;
  // Head h's h.S kept slots, ascending, into keep: the sinks, the best `top` candidates by
  // `scorer` (formed only when some candidate is evicted; null when top is always 0), the recent
  // slots. sc.score and sc.order hold h.n entries.
  void keep(const HeadView& h, const Scorer* scorer, SelectScratch& sc, int32_t* keep) const;
  // The same with the candidates' scores given (score[j] for j in [t, n - r)).
  void keep_ranked(const float* score, int n, int S, SelectScratch& sc, int32_t* keep) const;

 private:
  Recent rule_ = Recent::kAll;
  int sinks_ = 0;
  int recent_ = 0;  // window or fixed count
  int nm_n_ = 1, nm_m_ = 1;
};

}  // namespace d2o
