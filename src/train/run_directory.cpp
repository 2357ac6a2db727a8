#include "train/run_directory.h"

#include <algorithm>
#include <charconv>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/format.h"
#include "core/fs.h"

namespace dstrain {

namespace fs = std::filesystem;

namespace {

// The step of a directory named step-NNNNNN; nullopt for any other name.
std::optional<int64_t> step_of_name(const std::string& name) {
  if (!name.starts_with("step-") || name.size() <= 5) return std::nullopt;
  int64_t step = -1;
  const char* begin = name.data() + 5;
  const char* end = name.data() + name.size();
  const auto [last, error] = std::from_chars(begin, end, step);
  if (error != std::errc() || last != end || step < 0) return std::nullopt;
  return step;
}

bool is_complete_checkpoint(const fs::path& dir) {
  std::error_code error;
  if (!fs::is_regular_file(dir / "trainer.json", error)) return false;
  try {
    const nlohmann::json trainer = nlohmann::json::parse(read_file(dir / "trainer.json"));
    return trainer.is_object() && trainer.value("complete", false) == true;
  } catch (const std::exception&) {
    return false;
  }
}

// What a dstrain run writes into its --out directory.
bool written_by_dstrain(const fs::path& entry) {
  const std::string name = entry.filename().string();
  return step_of_name(name) || name == "latest" || name == "run_config.json" ||
         name.starts_with(".tmp-step-");
}

std::string entry_list(const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < 3; ++i) text += (i ? ", " : "") + names[i];
  if (names.size() > 3) text += ", ...";
  return text;
}

}  // namespace

std::vector<std::string> remove_stale_staging(const fs::path& out, std::ostream& out_stream) {
  std::vector<std::string> removed;
  std::error_code error;
  if (!fs::is_directory(out, error)) return removed;
  for (const fs::directory_entry& entry : fs::directory_iterator(out, error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(".tmp-step-")) removed.push_back(name);
  }
  std::sort(removed.begin(), removed.end());
  for (const std::string& name : removed) {
    fs::remove_all(out / name, error);
    DSTRAIN_USER_CHECK(!error) << "cannot remove " << (out / name).string()
                               << ", the half-written checkpoint of an earlier run: "
                               << error.message();
    out_stream << "dstrain: removed " << (out / name).string()
               << ", a checkpoint that a run stopped while saving left half-written\n";
  }
  return removed;
}

std::vector<CheckpointEntry> list_checkpoints(const fs::path& dir) {
  std::vector<CheckpointEntry> found;
  std::error_code error;
  if (!fs::is_directory(dir, error)) return found;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    const std::optional<int64_t> step = step_of_name(entry.path().filename().string());
    if (step && is_complete_checkpoint(entry.path())) found.push_back({*step, entry.path()});
  }
  std::sort(found.begin(), found.end(),
            [](const CheckpointEntry& a, const CheckpointEntry& b) { return a.step < b.step; });
  return found;
}

std::optional<fs::path> find_checkpoint(const fs::path& path) {
  std::error_code error;
  if (!fs::is_directory(path, error)) return std::nullopt;
  // A step directory, whole or not (open_checkpoint says what is missing).
  for (const char* file : {"trainer.json", "model.safetensors", "model.safetensors.index.json",
                           "optimizer.safetensors", "config.json"}) {
    if (fs::exists(path / file, error)) return path;
  }
  const std::vector<CheckpointEntry> checkpoints = list_checkpoints(path);
  const fs::path latest = path / "latest";
  if (fs::is_symlink(latest, error) || fs::exists(latest, error)) {
    // `latest` moves only once its checkpoint is whole: a run stopped between the two (a second
    // signal) has a whole checkpoint newer than the one `latest` names. Resume from that.
    const fs::path named = fs::is_symlink(latest, error) ? fs::read_symlink(latest, error) : latest;
    const std::optional<int64_t> step = step_of_name(named.filename().string());
    if (step && is_complete_checkpoint(path / named) && !checkpoints.empty() &&
        checkpoints.back().step > *step) {
      return checkpoints.back().dir;
    }
    return path;
  }
  if (checkpoints.empty()) return std::nullopt;
  return checkpoints.back().dir;
}

fs::path run_directory_of(const fs::path& checkpoint) {
  std::error_code error;
  if (fs::exists(checkpoint / "trainer.json", error)) {
    const fs::path parent = fs::absolute(checkpoint, error).lexically_normal().parent_path();
    return parent.empty() ? fs::path(".") : parent;
  }
  return checkpoint;
}

