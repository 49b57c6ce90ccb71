#include "model/forward.h"

#include "core/assert.h"
#include "model/archs.h"

namespace d2o {

const char* attn_split_name(AttnSplit s) {
  switch (s) {
    case AttnSplit::kAuto:
      return "auto";
    case AttnSplit::kWithinSequence:
      return "within";
    case AttnSplit::kAcrossSequences:
      return "across";
  }
  return "?";
}

std::unique_ptr<ModelForward> ModelForward::create(const Model& model, ThreadPool& pool,
                                                   const ForwardOptions& opts) {
  switch (model.hparams().arch) {
    case ModelArch::kLlama:
    case ModelArch::kQwen2:
    case ModelArch::kQwen3:
    case ModelArch::kPhi3:
      return make_llama_forward(model, pool, opts);
    case ModelArch::kQwen3Moe:
      return make_qwen3moe_forward(model, pool, opts);
    case ModelArch::kQwen35:
      return make_qwen35_forward(model, pool, opts);
    case ModelArch::kGemma3:
      return make_gemma3_forward(model, pool, opts);
    case ModelArch::kGemma4:
      return make_gemma4_forward(model, pool, opts);
  }
  // ModelHParams::from_gguf accepts only the architectures above.
  D2O_ASSERT_MSG(false, "no forward pass for this architecture");
  return nullptr;
}

}  // namespace d2o
