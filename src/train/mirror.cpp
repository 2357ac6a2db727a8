#include "train/mirror.h"

#include <chrono>
#include <iomanip>
#include <sstream>

#include "core/allocator.h"
#include "core/check.h"
#include "core/format.h"
#include "core/fs.h"
#include "train/run_directory.h"

namespace dstrain {

namespace fs = std::filesystem;

namespace {

// The copy itself, committed under the mirror only when the checkpoint read back whole.
void copy_into_mirror(const fs::path& written, const fs::path& target, MirrorResult& result) {
  StagingDir staging(target);
  result.copied = copy_checkpoint(written, staging.path());
  if (!result.copied.has_checksums) {
    result.failure = "the checkpoint in --out has no checksums.json";
    return;
  }
  result.source_read = true;
  result.source_damage = result.copied.damage;
  if (!result.source_damage.empty()) {
    result.failure = "the checkpoint in --out is damaged";
    return;
  }
  staging.commit();
  result.dir = target;
}

}  // namespace

MirrorResult mirror_checkpoint(const fs::path& written, const fs::path& mirror, int64_t keep_last) {
  const auto start = std::chrono::steady_clock::now();
  MirrorResult result;
  const fs::path target = mirror / written.filename();
  try {
    copy_into_mirror(written, target, result);
    if (!result.dir.empty()) {
      const Verification copy = verify_checkpoint(result.dir);
      if (copy.damage.empty()) {
        replace_symlink_atomic(mirror / "latest", written.filename());
        result.removed = keep_last_checkpoints(mirror, keep_last, result.dir);
      } else {  // not left where a resume or --keep-last would take it for a whole one
        result.failure = "the copy reads back damaged (" + copy.damage + "), and was removed";
        std::error_code ignored;
        fs::remove_all(result.dir, ignored);
        result.dir.clear();
      }
    }
  } catch (const UserError& error) {
    result.failure = error.what();
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return result;
}

std::string describe_mirror(const MirrorResult& result) {
  std::ostringstream line;
  if (!result.failure.empty()) {
    line << "NOT mirrored: " << result.failure;
    return line.str();
  }
  line << "mirrored to " << result.dir.string() << " (verified, "
       << format_bytes(static_cast<size_t>(result.copied.bytes)) << " in " << std::fixed
       << std::setprecision(1) << result.seconds << " s";
  if (!result.removed.empty()) {
    line << "; --keep-last: removed "
         << count_of(static_cast<long long>(result.removed.size()), "older checkpoint") << " there";
  }
  line << ")";
  return line.str();
}

}  // namespace dstrain
