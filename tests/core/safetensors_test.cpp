#include "core/safetensors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/fs.h"

namespace dstrain {
namespace {

namespace fs = std::filesystem;

// A scratch directory for one test: a StagingDir that is never committed is removed whole.
fs::path scratch_root() { return fs::path(testing::TempDir()) / "dstrain_safetensors_test"; }
std::string test_name() { return testing::UnitTest::GetInstance()->current_test_info()->name(); }

std::vector<uint8_t> random_bytes(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(count);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// Random values stored in `dtype` (finite floats, so conversions can be compared).
std::vector<uint8_t> random_tensor(DType dtype, int64_t numel, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<uint8_t> bytes(static_cast<size_t>(numel) * dtype_size(dtype));
  for (int64_t i = 0; i < numel; ++i) {
    const float value = normal(rng);
    uint8_t* out = bytes.data() + i * dtype_size(dtype);
    if (dtype == DType::F32) std::memcpy(out, &value, 4);
    if (dtype == DType::F16) {
      const uint16_t bits = fp32_to_fp16_bits(value);
      std::memcpy(out, &bits, 2);
    }
    if (dtype == DType::BF16) {
      const uint16_t bits = fp32_to_bf16_bits(value);
      std::memcpy(out, &bits, 2);
    }
    if (dtype == DType::I32) {
      const int32_t integer = static_cast<int32_t>(rng());
      std::memcpy(out, &integer, 4);
    }
  }
  return bytes;
}

float expected_f32(DType dtype, const uint8_t* bytes) {
  uint16_t half;
  float value;
  switch (dtype) {
    case DType::F32: std::memcpy(&value, bytes, 4); return value;
    case DType::F16: std::memcpy(&half, bytes, 2); return fp16_bits_to_fp32(half);
    case DType::BF16: std::memcpy(&half, bytes, 2); return bf16_bits_to_fp32(half);
    default: ADD_FAILURE() << "not a float dtype"; return 0;
  }
}

struct Case {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
};

TEST(Safetensors, RoundTrip_all_dtypes_odd_shapes_scalar_empty_metadata) {
  StagingDir scratch(scratch_root() / test_name());
  const fs::path path = scratch.path() / "round_trip.safetensors";
  const std::vector<Case> cases = {
      {"h.0.attn.c_attn.weight", DType::F32, {5, 7, 11}},
      {"half_vector", DType::F16, {13}},
      {"bf16.odd", DType::BF16, {3, 1, 5, 2}},
      {"token_ids", DType::I32, {7}},
      {"scalar", DType::F32, {}},
      {"empty", DType::BF16, {0, 4}},
      {"rank5", DType::F16, {1, 2, 1, 3, 2}},  // more dims than a Tensor has
      {"f32_unaligned", DType::F32, {3, 3}},  // at byte 1682 of the data buffer
  };
  std::vector<std::vector<uint8_t>> data;
  SafetensorsWriter writer;
  for (size_t i = 0; i < cases.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : cases[i].shape) numel *= d;
    data.push_back(random_tensor(cases[i].dtype, numel, 100 + static_cast<uint32_t>(i)));
    writer.add(cases[i].name, cases[i].dtype, cases[i].shape, data.back().data());
  }
  writer.set_metadata("format", "pt");
  writer.set_metadata("step", "100");
  writer.set_metadata("unicode", "Grüße, λ");
  writer.write(path);
  EXPECT_EQ(fs::file_size(path), writer.file_size());

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.path(), path);
  ASSERT_EQ(file.names().size(), cases.size());
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{
                                 {"format", "pt"}, {"step", "100"}, {"unicode", "Grüße, λ"}}));
  double checksum = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    SCOPED_TRACE(c.name);
    EXPECT_EQ(file.names()[i], c.name);  // tensors in the order added
    ASSERT_TRUE(file.contains(c.name));
    const SafetensorsTensorInfo& info = file.info(c.name);
    EXPECT_EQ(info.dtype, c.dtype);
    EXPECT_EQ(info.shape, c.shape);
    EXPECT_EQ(info.nbytes, data[i].size());
    if (!data[i].empty()) {
      EXPECT_EQ(std::memcmp(file.data(c.name), data[i].data(), data[i].size()), 0);
    }
    if (c.shape.size() > static_cast<size_t>(kMaxDims)) {
      EXPECT_THROW(file.tensor(c.name), UserError);
    } else {
      const Tensor view = file.tensor(c.name);
      EXPECT_EQ(view.dtype, c.dtype);
      EXPECT_EQ(view.ndim, static_cast<int>(c.shape.size()));
      EXPECT_EQ(view.nbytes(), data[i].size());
      if (!data[i].empty()) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(view.data) % dtype_size(c.dtype), 0u);
      }
      if (!data[i].empty()) {
        EXPECT_EQ(std::memcmp(view.data, data[i].data(), data[i].size()), 0);
      }
    }
    if (c.dtype == DType::I32) {
      EXPECT_THROW(file.read_f32(c.name), UserError);
      continue;
    }
    const std::vector<float> values = file.read_f32(c.name);
    ASSERT_EQ(values.size(), static_cast<size_t>(info.numel()));
    for (size_t k = 0; k < values.size(); ++k) {
      const float expected = expected_f32(c.dtype, data[i].data() + k * dtype_size(c.dtype));
      ASSERT_EQ(values[k], expected) << "element " << k;
      checksum += std::fabs(values[k]);
    }
  }
  EXPECT_GT(checksum, 0.0);  // the test cannot pass on all-zero data
  EXPECT_FALSE(file.contains("missing"));
  // The view of an unaligned tensor is an aligned copy (checked in the loop above).
  EXPECT_NE(reinterpret_cast<uintptr_t>(file.data("f32_unaligned")) % 4, 0u);
  EXPECT_NE(file.tensor("f32_unaligned").data, file.data("f32_unaligned"));
}

