// The flags of `dstrain [train]`, grouped as --help shows them, and the usage text.
#pragma once

#include <ostream>

#include <boost/program_options.hpp>

#include "train/options.h"

namespace dstrain {

inline constexpr const char kDstrainVersion[] = "0.1.0";

// Every training flag, bound to the fields of `options` (their defaults shown where they do not
// depend on the machine; the planner's choices say so instead).
boost::program_options::options_description train_flags(TrainOptions& options);

// `dstrain --help`: the commands, then `flags`.
void print_usage(std::ostream& out, const boost::program_options::options_description& flags);

}  // namespace dstrain