bool same_directory(const fs::path& a, const fs::path& b) {
  std::error_code error;
  if (fs::exists(a, error) && fs::exists(b, error)) return fs::equivalent(a, b, error);
  const auto normal = [](const fs::path& p) {
    std::error_code ignored;
    fs::path absolute = fs::absolute(p, ignored).lexically_normal();
    if (!absolute.has_filename()) absolute = absolute.parent_path();
    return absolute;
  };
  return normal(a) == normal(b);
}

void claim_out_directory(const std::string& out, bool overwrite, std::ostream& out_stream,
                         const std::string& flag) {
  std::error_code error;
  if (out.empty() || !fs::exists(out, error)) return;
  DSTRAIN_USER_CHECK(fs::is_directory(out, error))
      << flag << " " << out << " is a file, not a directory: give a directory for the checkpoints";
  std::vector<std::string> ours, others;
  for (const fs::directory_entry& entry : fs::directory_iterator(out, error)) {
    (written_by_dstrain(entry.path()) ? ours : others).push_back(entry.path().filename().string());
  }
  std::sort(ours.begin(), ours.end());
  std::sort(others.begin(), others.end());
  if (ours.empty() && others.empty()) return;
  const std::vector<CheckpointEntry> checkpoints = list_checkpoints(out);
  if (!overwrite) {
    std::string held =
        checkpoints.empty()
            ? (ours.empty() ? entry_list(others) : "an earlier run (" + entry_list(ours) + ")")
            : "an earlier run (" + count_of(static_cast<long long>(checkpoints.size()), "checkpoint") +
                  ", the newest " + checkpoints.back().dir.filename().string() + ")";
    DSTRAIN_USER_ERROR() << flag << " " << out << " already holds " << held
                         << ": continue that run with --resume " << out
                         << ", start over there with --overwrite, or give a new " << flag;
  }
  for (const std::string& name : ours) fs::remove_all(fs::path(out) / name, error);
  fsync_directory(out);
  out_stream << "dstrain: --overwrite: removed the earlier run in " << out << " ("
             << count_of(static_cast<long long>(checkpoints.size()), "checkpoint")
             << (others.empty() ? "" : "; its other files stay: " + entry_list(others)) << ")\n";
}

void check_log_file(const std::string& log, bool appending, bool overwrite) {
  std::error_code error;
  if (log.empty() || appending || overwrite || !fs::exists(log, error)) return;
  DSTRAIN_USER_CHECK(fs::is_regular_file(log, error) && fs::file_size(log, error) == 0)
      << "--log " << log << " already exists: a resumed run (--resume) appends to it; give "
      << "another --log, or --overwrite to replace it";
}

void claim_tensorboard_directory(const std::string& dir, bool appending, bool overwrite) {
  std::error_code error;
  if (dir.empty() || appending || !fs::is_directory(dir, error)) return;
  for (const fs::directory_entry& entry : fs::directory_iterator(dir, error)) {
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) != 0) continue;
    DSTRAIN_USER_CHECK(overwrite)
        << "--tensorboard " << dir << " holds the event files of another run ("
        << entry.path().filename().string() << "), which TensorBoard would draw as this one: "
        << "give another directory, --resume that run, or --overwrite to remove them";
    fs::remove(entry.path(), error);
    DSTRAIN_USER_CHECK(!error) << "cannot remove " << entry.path().string() << ": "
                               << error.message();
  }
}

std::vector<int64_t> keep_last_checkpoints(const fs::path& out, int64_t keep,
                                           const fs::path& written) {
  std::vector<int64_t> removed;
  if (keep <= 0) return removed;
  std::error_code error;
  fs::path latest;
  if (fs::is_symlink(out / "latest", error)) latest = out / fs::read_symlink(out / "latest", error);
  std::vector<CheckpointEntry> others;
  for (const CheckpointEntry& entry : list_checkpoints(out)) {
    const bool protect = same_directory(entry.dir, written) ||
                         (!latest.empty() && same_directory(entry.dir, latest));
    if (!protect) others.push_back(entry);
  }
  // The written one counts as one of the newest N; the rest are the highest steps.
  const int64_t keep_others = keep - 1;
  const int64_t excess = static_cast<int64_t>(others.size()) - keep_others;
  for (int64_t i = 0; i < excess; ++i) {
    fs::remove_all(others[static_cast<size_t>(i)].dir, error);
    DSTRAIN_USER_CHECK(!error) << "--keep-last: cannot remove "
                               << others[static_cast<size_t>(i)].dir.string() << ": "
                               << error.message();
    removed.push_back(others[static_cast<size_t>(i)].step);
  }
  if (!removed.empty()) fsync_directory(out);
  return removed;
}

}  // namespace dstrain
