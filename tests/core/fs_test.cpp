#include "core/fs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <set>
#include <string>

#include "core/check.h"
#include "tests/common/user_error.h"

namespace dstrain {
namespace {

using testing::expect_user_error_naming;

namespace fs = std::filesystem;

// A scratch directory for one test: a StagingDir that is never committed is removed whole.
fs::path scratch_for_test() {
  return fs::path(::testing::TempDir()) / "dstrain_fs_test" /
         ::testing::UnitTest::GetInstance()->current_test_info()->name();
}

std::set<std::string> entries_of(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.insert(entry.path().filename());
  return names;
}


TEST(Fs, ReadFile_round_trip_and_binary_bytes) {
  StagingDir scratch(scratch_for_test());
  const fs::path path = scratch.path() / "bytes.bin";
  std::string bytes;
  for (int i = 0; i < 300000; ++i) bytes.push_back(static_cast<char>(i * 7 + (i >> 8)));
  write_file_atomic(path, bytes);
  EXPECT_EQ(read_file(path), bytes);
  write_file_atomic(path, "");
  EXPECT_EQ(read_file(path), "");
}

TEST(Fs, ReadFile_missing_or_directory_is_user_error_naming_path) {
  StagingDir scratch(scratch_for_test());
  const fs::path missing = scratch.path() / "no_such_file.txt";
  const std::string message = expect_user_error_naming(missing, [&] { read_file(missing); });
  EXPECT_NE(message.find("No such file"), std::string::npos) << message;
  const std::string directory_message =
      expect_user_error_naming(scratch.path(), [&] { read_file(scratch.path()); });
  EXPECT_NE(directory_message.find("directory"), std::string::npos) << directory_message;
}

TEST(Fs, WriteFileAtomic_leaves_no_temp_files) {
  StagingDir scratch(scratch_for_test());
  const fs::path path = scratch.path() / "config.json";
  write_file_atomic(path, "{}");
  write_file_atomic(path, "{\"a\": 1}");  // replaces
  EXPECT_EQ(entries_of(scratch.path()), (std::set<std::string>{"config.json"}));
  EXPECT_EQ(read_file(path), "{\"a\": 1}");
}

TEST(Fs, AtomicFileWriter_replaces_existing_target_only_whole) {
  StagingDir scratch(scratch_for_test());
  const fs::path path = scratch.path() / "weights.bin";
  write_file_atomic(path, "old contents");
  {
    AtomicFileWriter out(path);
    out.write("new ");
    EXPECT_EQ(read_file(path), "old contents");  // readers still see the old file whole
    EXPECT_TRUE(fs::exists(out.temp_path()));
    EXPECT_EQ(out.temp_path().parent_path(), path.parent_path());  // same file system
    out.write(std::string(100000, 'x'));
    EXPECT_EQ(read_file(path), "old contents");
    EXPECT_EQ(out.bytes_written(), 100004u);
    out.commit();
  }
  EXPECT_EQ(read_file(path), "new " + std::string(100000, 'x'));
  EXPECT_EQ(entries_of(scratch.path()), (std::set<std::string>{"weights.bin"}));
}

TEST(Fs, AtomicFileWriter_without_commit_removes_temp_and_keeps_old) {
  StagingDir scratch(scratch_for_test());
  const fs::path path = scratch.path() / "weights.bin";
  write_file_atomic(path, "old contents");
  fs::path temp;
  {
    AtomicFileWriter out(path);
    temp = out.temp_path();
    out.write("half of the new");
    // An exception would unwind here: no commit.
  }
  EXPECT_FALSE(fs::exists(temp));
  EXPECT_EQ(read_file(path), "old contents");
  EXPECT_EQ(entries_of(scratch.path()), (std::set<std::string>{"weights.bin"}));
}

TEST(Fs, WriteFileAtomic_failure_cleans_up_and_names_path) {
  StagingDir scratch(scratch_for_test());
  // The target is a directory: the rename fails after the temp file was written.
  const fs::path directory_target = scratch.path() / "a_directory";
  fs::create_directory(directory_target);
  fs::create_directory(directory_target / "child");
  expect_user_error_naming(directory_target,
                           [&] { write_file_atomic(directory_target, "contents"); });
  EXPECT_EQ(entries_of(scratch.path()), (std::set<std::string>{"a_directory"}));
  EXPECT_TRUE(fs::is_directory(directory_target / "child"));

  // The directory does not exist: nothing can be created.
  const fs::path no_directory = scratch.path() / "missing_dir" / "file.txt";
  const std::string message =
      expect_user_error_naming(no_directory, [&] { write_file_atomic(no_directory, "x"); });
  EXPECT_NE(message.find("No such file"), std::string::npos) << message;
  EXPECT_EQ(entries_of(scratch.path()), (std::set<std::string>{"a_directory"}));
}

TEST(Fs, FsyncDirectory_and_tree) {
  StagingDir scratch(scratch_for_test());
  fs::create_directories(scratch.path() / "a" / "b");
  write_file_atomic(scratch.path() / "a" / "b" / "file", "x");
  fs::create_symlink("does_not_exist", scratch.path() / "a" / "dangling");  // not followed
  fsync_directory(scratch.path());
  fsync_tree(scratch.path());
  fsync_tree(scratch.path() / "a" / "b" / "file");
  const fs::path missing = scratch.path() / "missing";
  expect_user_error_naming(missing, [&] { fsync_directory(missing); });
  expect_user_error_naming(missing, [&] { fsync_tree(missing); });
}

TEST(Fs, StagingDir_commit_publishes_whole_directory) {
  StagingDir scratch(scratch_for_test());
  const fs::path run = scratch.path() / "run";  // does not exist yet: created
  const fs::path final_path = run / "step-000100";
  {
    StagingDir staging(final_path);
    EXPECT_EQ(staging.path().parent_path(), run);
    EXPECT_EQ(staging.path().filename().string().rfind(".tmp-step-000100-", 0), 0u);
    write_file_atomic(staging.path() / "model.safetensors", "weights");
    fs::create_directory(staging.path() / "rank0");
    write_file_atomic(staging.path() / "rank0" / "optimizer.bin", "moments");
    EXPECT_FALSE(fs::exists(final_path));  // nothing visible before commit
    staging.commit();
    EXPECT_TRUE(staging.committed());
  }
  EXPECT_EQ(entries_of(run), (std::set<std::string>{"step-000100"}));
  EXPECT_EQ(read_file(final_path / "model.safetensors"), "weights");
  EXPECT_EQ(read_file(final_path / "rank0" / "optimizer.bin"), "moments");
}

TEST(Fs, StagingDir_without_commit_is_removed) {
  StagingDir scratch(scratch_for_test());
  const fs::path final_path = scratch.path() / "step-000200/";  // a trailing slash is fine
  fs::path staging_path;
  {
    StagingDir staging(final_path);
    staging_path = staging.path();
    fs::create_directories(staging.path() / "deep" / "er");
    write_file_atomic(staging.path() / "deep" / "er" / "file", "partial");
  }
  EXPECT_FALSE(fs::exists(staging_path));
  EXPECT_TRUE(entries_of(scratch.path()).empty());
}

TEST(Fs, StagingDir_replaces_existing_directory_whole) {
  StagingDir scratch(scratch_for_test());
  const fs::path final_path = scratch.path() / "step-000300";
  fs::create_directory(final_path);
  write_file_atomic(final_path / "old_only", "old");
  write_file_atomic(final_path / "model.safetensors", "old weights");
  {
    StagingDir staging(final_path);
    write_file_atomic(staging.path() / "model.safetensors", "new weights");
    staging.commit();
  }
  EXPECT_EQ(entries_of(scratch.path()), (std::set<std::string>{"step-000300"}));
  EXPECT_EQ(entries_of(final_path), (std::set<std::string>{"model.safetensors"}));
  EXPECT_EQ(read_file(final_path / "model.safetensors"), "new weights");
}

TEST(Fs, StagingDir_removes_stale_leftover_of_same_pid) {
  StagingDir scratch(scratch_for_test());
  const fs::path final_path = scratch.path() / "step-000400";
  fs::path stale;
  {
    StagingDir first(final_path);
    stale = first.path();
  }
  fs::create_directories(stale / "junk");  // as if a crashed run with our pid left it
  StagingDir second(final_path);
  EXPECT_EQ(second.path(), stale);
  EXPECT_TRUE(entries_of(second.path()).empty());
}

TEST(Fs, MappedFile_maps_contents_and_moves) {
  StagingDir scratch(scratch_for_test());
  const fs::path path = scratch.path() / "tokens.bin";
  std::string bytes(12345, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>(i % 251);
  write_file_atomic(path, bytes);
  MappedFile file = MappedFile::open(path);
  ASSERT_EQ(file.size(), bytes.size());
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file.data()), file.size()), bytes);
  EXPECT_EQ(file.path(), path);
  const uint8_t* data = file.data();
  MappedFile moved = std::move(file);
  EXPECT_EQ(moved.data(), data);
  EXPECT_EQ(file.data(), nullptr);
  EXPECT_EQ(moved.data()[250], 250);

  write_file_atomic(scratch.path() / "empty", "");
  const MappedFile empty = MappedFile::open(scratch.path() / "empty");
  EXPECT_EQ(empty.size(), 0u);
  const fs::path missing = scratch.path() / "missing.bin";
  expect_user_error_naming(missing, [&] { MappedFile::open(missing); });
}

}  // namespace
}  // namespace dstrain