TEST(Safetensors, HeaderFormat_length_prefix_padding_offsets) {
  const float values[3] = {1.0f, -2.0f, 0.5f};
  const uint16_t halves[1] = {0x3c00};
  SafetensorsWriter writer;
  writer.add("a", DType::F32, {3}, values);
  writer.add("b", DType::F16, {1, 1}, halves);
  writer.set_metadata("k", "v");
  const std::string header = writer.header_bytes();
  const std::string json =
      R"({"__metadata__":{"k":"v"},"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},)"
      R"("b":{"dtype":"F16","shape":[1,1],"data_offsets":[12,14]}})";
  const size_t padded = (json.size() + 7) / 8 * 8;
  ASSERT_EQ(header.size(), 8 + padded);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(header[i]);
  EXPECT_EQ(length, padded);
  EXPECT_EQ(header.substr(8, json.size()), json);
  EXPECT_EQ(header.substr(8 + json.size()), std::string(padded - json.size(), ' '));
  EXPECT_EQ(writer.file_size(), header.size() + 14);

  StagingDir scratch(scratch_root() / test_name());
  const fs::path path = scratch.path() / "format.safetensors";
  writer.write(path);
  const std::string bytes = read_file(path);
  EXPECT_EQ(bytes.substr(0, header.size()), header);
  EXPECT_EQ(std::memcmp(bytes.data() + header.size(), values, 12), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + header.size() + 12, halves, 2), 0);
  // Nothing but the file itself is left in the directory (the write is atomic).
  EXPECT_EQ(std::distance(fs::directory_iterator(scratch.path()), fs::directory_iterator()), 1);
}

TEST(Safetensors, Writer_owned_bytes_and_tensor_views) {
  float matrix[6] = {1, 2, 3, 4, 5, 6};
  SafetensorsWriter writer;
  writer.add("view", Tensor(matrix, DType::F32, {2, 3}));
  writer.add("owned", DType::I32, {2}, std::vector<uint8_t>{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff});
  EXPECT_EQ(writer.size(), 2u);
  EXPECT_THROW(writer.add("view", DType::F32, {1}, matrix), Error);         // duplicate
  EXPECT_THROW(writer.add("__metadata__", DType::F32, {1}, matrix), Error);  // reserved
  EXPECT_THROW(writer.add("short", DType::F32, {2}, std::vector<uint8_t>(7)), Error);

  StagingDir scratch(scratch_root() / test_name());
  const fs::path path = scratch.path() / "owned.safetensors";
  writer.write(path);
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.read_f32("view"), std::vector<float>({1, 2, 3, 4, 5, 6}));
  const Tensor ids = file.tensor("owned");
  EXPECT_EQ(ids.i32()[0], 1);
  EXPECT_EQ(ids.i32()[1], -1);
  EXPECT_TRUE(file.metadata().empty());
}

