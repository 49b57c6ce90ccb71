// d2o eval fidelity: next-token distributions against the full cache after prompt-then-compress
// (and the prompt fed in chunks, continuations that begin with a new user turn or come as one
// request).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include "cmd_eval.h"
#include "core/timer.h"
#include "eval/fidelity.h"
#include "eval/stats.h"
#include "eval/stream_ppl.h"
#include "eval/turns.h"
#include "model/layer_desc.h"
#include "ops/kernel_isa.h"

namespace d2o::cli {

namespace {

// ---- fidelity ----------------------------------------------------------------------------------

struct FidelityOptions {
  EvalCommonOptions common;
  std::string ratios = "0.2,0.4,0.8";
  CLI::Option* o_ratios = nullptr;
  BytesAxisOptions bytes;
  TeacherForcedOptions tf;
  bool continue_turn = false;  // continuations begin with a new user turn
  bool one_pass = false;       // the continuation teacher-forced in one pass
  std::string chat_format;     // the chat template's family when the model has none
  PrefillOptions prefill;      // --chunk
};

// --continue-turn: the chat tokens around a fidelity window (FidelityParams::turn_*), from the
// model's chat template or a named family.
Status set_continue_turn(const Loaded& l, const std::string& format, eval::FidelityParams& p) {
  std::optional<ChatTemplate> named;
  if (!format.empty()) {
    auto t = ChatTemplate::from_name(format);
    if (!t.ok()) return t.status().with_context("--chat-format");
    named = *t;
  }
  const ChatTemplate* chat = named ? &*named : l.chat_template ? &*l.chat_template : nullptr;
  if (!chat) {
    return invalid_argument(
        "--continue-turn needs a chat template and the model has none; name one with "
        "--chat-format (e.g. gemma for Gemma's turn markers)");
  }
  D2O_ASSIGN_OR_RETURN(eval::TurnTexts turns,
                       eval::TurnTexts::create(*l.tokenizer, chat, eval::QuestionSetting::kAfter));
  auto encode = [&](const std::string& text, bool add_special) {
    EncodeOptions o;
    o.add_special = add_special;
    o.parse_special = true;  // the chat markers become their special tokens
    return l.tokenizer->encode(text, o);
  };
  D2O_ASSIGN_OR_RETURN(p.turn_prefix, encode(turns.prefix(), true));
  D2O_ASSIGN_OR_RETURN(p.turn_open, encode(turns.reply_open(), false));
  D2O_ASSIGN_OR_RETURN(p.turn_reply, encode(turns.next_user_turn(), false));
  if (p.turn_open.empty()) return internal_error("the chat template opens no assistant turn");
  return {};
}

}  // namespace

std::string ratio_label(double r) {
  return eval::fmt_num("%g", r);
}

Result<std::vector<eval::FidelityCase>> fidelity_cases(const std::vector<std::string>& policies,
                                                       const std::vector<double>& ratios) {
  std::vector<eval::FidelityCase> cases;
  for (const std::string& base : policies) {
    if (eval::spec_preset(base) == "full" || eval::spec_has_compression(base)) {
      // Run as given: the full cache, or a spec that sets its own ratio/budget.
      D2O_ASSIGN_OR_RETURN(eval::PolicyUnderTest t, eval::make_policy(base, base));
      cases.push_back({base, "-", t});
      continue;
    }
    for (double r : ratios) {
      if (!(r > 0 && r <= 1))
        return invalid_argument("--ratios: " + ratio_label(r) + " is not in (0, 1]");
      D2O_ASSIGN_OR_RETURN(std::string spec,
                           eval::spec_with_compression(base, "ratio=" + ratio_label(r)));
      D2O_ASSIGN_OR_RETURN(eval::PolicyUnderTest t, eval::make_policy(spec, base));
      cases.push_back({base, ratio_label(r), t});
    }
  }
  if (cases.empty()) return invalid_argument("no policies to evaluate");
  return cases;
}

namespace {

int run_fidelity_cmd(FidelityOptions& o) {
  const std::string text_path = o.common.text.empty() ? default_text_path() : o.common.text;
  if (o.common.quick) shrink_for_quick(o.tf);
  const bool by_bytes = bytes_axis_given(o.bytes);
  if (by_bytes && o.o_ratios->count() > 0)
    return fail(invalid_argument("give --ratios or --bytes / --kv-mem-per-seq, not both"));
  if (!by_bytes && !o.bytes.kv_types.empty())
    return fail(invalid_argument("--kv-types needs --bytes or --kv-mem-per-seq"));
  auto ratios = parse_double_list(o.ratios, "--ratios");
  if (!ratios.ok()) return fail(ratios.status());
  const std::vector<std::string> policies = eval_policies(o.common, all_policy_presets());
  auto cases = by_bytes ? Result<std::vector<eval::FidelityCase>>(std::vector<eval::FidelityCase>())
                        : fidelity_cases(policies, *ratios);
  if (!cases.ok()) return fail(cases.status());
  if (by_bytes) {
    // Fail fast on option errors that need no model.
    if (!o.bytes.bytes.empty()) {
      auto b = parse_double_list(o.bytes.bytes, "--bytes");
      if (!b.ok()) return fail(b.status());
    }
    if (!o.bytes.kv_types.empty()) {
      auto t = parse_kv_type_list(o.bytes.kv_types);
      if (!t.ok()) return fail(t.status());
    }
  }
  auto setup = eval_setup(o.common, text_path, "d2o eval fidelity");
  if (!setup.ok()) return fail(setup.status());
  EvalSetup& s = *setup;
  if (by_bytes) {
    cases = fidelity_bytes_cases(policies, o.bytes, s.loaded.model->hparams(), s.loaded.kv_type,
                                 o.tf.prompt);
    if (!cases.ok()) return fail(cases.status());
  }
  auto skipped = tokens_after_skip(s.tokens, o.tf.skip);
  if (!skipped.ok()) return fail(skipped.status());
  const std::span<const TokenId> toks = *skipped;
  eval::FidelityParams p;
  p.cases = std::move(cases).value();
  p.prompt_len = o.tf.prompt;
  p.n_samples = o.tf.samples;
  p.n_continue = o.tf.cont;
  p.kv_type = s.loaded.kv_type;
  p.n_ctx_train = s.loaded.model->hparams().n_ctx_train;
  p.chunk = prefill_chunk_of(o.prefill);
  if (s.loaded.tokenizer->add_bos()) p.bos = s.loaded.tokenizer->bos();
  p.continue_in_one_pass = o.one_pass;
  if (o.continue_turn) {
    if (Status st = set_continue_turn(s.loaded, o.chat_format, p); !st.ok()) return fail(st);
    // --quick's 16 steps would hold little more than the new turn's markers.
    if (o.common.quick)
      p.n_continue = std::max(p.n_continue, static_cast<int>(p.turn_reply.size()) + 16);
  } else if (!o.chat_format.empty()) {
    return fail(invalid_argument("--chat-format needs --continue-turn"));
  }
  s.meta.command += (by_bytes ? bytes_axis_args(o.bytes) : " --ratios " + o.ratios) +
                    teacher_forced_args(o.tf) + prefill_args(o.prefill) +
                    (o.continue_turn ? " --continue-turn" : "") +
                    (o.one_pass ? " --continue-in-one-pass" : "") +
                    (o.chat_format.empty() ? "" : " --chat-format " + o.chat_format);
  Stopwatch sw;
  auto bar =
      make_progress(o.common, "eval fidelity", static_cast<double>(p.n_samples) * p.n_continue);
  auto res = eval::run_fidelity(*s.loaded.engine, toks, p, bar.get());
  if (!res.ok()) return fail(res.status());
  bar->finish();
  s.meta.wall_seconds = sw.seconds();
  const eval::ReportFiles files{o.common.out_dir, o.common.name.empty()
                                                      ? (by_bytes ? "fidelity_bytes" : "fidelity")
                                                      : o.common.name};
  eval::FidelityReportText text;
  if (by_bytes) {
    text.title = "Fidelity at equal KV bytes (`d2o eval fidelity --bytes`)";
    text.intro =
        "Each method (a policy in a KV storage type) compresses the prompt right after the prompt "
        "pass to the largest budget whose key and value bytes fit the column's share of a full "
        "F16 cache's, then evicts one slot per teacher-forced token. The reference is the full "
        "cache in " +
        std::string(kv_type_name(s.loaded.kv_type)) +
        "; all methods run on the same prompts, so differences are paired by sample.";
    text.column_prefix = "bytes = ";
  } else {
    text.title = "Fidelity to the full cache after prompt-then-compress (`d2o eval fidelity`)";
    text.intro =
        "Each policy compresses the prompt to a fraction ρ of its tokens right after the prompt "
        "pass, then "
        "evicts one slot per teacher-forced token. Only predictions made after the compression "
        "count.";
  }
  if (p.chunk > 0) {
    text.intro += " Each policy is fed the prompt in passes of " + std::to_string(p.chunk) +
                  " tokens (a fixed budget and prefill=bounded compact between them; the others "
                  "compress the whole prompt after its last pass).";
  }
  if (o.one_pass) {
    text.intro +=
        " Each continuation is teacher-forced in one pass with logits at every position (as a "
        "server feeds a session's next request; a cold tier recalls for it), not one token a pass.";
  }
  if (o.continue_turn) {
    text.intro +=
        " Continuations begin with a new user turn (the question-after setting): each window is "
        "a user message, compressed where a server session compresses (after the assistant's "
        "turn opens); each continuation is the assistant's fixed acknowledgement, its turn "
        "closed, a new user turn opened (" +
        std::to_string(p.turn_reply.size()) +
        " tokens, counted in the steps), then the text's next tokens as the user's next message.";
  }
  if (Status st = eval::write_fidelity_report(*res, p, s.meta, text, files); !st.ok())
    return fail(st);
  for (size_t i = 0; i < p.cases.size(); ++i) {
    const auto& c = res->cases[i];
    std::printf("%-12s %-5s KL %.4f  top-1 %.3f\n", p.cases[i].row.c_str(),
                p.cases[i].column.c_str(), eval::mean_se(c.kl).mean, eval::mean_se(c.top1).mean);
  }
  print_report_paths(files);
  return 0;
}

}  // namespace

Action add_eval_fidelity(CLI::App* eval) {
  auto o = std::make_shared<FidelityOptions>();
  CLI::App* sub = eval->add_subcommand(
      "fidelity", "KL / top-1 agreement with the full cache after prompt-then-compress");
  add_eval_common_options(sub, o->common,
                          "Text file the samples are taken from (default: the KJV text)");
  o->o_ratios = sub->add_option("--ratios", o->ratios,
                                "Compression ratios rho (fraction of the prompt kept)");
  add_bytes_axis_options(sub, o->bytes);
  add_teacher_forced_options(sub, o->tf, "Number of prompts (text windows, evenly spaced)");
  add_prefill_options(sub, o->prefill, /*with_mem=*/false);
  sub->add_flag("--continue-turn", o->continue_turn,
                "Continuations begin with a new user turn: each window is a user message "
                "compressed when the assistant's turn opens, and the continuation is the "
                "assistant's acknowledgement, then the user's next message (the text goes on)");
  sub->add_flag(
      "--continue-in-one-pass", o->one_pass,
      "Feed each continuation in one pass with logits at every position (as a server "
      "feeds a session's next request; a cold tier recalls for it), not one token a pass");
  sub->add_option(
      "--chat-format", o->chat_format,
      "With --continue-turn, for a model without a chat template: the template "
      "family whose turn markers to use (" +
          [] {
            std::string s;
            for (const std::string& n : ChatTemplate::supported_names())
              s += (s.empty() ? "" : ", ") + n;
            return s;
          }() +
          ")");
  return [o] { return run_fidelity_cmd(*o); };
}

}  // namespace d2o::cli
