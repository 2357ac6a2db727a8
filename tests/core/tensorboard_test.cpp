#include "core/tensorboard.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <bit>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/fs.h"
#include "tests/common/temp_dir.h"
#include "tests/common/user_error.h"

namespace dstrain {
namespace {

using testing::expect_user_error_naming;

namespace fs = std::filesystem;
using nlohmann::json;

std::string from_hex(std::string_view hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    bytes.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  }
  return bytes;
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir)) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

// ---- a tiny reader, independent of the writer's encoder --------------------------------------

uint64_t little_endian(std::string_view bytes) {
  uint64_t word = 0;
  for (size_t i = bytes.size(); i-- > 0;) word = (word << 8) | static_cast<uint8_t>(bytes[i]);
  return word;
}

// The data of each TFRecord in `file`; fails the test on a bad length or CRC.
std::vector<std::string> read_records(const std::string& file) {
  std::vector<std::string> records;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_GE(file.size() - at, 16u) << "a truncated record at byte " << at;
    if (file.size() - at < 16) break;
    const std::string_view length_bytes = std::string_view(file).substr(at, 8);
    const uint64_t length = little_endian(length_bytes);
    EXPECT_EQ(little_endian(std::string_view(file).substr(at + 8, 4)), masked_crc32c(length_bytes));
    EXPECT_LE(at + 16 + length, file.size());
    const std::string data = file.substr(at + 12, length);
    EXPECT_EQ(little_endian(std::string_view(file).substr(at + 12 + length, 4)),
              masked_crc32c(data));
    records.push_back(data);
    at += 16 + length;
  }
  return records;
}

struct ReadEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  int session_status = -1;  // -1: no session_log
  std::vector<std::pair<std::string, float>> values;
};

class ProtoReader {
 public:
  explicit ProtoReader(std::string_view bytes) : bytes_(bytes) {}
  bool done() const { return at_ >= bytes_.size(); }
  uint64_t varint() {
    uint64_t value = 0;
    for (int shift = 0; at_ < bytes_.size(); shift += 7) {
      const uint8_t byte = static_cast<uint8_t>(bytes_[at_++]);
      value |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) break;
    }
    return value;
  }
  std::string_view take(size_t n) {
    const std::string_view part = bytes_.substr(at_, n);
    at_ += n;
    return part;
  }
  std::string_view length_delimited() { return take(varint()); }

 private:
  std::string_view bytes_;
  size_t at_ = 0;
};

std::pair<std::string, float> read_value(std::string_view bytes) {
  ProtoReader reader(bytes);
  std::pair<std::string, float> value;
  while (!reader.done()) {
    const uint64_t key = reader.varint();
    if (key == (1 << 3 | 2))
      value.first = reader.length_delimited();
    else if (key == (2 << 3 | 5))
      value.second = std::bit_cast<float>(static_cast<uint32_t>(little_endian(reader.take(4))));
    else
      ADD_FAILURE() << "unexpected Value key " << key;
  }
  return value;
}

ReadEvent read_event(std::string_view bytes) {
  ProtoReader reader(bytes);
  ReadEvent event;
  while (!reader.done()) {
    const uint64_t key = reader.varint();
    if (key == (1 << 3 | 1)) {
      event.wall_time = std::bit_cast<double>(little_endian(reader.take(8)));
    } else if (key == (2 << 3 | 0)) {
      event.step = static_cast<int64_t>(reader.varint());
    } else if (key == (3 << 3 | 2)) {
      event.file_version = reader.length_delimited();
    } else if (key == (5 << 3 | 2)) {
      ProtoReader summary(reader.length_delimited());
      while (!summary.done()) {
        EXPECT_EQ(summary.varint(), 1u << 3 | 2);
        event.values.push_back(read_value(summary.length_delimited()));
      }
    } else if (key == (7 << 3 | 2)) {
      ProtoReader session(reader.length_delimited());
      EXPECT_EQ(session.varint(), 1u << 3 | 0);
      event.session_status = static_cast<int>(session.varint());
    } else {
      ADD_FAILURE() << "unexpected Event key " << key;
      break;
    }
  }
  return event;
}