// A file from an independent writer (tests/reference/make_safetensors_fixture.py, Python):
// header keys sorted by name while the data is in another order, unaligned tensors, every
// dtype, and torch's own fp16/bf16 -> fp32 conversions to compare with.
TEST(Safetensors, Reads_file_of_independent_python_writer) {
  const fs::path path =
      fs::path(DSTRAIN_SOURCE_DIR) / "tests/reference/safetensors_small.safetensors";
  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.names(), (std::vector<std::string>{"f16_vector", "f32_matrix", "bf16_odd",
                                                    "i32_ids", "scalar", "empty",
                                                    "f16_vector_as_f32", "bf16_odd_as_f32"}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.header_size() % 8, 0u);

  EXPECT_EQ(file.info("f32_matrix").offset, 10u);  // unaligned in the file
  const Tensor matrix = file.tensor("f32_matrix");
  EXPECT_EQ(matrix.shape_str(), "(2, 3) F32");
  const std::vector<float> expected = {-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 1.0f / 3.0f};
  for (int i = 0; i < 6; ++i) EXPECT_EQ(matrix.f32()[i], expected[i]);
  EXPECT_EQ(file.read_f32("f32_matrix"), expected);

  EXPECT_EQ(file.read_f32("f16_vector"), file.read_f32("f16_vector_as_f32"));
  EXPECT_EQ(file.read_f32("f16_vector")[3], 65504.0f);
  EXPECT_EQ(file.info("bf16_odd").shape, (std::vector<int64_t>{3, 1, 2}));
  EXPECT_EQ(file.read_f32("bf16_odd"), file.read_f32("bf16_odd_as_f32"));

  const Tensor ids = file.tensor("i32_ids");
  EXPECT_EQ(ids.i32()[0], 0);
  EXPECT_EQ(ids.i32()[1], -1);
  EXPECT_EQ(ids.i32()[2], 2147483647);
  EXPECT_EQ(ids.i32()[3], 96);

  const Tensor scalar = file.tensor("scalar");
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_EQ(scalar.f32()[0], 4.5f);
  EXPECT_EQ(file.info("empty").shape, (std::vector<int64_t>{0, 3}));
  EXPECT_EQ(file.tensor("empty").numel(), 0);
}

