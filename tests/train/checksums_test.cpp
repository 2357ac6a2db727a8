// Checkpoint checksums (train/checksums.h): CRC-32 against its standard check value; many
// writers' ranges of one file, recorded in random order from several threads at once, combine
// into the CRC-32 of the whole file as zlib computes it in one pass; ranges with a gap or an
// overlap are an internal error; verifying names each kind of damage. --mirror's copy
// (train/mirror.h): the same bytes, latest and --keep-last moved only after it reads back
// whole, nothing committed from a damaged checkpoint, a failing mirror said, not thrown.
#include "train/checksums.h"

#include <gtest/gtest.h>
#include <zlib.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/check.h"
#include "core/fs.h"
#include "train/mirror.h"
#include "tests/common/temp_dir.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

std::string random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::string bytes(n, '\0');
  for (char& c : bytes) c = static_cast<char>(rng());
  return bytes;
}

uint32_t zlib_crc(const std::string& bytes) {
  return static_cast<uint32_t>(
      ::crc32(0, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

void write_bytes(const fs::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

void flip_byte(const fs::path& path, size_t at) {
  std::fstream file(path, std::ios::binary | std::ios::in | std::ios::out);
  file.seekg(static_cast<std::streamoff>(at));
  const char c = static_cast<char>(file.get());
  file.seekp(static_cast<std::streamoff>(at));
  file.put(static_cast<char>(c ^ 0x10));
}

TEST(Checksums, Crc32IsTheStandardOne) {
  EXPECT_EQ(crc32_of("123456789"), 0xCBF43926u);  // the CRC-32 check value
  EXPECT_EQ(crc32_of(""), 0u);
  EXPECT_EQ(crc32_of("56789", crc32_of("1234")), 0xCBF43926u);
}

// `data` cut at random points into pieces, dealt to `writers` threads in random order; each
// records what it wrote, all at once.
void record_in_pieces(const fs::path& staging, const std::string& name, const std::string& data,
                      int writers, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<size_t> cuts = {0, data.size()};
  for (int i = 0; i < 60; ++i) cuts.push_back(rng() % data.size());
  std::sort(cuts.begin(), cuts.end());
  std::vector<std::pair<size_t, size_t>> pieces;
  for (size_t i = 0; i + 1 < cuts.size(); ++i) pieces.emplace_back(cuts[i], cuts[i + 1]);
  std::shuffle(pieces.begin(), pieces.end(), rng);
  std::vector<std::thread> threads;
  for (int w = 0; w < writers; ++w) {
    threads.emplace_back([&, w] {
      WrittenRanges ranges;
      for (size_t i = static_cast<size_t>(w); i < pieces.size(); i += writers) {
        const auto [begin, end] = pieces[i];
        ranges.add(name, begin, std::string_view(data).substr(begin, end - begin));
      }
      ranges.record(staging);
    });
  }
  for (std::thread& t : threads) t.join();
}

TEST(Checksums, WritersRangesCombineIntoTheWholeFilesCrc32) {
  const testing::TempDir dir;
  const std::string data = random_bytes(1 << 20, 1), small = random_bytes(333, 2);
  write_bytes(dir.path() / "model.safetensors", data);
  write_bytes(dir.path() / "config.json", small);
  record_in_pieces(dir.path(), "model.safetensors", data, 4, 3);
  WrittenRanges whole;
  whole.add_whole("config.json", small);
  whole.record(dir.path());
  write_checksums(dir.path());
  const nlohmann::json checksums = nlohmann::json::parse(read_file(dir.path() / "checksums.json"));
  char hex[16];
  std::snprintf(hex, sizeof hex, "%08x", zlib_crc(data));
  EXPECT_EQ(checksums["files"]["model.safetensors"]["crc32"], hex);
  EXPECT_EQ(checksums["files"]["model.safetensors"]["bytes"], data.size());
  std::snprintf(hex, sizeof hex, "%08x", zlib_crc(small));
  EXPECT_EQ(checksums["files"]["config.json"]["crc32"], hex);
  // The records are gone: the directory holds the files and checksums.json.
  size_t entries = 0;
  for ([[maybe_unused]] const auto& entry : fs::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 3u);
  const Verification v = verify_checkpoint(dir.path());
  EXPECT_TRUE(v.has_checksums);
  EXPECT_EQ(v.damage, "");
  EXPECT_EQ(v.files, 2u);
  EXPECT_EQ(v.bytes, data.size() + small.size());
}

TEST(Checksums, RangesWithAGapOrAnOverlapAreAnInternalError) {
  const std::string data = random_bytes(1000, 4);
  for (const auto& [second, what] :
       std::vector<std::pair<size_t, std::string>>{{600, "leave a gap"}, {400, "overlap"}}) {
    const testing::TempDir dir;
    write_bytes(dir.path() / "f.bin", data);
    WrittenRanges ranges;
    ranges.add("f.bin", 0, std::string_view(data).substr(0, 500));
    ranges.add("f.bin", second, std::string_view(data).substr(second));
    ranges.record(dir.path());
    try {
      write_checksums(dir.path());
      ADD_FAILURE() << what << " not caught";
    } catch (const UserError&) {
      ADD_FAILURE() << "a user error: " << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
}

TEST(Checksums, VerifyNamesEachKindOfDamage) {
  const std::string data = random_bytes(5000, 5);
  const auto checkpoint = [&](const fs::path& dir) {
    write_bytes(dir / "model.safetensors", data);
    WrittenRanges ranges;
    ranges.add_whole("model.safetensors", data);
    ranges.record(dir);
    write_checksums(dir);
  };
  const auto damage = [&](const std::function<void(const fs::path&)>& harm) {
    const testing::TempDir dir;
    checkpoint(dir.path());
    harm(dir.path());
    return verify_checkpoint(dir.path()).damage;
  };
  EXPECT_EQ(damage([](const fs::path&) {}), "");
  EXPECT_NE(damage([](const fs::path& d) {
              flip_byte(d / "model.safetensors", 4321);
            }).find("model.safetensors has CRC-32 "),
            std::string::npos);
  EXPECT_EQ(damage([](const fs::path& d) { fs::resize_file(d / "model.safetensors", 4000); }),
            "model.safetensors is 4000 bytes where the checkpoint wrote 5000");
  EXPECT_EQ(damage([](const fs::path& d) { fs::remove(d / "model.safetensors"); }),
            "model.safetensors is missing");
  EXPECT_EQ(damage([](const fs::path& d) { write_bytes(d / "checksums.json", "{\"files\""); }),
            "checksums.json is not valid JSON");
  const std::string outside = R"({"algorithm": "crc32",
                                   "files": {"../x": {"bytes": 1, "crc32": "0"}}})";
  EXPECT_EQ(damage([&](const fs::path& d) { write_bytes(d / "checksums.json", outside); }),
            "checksums.json's entry \"../x\" is malformed");
  const testing::TempDir none;
  EXPECT_FALSE(verify_checkpoint(none.path()).has_checksums);
}

// A checkpoint directory `dir` of random files (one above the copy's 8 MiB read piece) and a
// trainer.json saying it is complete, with its checksums.json, as a writer leaves it.
void write_checkpoint(const fs::path& dir, uint64_t seed) {
  fs::create_directories(dir);
  WrittenRanges ranges;
  const auto write = [&](const std::string& name, const std::string& bytes) {
    write_bytes(dir / name, bytes);
    ranges.add_whole(name, bytes);
  };
  write("model.safetensors", random_bytes((9 << 20) + 77, seed));
  write("config.json", random_bytes(512, seed + 1));
  write("trainer.json", nlohmann::json{{"complete", true}, {"seed", seed}}.dump());
  ranges.record(dir);
  write_checksums(dir);
}

TEST(Checksums, CopyCheckpointCopiesTheBytesItVerifies) {
  const testing::TempDir dir;
  write_checkpoint(dir.path() / "step-000001", 10);
  fs::create_directories(dir.path() / "copy");
  const Verification v = copy_checkpoint(dir.path() / "step-000001", dir.path() / "copy");
  EXPECT_EQ(v.damage, "");
  EXPECT_EQ(v.files, 3u);
  for (const char* name : {"model.safetensors", "config.json", "trainer.json", "checksums.json"}) {
    EXPECT_EQ(read_file(dir.path() / "copy" / name), read_file(dir.path() / "step-000001" / name))
        << name;
  }
  EXPECT_EQ(verify_checkpoint(dir.path() / "copy").damage, "");
  // A damaged source: the damaged file is not left in the copy.
  flip_byte(dir.path() / "step-000001" / "model.safetensors", 9 << 20);
  fs::remove_all(dir.path() / "copy");
  fs::create_directories(dir.path() / "copy");
  const Verification damaged = copy_checkpoint(dir.path() / "step-000001", dir.path() / "copy");
  EXPECT_NE(damaged.damage.find("model.safetensors has CRC-32 "), std::string::npos);
  EXPECT_FALSE(fs::exists(dir.path() / "copy" / "model.safetensors"));
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(Mirror, CopiesEachCheckpointAndKeepsTheNewest) {
  const testing::TempDir dir;
  const fs::path out = dir.path() / "out", mirror = dir.path() / "mirror";
  for (int step = 1; step <= 3; ++step) {
    const fs::path written = out / ("step-00000" + std::to_string(step));
    write_checkpoint(written, 20 + static_cast<uint64_t>(step) * 5);
    const MirrorResult r = mirror_checkpoint(written, mirror, 2);
    EXPECT_EQ(r.failure, "");
    EXPECT_TRUE(r.source_read);
    EXPECT_EQ(r.source_damage, "");
    EXPECT_EQ(r.dir, mirror / written.filename());
    EXPECT_EQ(r.copied.files, 3u);
    EXPECT_EQ(r.removed, step == 3 ? std::vector<int64_t>{1} : std::vector<int64_t>{});
    EXPECT_EQ(read_file(r.dir / "model.safetensors"), read_file(written / "model.safetensors"));
    EXPECT_EQ(fs::read_symlink(mirror / "latest"), written.filename());
    EXPECT_NE(describe_mirror(r).find("mirrored to " + r.dir.string() + " (verified, "),
              std::string::npos);
  }
  EXPECT_EQ(entries(mirror), (std::vector<std::string>{"latest", "step-000002", "step-000003"}));
}

TEST(Mirror, ADamagedCheckpointOrAFailingMirrorIsSaidAndNothingMoves) {
  const testing::TempDir dir;
  const fs::path mirror = dir.path() / "mirror";
  write_checkpoint(dir.path() / "out" / "step-000001", 40);
  ASSERT_EQ(mirror_checkpoint(dir.path() / "out" / "step-000001", mirror, 0).failure, "");
  const fs::path second = dir.path() / "out" / "step-000002";
  write_checkpoint(second, 50);
  flip_byte(second / "config.json", 100);
  const MirrorResult r = mirror_checkpoint(second, mirror, 1);
  EXPECT_TRUE(r.source_read);
  EXPECT_NE(r.source_damage.find("config.json has CRC-32 "), std::string::npos) << r.source_damage;
  EXPECT_TRUE(r.dir.empty());
  EXPECT_EQ(describe_mirror(r), "NOT mirrored: the checkpoint in --out is damaged");
  // Nothing of it in the mirror (no staging left either), latest and step 1 as they were.
  EXPECT_EQ(entries(mirror), (std::vector<std::string>{"latest", "step-000001"}));
  EXPECT_EQ(fs::read_symlink(mirror / "latest"), "step-000001");
  // A mirror that cannot be written (a file where its directory should be): said, not thrown.
  write_bytes(dir.path() / "blocker", "a file");
  const MirrorResult blocked =
      mirror_checkpoint(dir.path() / "out" / "step-000001", dir.path() / "blocker" / "m", 0);
  EXPECT_TRUE(blocked.dir.empty());
  EXPECT_FALSE(blocked.source_read);
  EXPECT_NE(blocked.failure.find("blocker"), std::string::npos) << blocked.failure;
}

}  // namespace
}  // namespace dstrain
