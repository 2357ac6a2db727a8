// --mirror DIR: each checkpoint written to a second location as well (another disk, a network
// share), as operators of long runs advise (keep two copies). After a checkpoint is committed
// in --out, node 0 copies it into DIR/step-NNNNNN: every file read once, its CRC-32 compared
// with checksums.json while it is copied (which verifies the checkpoint in --out), the copy
// staged under a temp name, fsynced and renamed like the original, then read back from the
// storage and verified the same way. DIR/latest moves to it only then, and --keep-last N
// removes DIR's older checkpoints only then. A mirror that fails (a full or missing share, a
// copy that reads back damaged, which is removed) is said on the progress line and the run goes
// on: the checkpoint in --out is whole.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "train/checksums.h"

namespace dstrain {

struct MirrorResult {
  std::filesystem::path dir;     // the copy; empty when none was committed
  bool source_read = false;      // the checkpoint in --out was read back while copied
  std::string source_damage;     // and what is damaged there ("": it is whole)
  std::string failure;           // "" when the copy reads back whole; else one clause
  Verification copied;           // the files and bytes copied
  std::vector<int64_t> removed;  // the mirror's older checkpoints --keep-last removed
  double seconds = 0;            // the copy and its verification
};

// Copies checkpoint directory `written` into `mirror` (created when missing) as above.
// keep_last: --keep-last N (0: keep all). Never throws a UserError: what failed is in
// `failure`.
MirrorResult mirror_checkpoint(const std::filesystem::path& written,
                               const std::filesystem::path& mirror, int64_t keep_last);

// The progress line's clause for `result` ("mirrored to DIR/step-000010 (verified, 2 checkpoints
// removed)" or what failed), for the line that says the checkpoint was saved.
std::string describe_mirror(const MirrorResult& result);

}  // namespace dstrain