// The committed GPT-2 fixture (tests/reference/gpt2_tiny, written by plain Python) parses with
// the Hugging Face names and shapes.
TEST(Safetensors, Reads_gpt2_reference_fixture) {
  const fs::path dir = fs::path(DSTRAIN_SOURCE_DIR) / "tests/reference/gpt2_tiny";
  for (const char* name : {"model.safetensors", "grads0.safetensors", "final.safetensors"}) {
    SCOPED_TRACE(name);
    const SafetensorsFile file = SafetensorsFile::open(dir / name);
    ASSERT_EQ(file.names().size(), 2u + 12u * 2u + 2u);
    EXPECT_EQ(file.names().front(), "wte.weight");
    EXPECT_EQ(file.names().back(), "ln_f.bias");
    EXPECT_EQ(file.info("wte.weight").shape, (std::vector<int64_t>{97, 32}));
    EXPECT_EQ(file.info("h.1.attn.c_attn.weight").shape, (std::vector<int64_t>{32, 96}));
    EXPECT_EQ(file.info("h.1.mlp.c_proj.weight").shape, (std::vector<int64_t>{128, 32}));
    for (const std::string& tensor : file.names()) {
      EXPECT_EQ(file.info(tensor).dtype, DType::F32);
      double norm = 0;
      for (float v : file.read_f32(tensor)) {
        ASSERT_TRUE(std::isfinite(v)) << tensor;
        norm += double(v) * v;
      }
      EXPECT_GT(norm, 0.0) << tensor;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Lies: every malformed file is a UserError whose one sentence names the file and the problem.

std::string with_length_prefix(const std::string& header, uint64_t length) {
  std::string bytes(8, '\0');
  std::memcpy(bytes.data(), &length, 8);
  return bytes + header;
}

struct Lie {
  std::string name;
  std::string file_bytes;
  std::string expected_words;  // a part of the message that says what is wrong
};

// A file with `header` as JSON and `data_size` random data bytes.
Lie lie(std::string name, const std::string& header, size_t data_size, std::string words) {
  const std::vector<uint8_t> data = random_bytes(data_size, 7);
  return {std::move(name),
          with_length_prefix(header, header.size()) + std::string(data.begin(), data.end()),
          std::move(words)};
}

std::vector<Lie> lies() {
  const std::string good = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  return {
      {"empty_file", "", "0 bytes long"},
      {"truncated_length", std::string(5, '\0'), "5 bytes long"},
      {"huge_header_length", with_length_prefix(good, 200'000'000) + std::string(8, 'x'),
       "more than the limit"},
      {"header_length_past_end", with_length_prefix(good, good.size() + 100), "past the end"},
      {"truncated_data", with_length_prefix(good, good.size()) + std::string(5, 'x'),
       "past the end of the 5-byte data buffer"},
      lie("bad_json", R"({"a":{"dtype":"F32",)", 0, "not valid JSON"),
      lie("trailing_garbage", good + "xyz", 8, "not valid JSON"),
      lie("empty_header", "", 0, "not valid JSON"),
      lie("not_an_object", "[1, 2, 3]", 0, "not an object"),
      lie("entry_not_object", R"({"a": 5})", 0, "not an object"),
      lie("missing_dtype", R"({"a":{"shape":[2],"data_offsets":[0,8]}})", 8, "has no dtype"),
      lie("missing_shape", R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", 8, "has no shape"),
      lie("missing_offsets", R"({"a":{"dtype":"F32","shape":[2]}})", 8, "has no data_offsets"),
      lie("dtype_not_string", R"({"a":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", 8,
          "not a string"),
      lie("unknown_dtype", R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8,
          "dtype 'F64'"),
      lie("flag_spelling_dtype", R"({"a":{"dtype":"fp32","shape":[2],"data_offsets":[0,8]}})", 8,
          "dtype 'fp32'"),
      lie("shape_not_list", R"({"a":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", 8,
          "not a list"),
      lie("negative_dim", R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8,
          "non-negative integers"),
      lie("fractional_dim", R"({"a":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", 8,
          "non-negative integers"),
      lie("overflowing_shape",
          R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8,
          "too large"),
      lie("one_offset", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8]}})", 8,
          "not two non-negative integers"),
      lie("negative_offset", R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[-4,-4]}})", 0,
          "not two non-negative integers"),
      lie("begin_after_end", R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,0]}})", 8,
          "begin is after its end"),
      lie("shape_offset_mismatch", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})",
          8, "needs 12 bytes"),
      lie("offsets_past_end", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8,
          "past the end"),
      lie("overlapping",
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
          12, "overlaps tensor 'a'"),
      lie("same_bytes_twice",
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
          R"("b":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}})",
          8, "overlaps"),
      lie("hole_between_tensors",
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
          R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
          12, "bytes [4, 8) of the data buffer belong to no tensor"),
      lie("trailing_data", good, 12, "last 4 of its 12 data bytes belong to no tensor"),
      lie("duplicate_name",
          R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
          R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          8, "the key 'a' twice"),
      lie("duplicate_field", R"({"a":{"dtype":"F32","dtype":"F16","shape":[2],)"
                             R"("data_offsets":[0,8]}})",
          8, "the key 'dtype' twice"),
      lie("metadata_not_object", R"({"__metadata__":[1],"a":{"dtype":"F32","shape":[2],)"
                                 R"("data_offsets":[0,8]}})",
          8, "__metadata__ is not an object"),
      lie("metadata_value_not_string", R"({"__metadata__":{"step":100},"a":{"dtype":"F32",)"
                                       R"("shape":[2],"data_offsets":[0,8]}})",
          8, "entry 'step' is not a string"),
  };
}

