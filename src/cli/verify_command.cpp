// `dstrain verify`: a checkpoint's files read back against the checksums it wrote.
#include <filesystem>

#include "cli/commands.h"
#include "core/allocator.h"
#include "core/check.h"
#include "train/checkpoint.h"
#include "train/checksums.h"
#include "train/run_directory.h"

namespace dstrain {

namespace po = boost::program_options;
namespace fs = std::filesystem;

int run_verify_command(const std::vector<std::string>& args, std::ostream& out) {
  std::string dir;
  po::options_description flags("dstrain verify");
  // clang-format off
  flags.add_options()
      ("dir", po::value(&dir)->value_name("DIR"),
       "a checkpoint (OUT/step-NNNNNN) or a run's --out directory (its newest checkpoint; the "
       "bare argument)")
      ("help,h", "this help");
  // clang-format on
  po::positional_options_description positional;
  positional.add("dir", 1);
  const po::variables_map values = parse_command_flags(args, flags, positional);
  if (values.count("help")) {
    out << "Usage: dstrain verify DIR\n"
        << "Reads every file of a checkpoint back and compares its size and CRC-32 with what the "
           "checkpoint recorded while writing it (checksums.json). Exit 0 when it is whole; "
           "otherwise one sentence naming the damaged file, exit 2.\n\n"
        << flags << "\n";
    return 0;
  }
  DSTRAIN_USER_CHECK(!dir.empty()) << "dstrain verify needs a checkpoint: dstrain verify DIR";
  const std::optional<fs::path> checkpoint = find_checkpoint(dir);
  DSTRAIN_USER_CHECK(checkpoint) << dir << " holds no checkpoint (give a step-NNNNNN directory "
                                 << "or a run's --out)";
  fs::path step = *checkpoint;
  if (!fs::exists(step / "checksums.json") && !fs::exists(step / "trainer.json") &&
      fs::exists(step / "latest")) {
    step /= latest_name(step / "latest");  // a run directory: the checkpoint `latest` names
  }
  const Verification v = verify_checkpoint(step);
  DSTRAIN_USER_CHECK(v.has_checksums)
      << step.string() << " has no checksums.json (a dstrain before 2026-11-27 wrote it): "
      << "it cannot be verified";
  DSTRAIN_USER_CHECK(v.damage.empty())
      << "checkpoint " << step.string() << " is damaged: " << v.damage;
  out << step.string() << ": whole (" << v.files << " files, " << format_bytes(v.bytes)
      << ", each as its CRC-32 was written)\n";
  return 0;
}

}  // namespace dstrain
