// A random-weight model (random_model.h) written to the scratch folder and loaded: what a test
// suite's fixture keeps for its tests.
#pragma once

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "common/random_model.h"
#include "common/test_util.h"
#include "model/model.h"

namespace d2o::test {

// The model of `cfg`, written to the scratch file `name` and loaded; null, with a test failure,
// when either step fails.
inline std::unique_ptr<Model> load_random_model(const RandomModelConfig& cfg,
                                                const std::string& name) {
  const std::string path = scratch_path(name);
  const Status w = make_random_model(cfg).write(path);
  if (!w.ok()) {
    ADD_FAILURE() << w.to_string();
    return nullptr;
  }
  auto m = Model::load(path);
  if (!m.ok()) {
    ADD_FAILURE() << m.status().to_string();
    return nullptr;
  }
  return std::move(m).value();
}

// A test suite whose tests share one such model, loaded once: derive as
//   class MySuite : public test::RandomModelSuite<MySuite> {
//    public:
//     static test::RandomModelConfig config();  // the model
//     static const char* file();                // its scratch file name
//   };
// and read MySuite::model_.
template <class Derived>
class RandomModelSuite : public ::testing::Test {
 public:
  static void SetUpTestSuite() {
    model_ = load_random_model(Derived::config(), Derived::file()).release();
    ASSERT_NE(model_, nullptr);
  }
  static void TearDownTestSuite() {
    delete model_;
    model_ = nullptr;
  }
  static inline Model* model_ = nullptr;
};

}  // namespace d2o::test
