// The training tests' check for bad input: train() must stop with one UserError that says
// `fragment`.
#pragma once

#include <gtest/gtest.h>

#include <sstream>
#include <string>

#include "core/check.h"
#include "train/options.h"
#include "train/trainer.h"

namespace dstrain::test {

inline void expect_user_error(const TrainOptions& options, const std::string& fragment) {
  std::ostringstream out;
  try {
    train(options, out);
    FAIL() << "no error, expected one mentioning: " << fragment;
  } catch (const UserError& error) {
    EXPECT_NE(std::string(error.what()).find(fragment), std::string::npos) << error.what();
  }
}

}  // namespace dstrain::test