std::vector<ReadEvent> read_event_file(const fs::path& path) {
  std::vector<ReadEvent> events;
  for (const std::string& record : read_records(read_file(path)))
    events.push_back(read_event(record));
  return events;
}

// ---- CRC32C ---------------------------------------------------------------------------------

TEST(TensorBoard, Crc32c_known_vectors) {
  // The check value of CRC-32C, and the test vectors of RFC 3720 (iSCSI), appendix B.4.
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);
  EXPECT_EQ(crc32c(""), 0u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xFF')), 0x62A8AB43u);
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
}

TEST(TensorBoard, Crc32c_continues_across_pieces) {
  const std::string text = "The quick brown fox jumps over the lazy dog";
  for (size_t split = 0; split <= text.size(); split += 7) {
    const std::string_view whole(text);
    EXPECT_EQ(crc32c(whole.substr(split), crc32c(whole.substr(0, split))), crc32c(text));
  }
}

TEST(TensorBoard, MaskedCrc32c_rotates_and_adds_the_constant) {
  const uint32_t crc = 0xE3069283u;  // crc32c("123456789")
  EXPECT_EQ(masked_crc32c("123456789"), ((crc >> 15) | (crc << 17)) + 0xA282EAD8u);
}

// ---- the bytes, against tensorboard's own writer --------------------------------------------

// Made by `/usr/bin/python3 tests/reference/read_tensorboard.py --fixture` (PyPI tensorboard
// 2.21): the same events built with tensorboard.compat.proto's event_pb2 / summary_pb2,
// serialized by protobuf (SerializeToString) and framed by
// tensorboard.summary.writer.record_writer.RecordWriter.
constexpr std::string_view kVersionRecord =
    "1800000000000000a37f4b220900001040fc54d9411a0d627261696e2e4576656e743a32338d2fe9";
constexpr std::string_view kScalarsRecord =
    "de00000000000000db98a6d70900006040fc54d94110ac022acf010a0b0a046c6f737315000020400a150a0e"
    "74696d652f636f6d707574655f73150000003e0a0b0a047a65726f15000000000a0f0a086e65676174697665"
    "156f1283ba0a8a010a8201747474747474747474747474747474747474747474747474747474747474747474"
    "7474747474747474747474747474747474747474747474747474747474747474747474747474747474747474"
    "7474747474747474747474747474747474747474747474747474747474747474747474747474747474747474"
    "7474747474747474741500e07f478bf42df1";
constexpr std::string_view kStartRecord =
    "0f000000000000006d532b090900008040fc54d94110653a020801273a3e87";
constexpr std::string_view kNegativeStepRecord =
    "1800000000000000a37f4b2210feffffffffffffffff012a0b0a090a026c721552499d39785a1497";

// The event inside a record: after the 8-byte length and its 4-byte CRC, before the data CRC.
std::string event_of(std::string_view record_hex) {
  const std::string record = from_hex(record_hex);
  return record.substr(12, record.size() - 16);
}

TEST(TensorBoard, Events_equal_tensorboards_bytes) {
  const std::vector<TensorBoardScalar> scalars{{"loss", 2.5},
                                               {"time/compute_s", 0.125},
                                               {"zero", 0.0},
                                               {"negative", -1e-3},
                                               {std::string(130, 't'), 65504.0}};  // 2-byte length
  EXPECT_EQ(file_version_event(1700000000.25), event_of(kVersionRecord));
  EXPECT_EQ(scalars_event(1700000001.5, 300, scalars), event_of(kScalarsRecord));
  EXPECT_EQ(session_start_event(1700000002.0, 101), event_of(kStartRecord));
  const std::vector<TensorBoardScalar> lr{{"lr", 3e-4}};
  EXPECT_EQ(scalars_event(0.0, -2, lr), event_of(kNegativeStepRecord));  // 10-byte varint

  EXPECT_EQ(tfrecord(file_version_event(1700000000.25)), from_hex(kVersionRecord));
  EXPECT_EQ(tfrecord(scalars_event(1700000001.5, 300, scalars)), from_hex(kScalarsRecord));
  EXPECT_EQ(tfrecord(session_start_event(1700000002.0, 101)), from_hex(kStartRecord));
  EXPECT_EQ(tfrecord(scalars_event(0.0, -2, lr)), from_hex(kNegativeStepRecord));
}

