// A run's directories as a user meets them between runs: what --out holds, which checkpoint
// --resume continues, and what an earlier run left that a new one must not destroy silently.
//
// A run directory (--out) holds step-NNNNNN checkpoints, `latest` (a link to the newest),
// run_config.json and, while one is written, a `.tmp-step-...` staging directory.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

namespace dstrain {

// The complete checkpoints of run directory `dir` (trainer.json says complete), by step.
struct CheckpointEntry {
  int64_t step = 0;
  std::filesystem::path dir;
};
std::vector<CheckpointEntry> list_checkpoints(const std::filesystem::path& dir);

// The checkpoint `path` names: a step directory itself (one holding any checkpoint file, whole
// or not), else the run directory's `latest` (or its newest complete step directory when that is
// newer than what `latest` names: a run stopped between a checkpoint and its `latest`),
// else (a run whose `latest` is missing) its newest complete step directory; nullopt when
// `path` does not exist or holds no checkpoint. A `latest` naming a missing checkpoint, or a
// step directory that is not whole, is left to open_checkpoint's sentence (returned as found).
std::optional<std::filesystem::path> find_checkpoint(const std::filesystem::path& path);

// The run directory a checkpoint belongs to (the parent of a step directory).
std::filesystem::path run_directory_of(const std::filesystem::path& checkpoint);

// Whether two paths name the same directory (the same file once both exist, else the same
// normalized absolute path).
bool same_directory(const std::filesystem::path& a, const std::filesystem::path& b);

// A new run writing into `out`: it must not exist or be empty. With `overwrite`, what an
// earlier dstrain run left there (step-NNNNNN, latest, run_config.json, staging directories) is
// removed, said on `out_stream`; other files stay. Otherwise a non-empty `out` is a UserError
// offering --resume OUT or --overwrite. `flag`: the flag that named `out` (--out, --mirror).
void claim_out_directory(const std::string& out, bool overwrite, std::ostream& out_stream,
                         const std::string& flag = "--out");

// A resumed run continuing in `out`, before it writes anything: removes the staging
// directories (.tmp-step-...) that a run killed while saving left there, said on `out_stream`.
// Nothing else writes into `out` then (one run per directory). Returns the names removed.
std::vector<std::string> remove_stale_staging(const std::filesystem::path& out,
                                              std::ostream& out_stream);

// A log that exists is continued by a resumed run (`appending`), replaced with `overwrite`,
// and otherwise a UserError.
void check_log_file(const std::string& log, bool appending, bool overwrite);

// --tensorboard DIR of a new run (not appending): refuses DIR when it holds event files of
// another run, or removes them with `overwrite`. Nothing for an empty dir, or when appending.
void claim_tensorboard_directory(const std::string& dir, bool appending, bool overwrite);

// --keep-last N: removes the complete checkpoints of `out` but the newest N, never `written`
// (the one just saved, even if an abandoned branch left higher steps) nor what `latest` names.
// Returns the steps removed.
std::vector<int64_t> keep_last_checkpoints(const std::filesystem::path& out, int64_t keep,
                                           const std::filesystem::path& written);

}  // namespace dstrain
