// Flags are exact words: how every dstrain command parses its command line (Boost's prefix
// guessing off, so `--ep 2` is never `--eps 2`), and the one sentence an unknown flag gets.
#pragma once

#include <string>
#include <vector>

#include <boost/program_options.hpp>

namespace dstrain {

// Boost's default style without allow_guessing: a flag matches only its whole name.
int exact_flag_style();

// Boost's error messages substitute %value%, %canonical_option%, ... in a loop that never ends
// when the substituted text holds its own placeholder (Boost 1.74): such text is refused before
// Boost sees it, one UserError sentence naming `where` ("config file X", "the command line").
void check_no_boost_placeholder(const std::string& text, const std::string& where);

// `args` against `flags` with exact names, Boost's errors left to the caller (config files name
// the file in theirs). Each argument passes check_no_boost_placeholder first.
boost::program_options::parsed_options parse_exact(
    const std::vector<std::string>& args, const boost::program_options::options_description& flags,
    const boost::program_options::positional_options_description& positional = {});

// Up to three flags of `flags` nearest to the unknown `name` ("--zer"): those it is a prefix
// of, then those within a small edit distance, closest first, as "--zero, --seed"; "" when none
// is near.
std::string nearest_flags(const std::string& name,
                          const boost::program_options::options_description& flags);

// Parses `args` against `flags` (and the bare words against `positional`) with exact names;
// Boost's errors become one UserError sentence, an unknown flag's naming the nearest ones.
// `help`: the command whose --help the sentence points to ("dstrain --help").
boost::program_options::variables_map parse_exact_flags(
    const std::vector<std::string>& args, const boost::program_options::options_description& flags,
    const boost::program_options::positional_options_description& positional,
    const std::string& help);

}  // namespace dstrain
