// The forward pass of each architecture family, one file each (src/model/arch_<family>.cpp);
// ModelForward::create picks one by ModelHParams::arch.
#pragma once

#include <memory>

#include "model/forward.h"

namespace d2o {

// llama, mistral, qwen2, qwen3, phi3 (arch_llama.cpp).
std::unique_ptr<ModelForward> make_llama_forward(const Model& model, ThreadPool& pool,
                                                 const ForwardOptions& opts);
// qwen3moe (arch_qwen3moe.cpp).
std::unique_ptr<ModelForward> make_qwen3moe_forward(const Model& model, ThreadPool& pool,
                                                    const ForwardOptions& opts);
// qwen35 (arch_qwen35.cpp).
std::unique_ptr<ModelForward> make_qwen35_forward(const Model& model, ThreadPool& pool,
                                                  const ForwardOptions& opts);
// gemma4 (arch_gemma4.cpp).
std::unique_ptr<ModelForward> make_gemma4_forward(const Model& model, ThreadPool& pool,
                                                  const ForwardOptions& opts);
// gemma3 (arch_gemma3.cpp).
std::unique_ptr<ModelForward> make_gemma3_forward(const Model& model, ThreadPool& pool,
                                                  const ForwardOptions& opts);

}  // namespace d2o