TEST(TensorBoard, Tfrecord_of_empty_data) {
  const std::string record = tfrecord("");
  ASSERT_EQ(record.size(), 16u);
  EXPECT_EQ(record.substr(0, 8), std::string(8, '\0'));
  EXPECT_EQ(read_records(record), std::vector<std::string>{""});
}

// ---- the writer -------------------------------------------------------------------------------

TEST(TensorBoard, Writer_file_reads_back_with_independent_reader) {
  const testing::TempDir scratch;
  const fs::path dir = scratch.path() / "nested" / "board";  // created with its parents
  fs::path path;
  {
    TensorBoardWriter board(dir, 5);
    path = board.path();
    board.add_scalar("loss", 5, 3.25, 1000.5);
    board.add_scalars(6, {{"loss", 3.0}, {"time/step_s", 0.5}}, 1001.5);
    board.add_scalars(7, std::vector<TensorBoardScalar>{}, 1002.0);  // nothing
  }                                                                  // flushed by the destructor
  EXPECT_EQ(event_files(dir), std::vector<fs::path>{path});
  const std::regex name(R"(events\.out\.tfevents\.\d{10}\.[^/]+\.)" + std::to_string(::getpid()) +
                        R"(\.\d+)");
  EXPECT_TRUE(std::regex_match(path.filename().string(), name)) << path;

  const std::vector<ReadEvent> events = read_event_file(path);
  ASSERT_EQ(events.size(), 4u);
  EXPECT_EQ(events[0].file_version, "brain.Event:2");
  EXPECT_GT(events[0].wall_time, 1.6e9);   // now, in seconds since 1970
  EXPECT_EQ(events[1].session_status, 1);  // START
  EXPECT_EQ(events[1].step, 5);
  EXPECT_EQ(events[2].step, 5);
  EXPECT_EQ(events[2].wall_time, 1000.5);
  EXPECT_EQ(events[2].values, (std::vector<std::pair<std::string, float>>{{"loss", 3.25f}}));
  EXPECT_EQ(events[3].step, 6);
  EXPECT_EQ(events[3].values,
            (std::vector<std::pair<std::string, float>>{{"loss", 3.0f}, {"time/step_s", 0.5f}}));
}

TEST(TensorBoard, Writer_flush_hands_queued_events_to_the_file) {
  const testing::TempDir scratch;
  TensorBoardWriter board(scratch.path());
  const uintmax_t header = fs::file_size(board.path());  // the version event, written at once
  EXPECT_EQ(read_event_file(board.path()).size(), 1u);
  board.add_scalar("loss", 1, 2.0);
  EXPECT_EQ(fs::file_size(board.path()), header);
  board.flush();
  EXPECT_GT(fs::file_size(board.path()), header);
  EXPECT_EQ(read_event_file(board.path()).size(), 2u);
}

TEST(TensorBoard, Writer_second_run_adds_a_file_and_keeps_the_first) {
  const testing::TempDir scratch;
  fs::path first_path;
  std::string first_bytes;
  {
    TensorBoardWriter first(scratch.path());
    first.add_scalar("loss", 1, 4.0);
    first.flush();
    first_path = first.path();
  }
  first_bytes = read_file(first_path);
  {
    TensorBoardWriter second(scratch.path(), 1);
    second.add_scalar("loss", 1, 3.5);
    EXPECT_NE(second.path(), first_path);
  }
  const std::vector<fs::path> files = event_files(scratch.path());
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0], first_path);  // name order is write order: TensorBoard reads it so
  EXPECT_EQ(read_file(first_path), first_bytes);
}

