#include "cli/parse_flags.h"

#include <algorithm>
#include <utility>

#include "core/check.h"

namespace dstrain {

namespace po = boost::program_options;

namespace {

// Optimal string alignment distance (Levenshtein with adjacent transpositions).
size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitute = d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, substitute});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) {
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
      }
    }
  }
  return d[a.size()][b.size()];
}

std::string bare(std::string name) {
  name.erase(0, name.find_first_not_of('-'));
  const size_t equals = name.find('=');
  if (equals != std::string::npos) name.erase(equals);
  return name;
}

}  // namespace

void check_no_boost_placeholder(const std::string& text, const std::string& where) {
  for (const char* placeholder :
       {"%value%", "%canonical_option%", "%original_token%", "%prefix%", "%option%"}) {
    DSTRAIN_USER_CHECK(text.find(placeholder) == std::string::npos)
        << where << " holds \"" << placeholder << "\", which no flag name or value may contain";
  }
}

int exact_flag_style() {
  return po::command_line_style::default_style & ~po::command_line_style::allow_guessing;
}

po::parsed_options parse_exact(const std::vector<std::string>& args,
                              const po::options_description& flags,
                              const po::positional_options_description& positional) {
  for (const std::string& arg : args) check_no_boost_placeholder(arg, "the argument " + arg);
  return po::command_line_parser(args)
      .options(flags)
      .positional(positional)
      .style(exact_flag_style())
      .run();
}

std::string nearest_flags(const std::string& name, const po::options_description& flags) {
  const std::string wanted = bare(name);
  if (wanted.empty()) return "";
  // (rank, distance, name): prefixes of a flag first, then the closest spellings.
  std::vector<std::tuple<int, size_t, std::string>> near;
  const size_t limit = std::max<size_t>(1, std::min<size_t>(3, wanted.size() / 3));
  for (const auto& option : flags.options()) {
    const std::string candidate = option->long_name();
    if (candidate.empty()) continue;
    const bool prefix = candidate.size() > wanted.size() && candidate.rfind(wanted, 0) == 0;
    const size_t distance = edit_distance(wanted, candidate);
    if (prefix) {
      near.emplace_back(0, candidate.size() - wanted.size(), candidate);
    } else if (distance <= limit) {
      near.emplace_back(1, distance, candidate);
    }
  }
  std::sort(near.begin(), near.end());
  std::string text;
  for (size_t i = 0; i < near.size() && i < 3; ++i) {
    text += (i ? ", --" : "--") + std::get<2>(near[i]);
  }
  return text;
}

po::variables_map parse_exact_flags(const std::vector<std::string>& args,
                                    const po::options_description& flags,
                                    const po::positional_options_description& positional,
                                    const std::string& help) {
  po::variables_map values;
  try {
    po::store(parse_exact(args, flags, positional), values);
    po::notify(values);
  } catch (const po::unknown_option& error) {
    const std::string near = nearest_flags(error.get_option_name(), flags);
    DSTRAIN_USER_ERROR() << "unknown flag " << error.get_option_name()
                         << (near.empty() ? "" : " (nearest: " + near + ")") << "; see " << help;
  } catch (const po::error& error) {
    DSTRAIN_USER_ERROR() << error.what() << " (see " << help << ")";
  }
  return values;
}

}  // namespace dstrain