class SafetensorsLie : public testing::TestWithParam<Lie> {};

TEST_P(SafetensorsLie, Is_a_user_error_naming_the_file) {
  const Lie& lie = GetParam();
  StagingDir scratch(scratch_root() / ("lie_" + lie.name));
  const fs::path path = scratch.path() / (lie.name + ".safetensors");
  write_file_atomic(path, lie.file_bytes);
  try {
    SafetensorsFile::open(path);
    FAIL() << "a file with " << lie.name << " was accepted";
  } catch (const UserError& error) {
    const std::string message = error.what();
    EXPECT_NE(message.find("'" + path.string() + "'"), std::string::npos) << message;
    EXPECT_NE(message.find(lie.expected_words), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;  // one sentence, one line
  } catch (const std::exception& error) {
    FAIL() << "not a UserError: " << error.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Safetensors, SafetensorsLie, testing::ValuesIn(lies()),
                         [](const testing::TestParamInfo<Lie>& info) { return info.param.name; });

TEST(Safetensors, Valid_edge_cases_are_accepted) {
  StagingDir scratch(scratch_root() / test_name());
  // No tensors at all, null metadata, and an unpadded header with unknown extra fields.
  const std::vector<std::pair<std::string, std::string>> headers = {
      {"no_tensors", "{}"},
      {"null_metadata", R"({"__metadata__":null})"},
      {"extra_field", R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"note":"x"}})"},
      {"zero_size_between",
       R"({"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
       R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})"},
  };
  for (const auto& [name, header] : headers) {
    SCOPED_TRACE(name);
    const fs::path path = scratch.path() / (name + ".safetensors");
    const size_t data_size = header.find("data_offsets") == std::string::npos ? 0 : 4;
    write_file_atomic(path, with_length_prefix(header, header.size()) +
                                std::string(data_size, 'x'));
    const SafetensorsFile file = SafetensorsFile::open(path);
    EXPECT_TRUE(file.metadata().empty());
    if (name == "zero_size_between") {
      EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "z"}));
    }
  }
}

TEST(Safetensors, Missing_file_and_tensor_and_wrong_count_are_user_errors) {
  StagingDir scratch(scratch_root() / test_name());
  const fs::path missing = scratch.path() / "missing.safetensors";
  try {
    SafetensorsFile::open(missing);
    FAIL() << "opened a missing file";
  } catch (const UserError& error) {
    EXPECT_NE(std::string(error.what()).find(missing.string()), std::string::npos);
  }

  const float values[2] = {1, 2};
  SafetensorsWriter writer;
  writer.add("a", DType::F32, {2}, values);
  const fs::path path = scratch.path() / "one.safetensors";
  writer.write(path);
  SafetensorsFile file = SafetensorsFile::open(path);
  for (auto access : std::vector<std::function<void()>>{
           [&] { file.info("b"); }, [&] { file.data("b"); }, [&] { file.tensor("b"); },
           [&] { file.read_f32("b"); }}) {
    try {
      access();
      FAIL() << "found a tensor that is not there";
    } catch (const UserError& error) {
      const std::string message = error.what();
      EXPECT_NE(message.find(path.string()), std::string::npos) << message;
      EXPECT_NE(message.find("no tensor named 'b'"), std::string::npos) << message;
    }
  }
  float out[3];
  EXPECT_THROW(file.read_f32("a", out, 3), UserError);
  file.read_f32("a", out, 2);
  EXPECT_EQ(out[1], 2.0f);

  // Moving keeps the mapping and the views valid.
  const Tensor view = file.tensor("a");
  SafetensorsFile moved = std::move(file);
  EXPECT_EQ(moved.tensor("a").data, view.data);
  EXPECT_EQ(view.f32()[0], 1.0f);
}

}  // namespace
}  // namespace dstrain