// ---- errors -----------------------------------------------------------------------------------


TEST(TensorBoard, Writer_directory_that_is_a_file_is_user_error) {
  const testing::TempDir scratch;
  const fs::path file = scratch.path() / "board";
  write_file_atomic(file, "not a directory");
  const std::string message =
      expect_user_error_naming(file, [&] { TensorBoardWriter board(file); });
  EXPECT_NE(message.find("Not a directory"), std::string::npos) << message;
  const fs::path below_file = file / "run1";
  const std::string below =
      expect_user_error_naming(below_file, [&] { TensorBoardWriter board(below_file); });
  EXPECT_NE(below.find("Not a directory"), std::string::npos) << below;
}

TEST(TensorBoard, Writer_unwritable_directory_is_user_error) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes into any directory";
  const testing::TempDir scratch;
  const fs::path dir = scratch.path() / "read_only";
  fs::create_directory(dir);
  fs::permissions(dir, fs::perms::owner_read | fs::perms::owner_exec);
  const std::string message = expect_user_error_naming(dir, [&] { TensorBoardWriter board(dir); });
  EXPECT_NE(message.find("Permission denied"), std::string::npos) << message;
  fs::permissions(dir, fs::perms::owner_all);
}

// In a child process: writes past a file-size limit of 200 bytes (SIGXFSZ ignored, so write
// fails with EFBIG, as on a full disk) and exits 0 when the UserError names the file and the
// OS error.
[[noreturn]] void write_past_file_size_limit(const fs::path& dir) {
  std::signal(SIGXFSZ, SIG_IGN);
  const rlimit limit{200, 200};
  ::setrlimit(RLIMIT_FSIZE, &limit);
  TensorBoardWriter board(dir);
  try {
    board.add_scalar(std::string(300, 'x'), 1, 1.0);
    board.flush();
  } catch (const UserError& error) {
    const std::string message = error.what();
    std::fprintf(stderr, "%s\n", message.c_str());
    const bool names_file = message.find(board.path().string()) != std::string::npos;
    std::_Exit(names_file && message.find('\n') == std::string::npos ? 0 : 3);
  }
  std::_Exit(2);
}

TEST(TensorBoard, Writer_write_failure_is_user_error_naming_file) {
  const testing::TempDir scratch;
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(write_past_file_size_limit(scratch.path()), ::testing::ExitedWithCode(0),
              "writing the TensorBoard event file .* failed: File too large");
}

// ---- JSONL records to scalars ---------------------------------------------------------------

// A step record as src/train/rank_trainer.cpp's report_step writes it, every optional part on.
json step_record(int64_t step, double loss) {
  json record{{"step", step},
              {"loss", loss},
              {"lr", 3e-4 * static_cast<double>(step)},
              {"grad_norm", 1.5 / static_cast<double>(step)},
              {"tokens_per_s", 12345.5}};
  record["loss_scale"] = 65536.0;
  record["skipped"] = step == 3;
  record["pipeline_bubble"] = {0.125, 0.25};
  record["tensor_parallel"] = {{"collectives", {4, 6}},
                               {"all_reduce_bytes", {1048576, 3145728}},
                               {"comm_share", {0.05, 0.0625}}};
  record["expert_load"] = json::array();
  for (int layer : {1, 3}) {
    record["expert_load"].push_back(
        {{"layer", layer}, {"min", 3}, {"max", 9 + layer}, {"mean", 6.5}, {"dropped", 0}});
  }
  record["aux_loss"] = 0.01;
  record["time"] = {
      {"step_s", 0.5},   {"compute_s", 0.375}, {"optimizer_s", 0.0625}, {"comm_exposed_s", 0.03125},
      {"bubble_s", 0.0}, {"other_s", 0.03125}, {"comm_total_s", 0.125}};
  record["mfu"] = 0.41;
  return record;
}

