// `--config FILE`: training flags from a file, for runs kept as files and repeated
// (OUT/run_config.json, written by every run with --out, is one).
#pragma once

#include <boost/program_options.hpp>
#include <nlohmann/json.hpp>
#include <string>

namespace dstrain {

// Stores the flags of `path` into `values` (then notifies them), below those already there: the
// command line, stored first, wins. The file is JSON with the flag names as keys when it starts
// with '{' ({"batch": 8, "offload": true, "pp-split": "7,7,7,7"}; a switch such as offload
// takes true or false; null or "" leaves a flag at its default), else Boost.Program_options'
// config file syntax (`batch = 8` lines, `#` comments). Throws UserError naming the file and the
// key on an unknown flag, a bad value or a file that does not parse.
void store_config_file(const std::string& path,
                       const boost::program_options::options_description& flags,
                       boost::program_options::variables_map& values);

// The same for a JSON object of flag names and values made elsewhere (--deepspeed-config's
// mapping); `origin` names it in errors.
void store_flag_json(const nlohmann::json& settings, const std::string& origin,
                     const boost::program_options::options_description& flags,
                     boost::program_options::variables_map& values);

}  // namespace dstrain
