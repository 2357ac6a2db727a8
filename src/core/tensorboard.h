// TensorBoard event files, written without TensorFlow or protobuf: scalars only.
//
// An event file is a sequence of TFRecords, each holding one serialized `tensorboard.Event`
// protocol buffer (tensorboard/compat/proto/event.proto and summary.proto):
//
//   TFRecord:  uint64 length (little-endian) | uint32 masked_crc32c(length bytes)
//              | data[length] | uint32 masked_crc32c(data)
//   masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8, c = CRC32C(x) (Castagnoli)
//   Event:     wall_time = 1 (double), step = 2 (int64), one of: file_version = 3 (string,
//              "brain.Event:2" in a file's first event), summary = 5 (Summary),
//              session_log = 7 (SessionLog)
//   Summary:   value = 1 (repeated Value);  Value: tag = 1 (string), simple_value = 2 (float)
//   SessionLog: status = 1 (enum; START = 1)
//
// Fields are written in field-number order and proto3 defaults (step 0, wall_time 0) are
// left out, so the bytes equal those of protobuf's own serializer (the test compares them
// with bytes that tensorboard's Python writer made: tests/reference/read_tensorboard.py).
#pragma once

#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dstrain {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `bytes`, continuing from `crc`
// (the CRC of the bytes before: crc32c(ab) == crc32c(b, crc32c(a))).
uint32_t crc32c(std::string_view bytes, uint32_t crc = 0);
// The TFRecord form of crc32c(bytes): rotated right by 15 bits, plus 0xa282ead8.
uint32_t masked_crc32c(std::string_view bytes);

// `data` framed as one TFRecord.
std::string tfrecord(std::string_view data);

// One named value of a step. Written as a float32 (TensorBoard's simple_value): integers
// above 2^24 (byte counts) keep 24 significant bits.
struct TensorBoardScalar {
  std::string tag;  // REQUIRES: not empty; "/" groups charts in TensorBoard ("time/compute_s")
  double value = 0;
};

// The serialized Event protos the writer frames (for tests; a writer needs none of them).
std::string file_version_event(double wall_time);  // file_version "brain.Event:2"
std::string scalars_event(double wall_time, int64_t step,
                          std::span<const TensorBoardScalar> scalars);
std::string session_start_event(double wall_time, int64_t step);  // SessionLog START

// Seconds since the Unix epoch, with the system clock's resolution (an Event's wall_time).
double unix_seconds_now();

// Appends scalars to a new event file in a directory that TensorBoard reads as one run
// (`tensorboard --logdir` on it or on its parent). Not thread-safe: one thread writes.
//
//   TensorBoardWriter board(run_dir / "tensorboard", first_step + 1);
//   board.add_scalars(step, {{"loss", 2.5}, {"lr", 3e-4}});
//   board.flush();            // after each step: the reader sees the events as they come
//
// Every failure (the directory is a file or cannot be created, the file cannot be created or
// written) throws UserError with one sentence naming the path and the OS error.
class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) when missing and, inside it, a new file named as
  // TensorFlow names them: `events.out.tfevents.<unix seconds, 10 digits>.<hostname>.<pid>.<n>`
  // (n counts this process's writers from 0; a name that exists already is never reused, so
  // a resumed run adds a file next to the earlier ones and overwrites none). Its first event
  // holds the file version.
  //
  // start_step: when set, a SessionLog START event at that step follows. TensorBoard then
  // drops what earlier files in `dir` hold at that step and later, in every tag. A run that
  // starts from step S (0, or a checkpoint's step when resumed) and logs S+1, S+2, ... passes
  // S + 1: the steps an interrupted run logged after its last checkpoint are replaced by the
  // resumed run's instead of being drawn twice.
  explicit TensorBoardWriter(const std::filesystem::path& dir,
                             std::optional<int64_t> start_step = std::nullopt);
  ~TensorBoardWriter();  // flush() and close; a failure there is ignored (call flush() first)
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  // Queues one Event with one value. REQUIRES: tag not empty.
  void add_scalar(std::string_view tag, int64_t step, double value,
                  double wall_time = unix_seconds_now());
  // Queues one Event holding all of `scalars` (nothing when empty). REQUIRES: no empty tag.
  void add_scalars(int64_t step, std::span<const TensorBoardScalar> scalars,
                   double wall_time = unix_seconds_now());
  void add_scalars(int64_t step, std::initializer_list<TensorBoardScalar> scalars,
                   double wall_time = unix_seconds_now()) {
    add_scalars(step, std::span<const TensorBoardScalar>(scalars.begin(), scalars.size()),
                wall_time);
  }

  // Hands the queued events to the OS (write(2); no fsync: TensorBoard reads the page cache).
  // Events are also written whenever 1 MiB is queued.
  void flush();

  const std::filesystem::path& path() const { return path_; }  // the event file

 private:
  void queue_event(const std::string& event);

  std::filesystem::path path_;
  int fd_ = -1;
  std::string queued_;  // TFRecords not yet written
};

// The scalars of one record of dstrain's JSONL log (src/train/rank_trainer.cpp) and the step
// they belong to. Tags:
//   - a record with "step": every other field; nested objects join their keys with "/"
//     ("time/compute_s", "tensor_parallel/comm_share/1"); array elements take their index
//     ("pipeline_bubble/0"), or "layer_<n>" / "stage_<n>" when the element is an object with
//     an integer "layer" / "stage" field, which is then left out
//     ("expert_load/layer_3/max", "stages/stage_0/compute_s_per_step");
//   - a record without "step" whose "type" is "summary": the same tags under "summary/" at the
//     record's "steps" ("summary/tokens_per_s", "summary/time_per_step/step_s");
//   - "config": nothing (settings, not measurements); no "type": nothing;
//   - any other type ("memory", "data"): the same tags under "<type>/" at `start_step`, the
//     step the run starts from ("memory/peak_bytes/activations", "data/entropy_floor").
// Numbers become values (integers as doubles), booleans 0 or 1; strings and nulls are left out.
// An empty result (scalars empty) means there is nothing to draw.
struct LogScalars {
  int64_t step = 0;
  std::vector<TensorBoardScalar> scalars;
};
LogScalars scalars_of_log_record(const nlohmann::json& record, int64_t start_step);

}  // namespace dstrain