json memory_record() {
  const json bytes{{"parameters", 1 << 20}, {"activations", 3 << 20}, {"data", 4096}};
  return {{"type", "memory"},
          {"ranks", 2},
          {"peak_bytes", bytes},
          {"device_peak_bytes", bytes},
          {"host_peak_bytes", json::object()},
          {"per_rank_peak_bytes", {bytes, bytes}}};
}

std::map<std::string, double> as_map(const std::vector<TensorBoardScalar>& scalars) {
  std::map<std::string, double> map;
  for (const TensorBoardScalar& scalar : scalars)
    EXPECT_TRUE(map.emplace(scalar.tag, scalar.value).second) << scalar.tag;
  return map;
}

TEST(TensorBoard, LogRecord_step_record_tags) {
  const LogScalars got = scalars_of_log_record(step_record(3, 2.75), 0);
  EXPECT_EQ(got.step, 3);
  const std::map<std::string, double> values = as_map(got.scalars);
  std::set<std::string> tags;
  for (const auto& [tag, value] : values) tags.insert(tag);
  const std::set<std::string> expected{"loss",
                                       "lr",
                                       "grad_norm",
                                       "tokens_per_s",
                                       "loss_scale",
                                       "skipped",
                                       "pipeline_bubble/0",
                                       "pipeline_bubble/1",
                                       "tensor_parallel/collectives/0",
                                       "tensor_parallel/collectives/1",
                                       "tensor_parallel/all_reduce_bytes/0",
                                       "tensor_parallel/all_reduce_bytes/1",
                                       "tensor_parallel/comm_share/0",
                                       "tensor_parallel/comm_share/1",
                                       "expert_load/layer_1/min",
                                       "expert_load/layer_1/max",
                                       "expert_load/layer_1/mean",
                                       "expert_load/layer_1/dropped",
                                       "expert_load/layer_3/min",
                                       "expert_load/layer_3/max",
                                       "expert_load/layer_3/mean",
                                       "expert_load/layer_3/dropped",
                                       "aux_loss",
                                       "time/step_s",
                                       "time/compute_s",
                                       "time/optimizer_s",
                                       "time/comm_exposed_s",
                                       "time/bubble_s",
                                       "time/other_s",
                                       "time/comm_total_s",
                                       "mfu"};
  EXPECT_EQ(tags, expected);
  EXPECT_EQ(values.at("loss"), 2.75);
  EXPECT_EQ(values.at("skipped"), 1.0);  // true
  EXPECT_EQ(values.at("expert_load/layer_3/max"), 12.0);
  EXPECT_EQ(values.at("tensor_parallel/all_reduce_bytes/1"), 3145728.0);
  EXPECT_EQ(values.at("time/compute_s"), 0.375);
  EXPECT_EQ(as_map(scalars_of_log_record(step_record(4, 2.5), 0).scalars).at("skipped"), 0.0);
}

TEST(TensorBoard, LogRecord_records_without_step) {
  const LogScalars memory = scalars_of_log_record(memory_record(), 40);
  EXPECT_EQ(memory.step, 40);  // where the run starts
  const std::map<std::string, double> values = as_map(memory.scalars);
  EXPECT_EQ(values.at("memory/ranks"), 2.0);
  EXPECT_EQ(values.at("memory/peak_bytes/activations"), 3 << 20);
  EXPECT_EQ(values.at("memory/per_rank_peak_bytes/1/data"), 4096.0);
  EXPECT_EQ(values.count("memory/type"), 0u);
  EXPECT_EQ(values.size(), 1u + 3 * 2 + 3 * 2);

  const json summary{
      {"type", "summary"},
      {"steps", 50},
      {"interrupted", false},
      {"tokens_per_s", 1000.0},
      {"stages", {{{"stage", 0}, {"layers", {0, 2}}, {"compute_s_per_step", 0.25}}}}};
  const LogScalars at_end = scalars_of_log_record(summary, 40);
  EXPECT_EQ(at_end.step, 50);
  const std::map<std::string, double> end_values = as_map(at_end.scalars);
  EXPECT_EQ(end_values.at("summary/interrupted"), 0.0);
  EXPECT_EQ(end_values.at("summary/stages/stage_0/compute_s_per_step"), 0.25);
  EXPECT_EQ(end_values.at("summary/stages/stage_0/layers/1"), 2.0);
  EXPECT_EQ(end_values.count("summary/stages/stage_0/stage"), 0u);

  const json config{{"type", "config"}, {"lr", 3e-4}, {"steps", 50}, {"lr_schedule", "cosine"}};
  EXPECT_TRUE(scalars_of_log_record(config, 0).scalars.empty());
  EXPECT_TRUE(scalars_of_log_record(json{{"device", "cpu"}, {"ranks", 2}}, 0).scalars.empty());
  EXPECT_TRUE(scalars_of_log_record(json::array({1, 2}), 0).scalars.empty());
  const LogScalars eval =
      scalars_of_log_record(json{{"step", 8}, {"eval_loss", 2.0}, {"note", "x"}}, 0);
  EXPECT_EQ(eval.step, 8);
  EXPECT_EQ(as_map(eval.scalars), (std::map<std::string, double>{{"eval_loss", 2.0}}));
}

