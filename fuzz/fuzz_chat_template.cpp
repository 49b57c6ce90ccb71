// Fuzz target: chat template recognition (template text, BOS/EOS texts) and rendering.
//
// Input, read with FuzzedDataProvider: the Jinja template text, the BOS and EOS texts, a format
// name, then messages (role, content) up to the end. Recognition either refuses the template or
// yields a format; rendering any conversation with it (any roles, any bytes) must be safe.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "runtime/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string jinja = in.ConsumeRandomLengthString(4096);
  const std::string bos = in.ConsumeRandomLengthString(32);
  const std::string eos = in.ConsumeRandomLengthString(32);
  const std::string name = in.ConsumeRandomLengthString(16);
  std::vector<d2o::ChatMessage> messages;
  while (in.remaining_bytes() > 0 && messages.size() < 64) {
    static const char* kRoles[] = {"system", "user", "assistant", "tool"};
    d2o::ChatMessage m;
    m.role = in.ConsumeBool() ? kRoles[in.ConsumeIntegralInRange(0, 3)]
                              : in.ConsumeRandomLengthString(16);
    m.content = in.ConsumeRandomLengthString(1024);
    messages.push_back(std::move(m));
  }
  (void)d2o::jinja_trim(jinja);
  std::vector<d2o::ChatTemplate> found;
  if (auto t = d2o::ChatTemplate::from_template(jinja, bos, eos); t.ok()) found.push_back(*t);
  if (auto t = d2o::ChatTemplate::from_name(name); t.ok()) found.push_back(*t);
  for (const d2o::ChatTemplate& t : found) {
    for (int o = 0; o < 4; ++o) {
      d2o::ChatApplyOptions opts;
      opts.add_generation_prompt = o & 1;
      opts.skip_bos = o & 2;
      (void)t.apply(messages, opts);
    }
    (void)t.name();
  }
  return 0;
}
