// The reduction kernel of the local communicator (internal to src/comm/): a fixed order over
// the inputs, fp32 accumulation for the floating dtypes, one rounding, and the same bits
// stored into every output. all_reduce and reduce_scatter are built on it.
#pragma once

#include <cstdint>
#include <span>

#include "comm/communicator.h"
#include "core/dtype.h"

namespace dstrain::comm_detail {

// For i < count: result[i] = in[0][i] op in[1][i] op ... op in[k-1][i], combined left to right
// (acc = in0; acc = acc op in1; ...). F16/BF16 are widened to fp32, combined in fp32 and
// rounded once (round-to-nearest-even); F32 in fp32; I32 in int32 (Sum wraps around).
// Max propagates NaN: once an input is NaN the result is NaN.
// The result is stored into every outputs[o][0 .. count).
// REQUIRES: inputs is not empty; every buffer holds `count` elements of `dtype`. An output may
// be the very same memory as an input (in place: each element is read from every input before
// it is written); any other overlap between an output and an input is not allowed.
void reduce_in_order(DType dtype, ReduceOp op, std::span<const void* const> inputs,
                     std::span<void* const> outputs, int64_t count);

// "sum" / "max".
const char* reduce_op_name(ReduceOp op);

}  // namespace dstrain::comm_detail
