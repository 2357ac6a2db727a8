#include "cli/config_file.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "cli/parse_flags.h"
#include "core/check.h"
#include "core/fs.h"

namespace dstrain {

namespace po = boost::program_options;

namespace {

// One JSON value as the text of a flag's value (an array joins with commas: "7,7,7,7").
std::string flag_text(const std::string& path, const std::string& key,
                      const nlohmann::json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "true" : "false";
  if (value.is_number()) return value.dump();
  if (value.is_array()) {
    std::string text;
    for (const nlohmann::json& item : value)
      text += (text.empty() ? "" : ",") + flag_text(path, key, item);
    return text;
  }
  DSTRAIN_USER_ERROR() << "config file " << path << ": \"" << key << "\" = " << value.dump()
                       << " is not a flag value (a string, number, true/false or a list)";
}

// A JSON object of flags as command-line arguments ("--batch=8", "--offload").
std::vector<std::string> json_arguments(const nlohmann::json& json, const std::string& path,
                                        const po::options_description& flags) {
  DSTRAIN_USER_CHECK(json.is_object())
      << "config file " << path << " must be a JSON object of flag names and values";
  std::vector<std::string> args;
  for (const auto& [key, value] : json.items()) {
    if (value.is_null() || (value.is_string() && value.get<std::string>().empty())) continue;
    const po::option_description* flag = flags.find_nothrow(key, false);
    DSTRAIN_USER_CHECK(flag != nullptr && key != "config" && key != "deepspeed-config")
        << "config file " << path << ": \"" << key
        << "\" is not a dstrain flag (see dstrain --help)";
    const bool is_switch = flag->semantic()->max_tokens() == 0;
    if (is_switch) {
      DSTRAIN_USER_CHECK(value.is_boolean())
          << "config file " << path << ": \"" << key << "\" is a switch: true or false";
      if (value.get<bool>()) args.push_back("--" + key);
    } else {
      args.push_back("--" + key + "=" + flag_text(path, key, value));
      check_no_boost_placeholder(args.back(), "config file " + path);
    }
  }
  return args;
}

nlohmann::json parse_json_file(const std::string& path) {
  try {
    return nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& error) {
    DSTRAIN_USER_ERROR() << "config file " << path << " is not valid JSON (" << error.what() << ")";
  }
  return {};
}

po::parsed_options parse_file(const std::string& path, const po::options_description& flags) {
  std::error_code error;
  DSTRAIN_USER_CHECK(std::filesystem::is_regular_file(path, error))
      << "config file " << path << " does not exist or is not a file";
  const std::string text = read_file(path);
  const size_t first = text.find_first_not_of(" \t\r\n");
  if (first != std::string::npos && text[first] == '{') {
    return parse_exact(json_arguments(parse_json_file(path), path, flags), flags);
  }
  check_no_boost_placeholder(text, "config file " + path);
  std::istringstream stream(text);
  return po::parse_config_file(stream, flags, false);
}

}  // namespace

void store_config_file(const std::string& path, const po::options_description& flags,
                       po::variables_map& values) {
  try {
    po::store(parse_file(path, flags), values);
    po::notify(values);
  } catch (const po::error& error) {
    DSTRAIN_USER_ERROR() << "config file " << path << ": " << error.what();
  }
}

void store_flag_json(const nlohmann::json& settings, const std::string& origin,
                     const po::options_description& flags, po::variables_map& values) {
  try {
    po::store(parse_exact(json_arguments(settings, origin, flags), flags), values);
    po::notify(values);
  } catch (const po::error& error) {
    DSTRAIN_USER_ERROR() << origin << ": " << error.what();
  }
}

}  // namespace dstrain
