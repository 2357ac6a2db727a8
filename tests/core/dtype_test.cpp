#include <gtest/gtest.h>
#include "core/dtype.h"
TEST(Dtype, Placeholder) { EXPECT_EQ(dstrain::dtype_size(dstrain::DType::F16), 2u); }