// ---- tensorboard's own reader -----------------------------------------------------------------

// What the trainer does with each record: the JSONL line and, when it has scalars, an event.
void log_record(std::ofstream& log, TensorBoardWriter& board, const json& record,
                int64_t start_step) {
  log << record.dump() << '\n';
  const LogScalars scalars = scalars_of_log_record(record, start_step);
  board.add_scalars(scalars.step, scalars.scalars);
  board.flush();
}

// Two runs into one directory, as a run interrupted at step 6 and resumed from its checkpoint
// of step 4 writes them (the log appended, a new event file); then
// tests/reference/read_tensorboard.py reads the directory with tensorboard's EventAccumulator
// and compares every scalar with the log.
TEST(TensorBoard, TensorboardReadsWhatTheWriterWrote) {
  if (!fs::exists("/usr/bin/python3")) GTEST_SKIP() << "no /usr/bin/python3";
  const testing::TempDir scratch;
  const fs::path dir = scratch.path() / "board", log_path = scratch.path() / "log.jsonl";
  std::ofstream log(log_path);
  {
    TensorBoardWriter board(dir, 1);
    log_record(log, board, {{"type", "config"}, {"lr", 3e-4}}, 0);
    log_record(log, board, {{"type", "data"}, {"entropy_floor", 1.25}}, 0);
    log_record(log, board, memory_record(), 0);
    for (int64_t step = 1; step <= 6; ++step) {
      log_record(log, board, step_record(step, step == 2 ? std::nan("") : 4.0 - 0.25 * step), 0);
      if (step == 4) log_record(log, board, {{"step", step}, {"eval_loss", 3.5}}, 0);
    }
  }
  {
    TensorBoardWriter board(dir, 5);  // resumed at step 4
    log_record(log, board, memory_record(), 4);
    for (int64_t step = 5; step <= 8; ++step)
      log_record(log, board, step_record(step, 3.0 - 0.125 * step), 4);
    log_record(log, board, {{"step", 8}, {"eval_loss", 3.0}}, 4);
    log_record(log, board,
               {{"type", "summary"},
                {"steps", 8},
                {"interrupted", false},
                {"time_per_step", {{"step_s", 0.5}}}},
               4);
  }
  log.close();
  const fs::path output = scratch.path() / "read_tensorboard.txt";
  const std::string command = std::string("/usr/bin/python3 ") + DSTRAIN_SOURCE_DIR +
                              "/tests/reference/read_tensorboard.py " + dir.string() + " " +
                              log_path.string() + " > " + output.string() + " 2>&1";
  const int status = std::system(command.c_str());
  ASSERT_TRUE(WIFEXITED(status)) << command;
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << read_file(output);
  EXPECT_EQ(WEXITSTATUS(status), 0) << read_file(output);
  EXPECT_NE(read_file(output).find("OK: 0 differences"), std::string::npos) << read_file(output);
}

}  // namespace
}  // namespace dstrain
