// A parsed generation request made into a Job: the messages rendered through the model's chat
// template (or the completion prompt taken as is) and tokenized exactly as `d2o run --chat` /
// `d2o run -p` do, the limits that depend on the model checked (prompt against the context,
// max_tokens against what is left of it), stop strings and the policy resolved.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "runtime/chat_template.h"
#include "runtime/tokenizer.h"
#include "serve/api.h"
#include "serve/service.h"

namespace d2o::serve {

struct PrepareOptions {
  int64_t n_ctx = 0;             // context in tokens
  int default_max_tokens = 512;  // when the request gives none (bounded by the context left)
  std::string default_kv = "full";
  std::string model_name;
};

// tmpl null: the model has no chat template (chat requests are a 400). `index`: which of a
// completions request's prompts (GenerationRequest::prompts) the job answers.
std::optional<ApiError> prepare_job(const GenerationRequest& g, const Tokenizer& tok,
                                    const ChatTemplate* tmpl, const PrepareOptions& o, Job& job,
                                    size_t index = 0);

}  // namespace d2o::serve
