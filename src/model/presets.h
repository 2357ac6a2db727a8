// Model presets embedded at build time from configs/models/*.json (see CMakeLists.txt).
#pragma once

#include <string>
#include <vector>

namespace dstrain {

struct EmbeddedPreset {
  const char* name;  // file name without .json: "tiny", "gpt2-124m", ...
  const char* json;  // the file's text
};

const std::vector<EmbeddedPreset>& embedded_presets();

}  // namespace dstrain
