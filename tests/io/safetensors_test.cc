// Tests for io/safetensors: bit-exact round trips for every dtype, the byte layout from the
// spec, files from another writer, sharded checkpoints, and one exact message per malformed
// case.
#include "io/safetensors.h"
#include "tests/io/test_files.h"

#include <ATen/ops/empty.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "io/file_util.h"

namespace gdr::io {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string u64_le(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// A safetensors file assembled by hand: length prefix, header text as given, data.
std::string safetensors_bytes(const std::string& header, const std::string& data) {
  return u64_le(header.size()) + header + data;
}

std::string bytes_of(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  return std::string(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
}

// Deterministic pseudo-random bytes (an LCG), so floats include NaN and denormal patterns
// and the comparison has to be bit-exact. Bools are kept to 0/1, the only valid values.
at::Tensor patterned(at::ScalarType dtype, std::vector<int64_t> shape, uint32_t seed) {
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dtype));
  auto* p = static_cast<uint8_t*>(t.data_ptr());
  const size_t n = t.numel() * t.element_size();
  uint32_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = static_cast<uint8_t>(x >> 24);
    if (dtype == at::kBool) p[i] &= 1;
  }
  return t;
}

at::Tensor floats(std::vector<float> values) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, at::kFloat);
  std::memcpy(t.data_ptr(), values.data(), values.size() * sizeof(float));
  return t;
}

void expect_same_tensor(const at::Tensor& actual, const at::Tensor& expected,
                        const std::string& name) {
  EXPECT_EQ(actual.scalar_type(), expected.scalar_type()) << name;
  EXPECT_EQ(actual.sizes().vec(), expected.sizes().vec()) << name;
  EXPECT_TRUE(actual.is_contiguous()) << name;
  EXPECT_EQ(bytes_of(actual), bytes_of(expected)) << name;
}

std::vector<std::string> names_of(const NamedTensors& tensors) {
  std::vector<std::string> names;
  for (const auto& named : tensors) names.push_back(named.first);
  return names;
}

// ------------------------------------------------------------------------- round trips

class SafetensorsDtypeTest : public testing::TestWithParam<at::ScalarType> {};

TEST_P(SafetensorsDtypeTest, RoundTripIsBitExactForMatricesScalarsAndEmptyTensors) {
  const at::ScalarType dtype = GetParam();
  const std::string path = test_dir() + "/t.safetensors";
  NamedTensors tensors = {
      {"matrix", patterned(dtype, {3, 5}, 1)},
      {"scalar", patterned(dtype, {}, 2)},
      {"empty", patterned(dtype, {0, 4}, 3)},
      {"cube", patterned(dtype, {2, 3, 7}, 4)},
  };
  ASSERT_TRUE(write_safetensors(path, tensors).ok());
  auto read = read_safetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_THAT(names_of(read->tensors), ElementsAre("matrix", "scalar", "empty", "cube"));
  for (size_t i = 0; i < tensors.size(); ++i) {
    expect_same_tensor(read->tensors[i].second, tensors[i].second, tensors[i].first);
  }
  EXPECT_TRUE(read->metadata.empty());
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, SafetensorsDtypeTest,
                         testing::Values(at::kDouble, at::kFloat, at::kHalf, at::kBFloat16,
                                         at::kLong, at::kInt, at::kShort, at::kChar, at::kByte,
                                         at::kBool),
                         [](const testing::TestParamInfo<at::ScalarType>& info) {
                           return *safetensors_dtype_name(info.param);
                         });

TEST(Safetensors, WrittenBytesFollowTheSpecExactly) {
  // Independent check written from the format description, not from our writer.
  const std::string path = test_dir() + "/spec.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"a", floats({1.0f, 2.0f})}}).ok());
  std::string header = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  header.append((8 - header.size() % 8) % 8, ' ');
  const std::string data("\x00\x00\x80\x3f\x00\x00\x00\x40", 8);  // 1.0f, 2.0f little-endian
  EXPECT_EQ(read_bytes(path), safetensors_bytes(header, data));
  EXPECT_EQ((8 + header.size()) % 8, 0u);
}

TEST(Safetensors, MetadataRoundTripsAndIsWrittenFirst) {
  const std::string path = test_dir() + "/m.safetensors";
  const SafetensorsMetadata metadata = {
      {"format", "pt"}, {"step", "120"}, {"note", "a \"quoted\" é"}};
  ASSERT_TRUE(write_safetensors(path, {{"w", floats({3.0f})}}, metadata).ok());
  auto read = read_safetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->metadata, metadata);
  EXPECT_EQ(read_bytes(path).substr(8, 17), R"({"__metadata__":{)");
}

TEST(Safetensors, WriterKeepsOrderAndCopiesNonContiguousTensors) {
  const std::string path = test_dir() + "/nc.safetensors";
  at::Tensor base = patterned(at::kFloat, {4, 6}, 9);
  at::Tensor transposed = base.transpose(0, 1);
  ASSERT_FALSE(transposed.is_contiguous());
  ASSERT_TRUE(write_safetensors(path, {{"z", base}, {"a", transposed}}).ok());
  auto read = read_safetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_THAT(names_of(read->tensors), ElementsAre("z", "a"));
  expect_same_tensor(*read->find("a"), transposed, "a");
  EXPECT_EQ(read->find("missing"), nullptr);
}

TEST(Safetensors, ReadsAFileFromAnotherWriter) {
  // Shaped like the Python safetensors library's output: __metadata__ first, keys in an
  // order unrelated to the data layout, no padding, spaces inside the JSON.
  const std::string dir = test_dir();
  const std::string header =
      R"({"__metadata__": {"format": "pt"}, )"
      R"("b.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]}, )"
      R"("a.bias": {"shape": [2], "data_offsets": [0, 8], "dtype": "I32"}, )"
      R"("c.flag": {"dtype": "BOOL", "shape": [], "data_offsets": [16, 17]}})";
  std::string data;
  data += std::string("\x07\x00\x00\x00\xfe\xff\xff\xff", 8);  // int32 7, -2
  data += std::string("\x80\x3f\x00\x40\x40\x40\x80\xbf", 8);  // bf16 1, 2, 3, -1
  data += std::string("\x01", 1);
  write_bytes(dir + "/other.safetensors", safetensors_bytes(header, data));

  auto read = read_safetensors(dir + "/other.safetensors");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(names_of(read->tensors), ElementsAre("a.bias", "b.weight", "c.flag"));
  EXPECT_EQ(read->metadata, (SafetensorsMetadata{{"format", "pt"}}));
  const at::Tensor& bias = *read->find("a.bias");
  EXPECT_EQ(bias.scalar_type(), at::kInt);
  EXPECT_EQ(bias.data_ptr<int32_t>()[0], 7);
  EXPECT_EQ(bias.data_ptr<int32_t>()[1], -2);
  const at::Tensor& weight = *read->find("b.weight");
  EXPECT_EQ(weight.scalar_type(), at::kBFloat16);
  EXPECT_EQ(weight.sizes().vec(), (std::vector<int64_t>{2, 2}));
  const at::BFloat16* w = weight.data_ptr<at::BFloat16>();
  EXPECT_EQ(static_cast<float>(w[0]), 1.0f);
  EXPECT_EQ(static_cast<float>(w[1]), 2.0f);
  EXPECT_EQ(static_cast<float>(w[2]), 3.0f);
  EXPECT_EQ(static_cast<float>(w[3]), -1.0f);
  const at::Tensor& flag = *read->find("c.flag");
  EXPECT_EQ(flag.dim(), 0);
  EXPECT_TRUE(flag.data_ptr<bool>()[0]);
}

TEST(Safetensors, HeaderOnlyReadReportsSpecsAndOffsets) {
  const std::string path = test_dir() + "/h.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"x", patterned(at::kHalf, {3, 2}, 5)},
                                       {"y", patterned(at::kLong, {4}, 6)}})
                  .ok());
  auto header = read_safetensors_header(path);
  ASSERT_TRUE(header.ok()) << header.status();
  ASSERT_EQ(header->entries.size(), 2u);
  EXPECT_EQ(header->entries[0].name, "x");
  EXPECT_EQ(header->entries[0].spec, (TensorSpec{at::kHalf, {3, 2}}));
  EXPECT_EQ(header->entries[0].data_begin, 0u);
  EXPECT_EQ(header->entries[0].data_end, 12u);
  EXPECT_EQ(header->entries[1].data_begin, 12u);
  EXPECT_EQ(header->entries[1].data_end, 44u);
  EXPECT_EQ(header->data_start % 8, 0u);
}

TEST(Safetensors, OverwritesAtomicallyAndLeavesNoTemporaryFiles) {
  const std::string dir = test_dir();
  const std::string path = dir + "/w.safetensors";
  ASSERT_TRUE(write_safetensors(path, {{"v", floats({1.0f})}}).ok());
  ASSERT_TRUE(write_safetensors(path, {{"v", floats({2.0f, 3.0f})}}).ok());
  auto read = read_safetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  expect_same_tensor(read->tensors[0].second, floats({2.0f, 3.0f}), "v");
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    ++files;
    EXPECT_EQ(entry.path().filename(), "w.safetensors");
  }
  EXPECT_EQ(files, 1);
}

TEST(Safetensors, EmptyCheckpointRoundTrips) {
  const std::string path = test_dir() + "/e.safetensors";
  ASSERT_TRUE(write_safetensors(path, {}).ok());
  EXPECT_EQ(read_bytes(path), safetensors_bytes("{}      ", ""));
  auto read = read_safetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(read->tensors.empty());
}

// --------------------------------------------------------------------- writer input errors

TEST(Safetensors, WriterRejectsBadInputNamingTheTensor) {
  const std::string path = test_dir() + "/bad.safetensors";
  const at::Tensor t = floats({1.0f});
  EXPECT_EQ(write_safetensors(path, {{"a", t}, {"b", t}, {"a", t}}).message(),
            path + ": duplicate tensor name 'a' (entries #0 and #2)");
  EXPECT_EQ(write_safetensors(path, {{"a", t}, {"", t}}).message(),
            path + ": tensor #1 has an empty name");
  EXPECT_EQ(write_safetensors(path, {{"__metadata__", t}}).message(),
            path + ": tensor #0 uses the reserved name \"__metadata__\"");
  EXPECT_EQ(write_safetensors(path, {{"u", at::Tensor()}}).message(),
            path + ": tensor 'u' is undefined");
  EXPECT_EQ(write_safetensors(path, {{"c", at::empty({2}, at::kComplexFloat)}}).message(),
            path +
                ": tensor 'c' has dtype ComplexFloat, which is not stored (supported: F64, "
                "F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)");
  EXPECT_EQ(write_safetensors(path, {{"a", t}, {"a", t}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(std::filesystem::exists(path));
}

// ------------------------------------------------------------------------ malformed files

struct MalformedCase {
  const char* name;
  std::string bytes;
  std::string message;  // after "<path>: "
};

std::string one_f32(const std::string& entry_json, const std::string& data) {
  return safetensors_bytes(R"({"a":)" + entry_json + "}", data);
}

std::vector<MalformedCase> malformed_cases() {
  const std::string four(4, '\0');
  const std::string eight(8, '\0');
  const std::string twelve(12, '\0');
  return {
      {"FileShorterThanLengthPrefix", std::string(5, '\0'),
       "file is 5 bytes, too short for the 8-byte header length"},
      {"HeaderLengthAboveLimit", u64_le(200'000'000) + "{}",
       "header length 200000000 exceeds the limit of 100000000 bytes"},
      {"HeaderLengthPastEndOfFile", u64_le(100) + std::string(12, ' '),
       "header length 100 runs past the end of the file (20 bytes, so at most 12)"},
      {"HeaderNotJson", safetensors_bytes(R"({"a": [1, 2})", ""),
       "header is not valid JSON (parse error at byte 12 of the header)"},
      {"EmptyHeader", safetensors_bytes("", ""),
       "header is not valid JSON (parse error at byte 1 of the header)"},
      {"HeaderNotObject", safetensors_bytes("[1, 2]", ""),
       "header is not a JSON object (got array)"},
      {"DuplicateTensorName",
       safetensors_bytes(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                         R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                         "xy"),
       "duplicate tensor name 'a'"},
      {"DuplicateKeyInsideEntry",
       one_f32(R"({"dtype":"U8","dtype":"F32","shape":[1],"data_offsets":[0,1]})", "x"),
       "duplicate key 'dtype' in header"},
      {"MetadataValueNotString", safetensors_bytes(R"({"__metadata__":{"k":1}})", ""),
       "\"__metadata__\" value for key 'k' must be a string, got number"},
      {"MetadataNotObject", safetensors_bytes(R"({"__metadata__":"x"})", ""),
       "\"__metadata__\" must be an object, got string"},
      {"EntryNotObject", one_f32("3", ""), "tensor 'a': entry must be an object, got number"},
      {"MissingDtype", one_f32(R"({"shape":[1],"data_offsets":[0,4]})", four),
       "tensor 'a': \"dtype\" is missing or not a string"},
      {"UnknownDtype", one_f32(R"({"dtype":"F8_E4M3","shape":[1],"data_offsets":[0,1]})", "x"),
       "tensor 'a': unknown dtype 'F8_E4M3' (supported: F64, F32, F16, BF16, I64, I32, I16, "
       "I8, U8, BOOL)"},
      {"MissingShape", one_f32(R"({"dtype":"F32","data_offsets":[0,4]})", four),
       "tensor 'a': \"shape\" is missing or not an array"},
      {"NegativeDimension", one_f32(R"({"dtype":"F32","shape":[2,-1],"data_offsets":[0,0]})", ""),
       "tensor 'a': shape [2, -1] has a negative dimension"},
      {"NonIntegerDimension", one_f32(R"({"dtype":"F32","shape":[2.5],"data_offsets":[0,0]})", ""),
       "tensor 'a': shape [2.5] has a non-integer dimension"},
      {"ShapeOverflows",
       one_f32(R"({"dtype":"F32","shape":[4294967296,4294967296,4],"data_offsets":[0,0]})", ""),
       "tensor 'a': shape [4294967296, 4294967296, 4] overflows 64 bits"},
      {"OffsetsNotAPair", one_f32(R"({"dtype":"F32","shape":[1],"data_offsets":[0]})", four),
       "tensor 'a': \"data_offsets\" must be [begin, end] with non-negative integers, got [0]"},
      {"NegativeOffset", one_f32(R"({"dtype":"F32","shape":[1],"data_offsets":[-4,0]})", four),
       "tensor 'a': \"data_offsets\" must be [begin, end] with non-negative integers, got "
       "[-4,0]"},
      {"OffsetsEndBeforeBegin",
       one_f32(R"({"dtype":"F32","shape":[1],"data_offsets":[8,4]})", eight),
       "tensor 'a': data_offsets [8, 4] end before they begin"},
      {"SizeMismatch",
       one_f32(R"({"dtype":"F32","shape":[2,3],"data_offsets":[0,20]})", std::string(20, '\0')),
       "tensor 'a': data_offsets [0, 20] hold 20 bytes but F32 [2, 3] needs 24"},
      {"OffsetsOutOfRange", one_f32(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", four),
       "tensor 'a': data_offsets [0, 8] run past the end of the 4-byte data buffer"},
      {"OverlappingOffsets",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                         R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                         twelve),
       "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]"},
      {"GapBetweenTensors",
       safetensors_bytes(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                         R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                         twelve),
       "bytes [4, 8) of the data buffer belong to no tensor"},
      {"GapAtStart", one_f32(R"({"dtype":"F32","shape":[1],"data_offsets":[4,8]})", eight),
       "bytes [0, 4) of the data buffer belong to no tensor"},
      {"TrailingBytes", one_f32(R"({"dtype":"F32","shape":[1],"data_offsets":[0,4]})", eight),
       "bytes [4, 8) of the data buffer belong to no tensor"},
  };
}

class SafetensorsMalformedTest : public testing::TestWithParam<MalformedCase> {};

TEST_P(SafetensorsMalformedTest, IsRejectedWithAMessageNamingFileAndProblem) {
  const std::string path = test_dir() + "/bad.safetensors";
  write_bytes(path, GetParam().bytes);
  auto read = read_safetensors(path);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(read.status().message(), path + ": " + GetParam().message);
  // The header-only reader applies the same checks.
  EXPECT_EQ(read_safetensors_header(path).status(), read.status());
}

INSTANTIATE_TEST_SUITE_P(Cases, SafetensorsMalformedTest, testing::ValuesIn(malformed_cases()),
                         [](const testing::TestParamInfo<MalformedCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(Safetensors, MissingFileIsNotFound) {
  const std::string path = test_dir() + "/absent.safetensors";
  auto read = read_safetensors(path);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(read.status().message(), path + ": open failed: No such file or directory");
}

// ------------------------------------------------------------------------------ sharding

NamedTensors five_tensors() {
  return {
      {"a", patterned(at::kFloat, {4}, 11)},      // 16 bytes
      {"b", patterned(at::kFloat, {8}, 12)},      // 32
      {"c", patterned(at::kBFloat16, {10}, 13)},  // 20
      {"d", patterned(at::kLong, {1}, 14)},       // 8
      {"e", patterned(at::kByte, {5, 8}, 15)},    // 40
  };
}

TEST(SafetensorsSharded, RoundTripsThroughSeveralShardsAndAnHfStyleIndex) {
  const std::string dir = test_dir() + "/ckpt";  // created by the writer
  const NamedTensors tensors = five_tensors();
  ASSERT_TRUE(write_safetensors_sharded(dir, tensors, 40, {{"format", "pt"}}).ok());

  // Greedy packing at 40 bytes: [a] [b] [c d] [e].
  const nlohmann::json index =
      nlohmann::json::parse(read_bytes(dir + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"], (nlohmann::json{{"format", "pt"}, {"total_size", 116}}));
  EXPECT_EQ(index["weight_map"], (nlohmann::json{{"a", "model-00001-of-00004.safetensors"},
                                                 {"b", "model-00002-of-00004.safetensors"},
                                                 {"c", "model-00003-of-00004.safetensors"},
                                                 {"d", "model-00003-of-00004.safetensors"},
                                                 {"e", "model-00004-of-00004.safetensors"}}));
  auto shard3 = read_safetensors(dir + "/model-00003-of-00004.safetensors");
  ASSERT_TRUE(shard3.ok()) << shard3.status();
  EXPECT_THAT(names_of(shard3->tensors), ElementsAre("c", "d"));
  EXPECT_EQ(shard3->metadata, (SafetensorsMetadata{{"format", "pt"}}));

  for (const std::string& where : {dir, dir + "/model.safetensors.index.json"}) {
    auto read = read_safetensors_sharded(where);
    ASSERT_TRUE(read.ok()) << read.status();
    ASSERT_THAT(names_of(read->tensors), ElementsAre("a", "b", "c", "d", "e"));
    for (size_t i = 0; i < tensors.size(); ++i) {
      expect_same_tensor(read->tensors[i].second, tensors[i].second, tensors[i].first);
    }
    EXPECT_EQ(read->metadata, (SafetensorsMetadata{{"format", "pt"}, {"total_size", "116"}}));
  }
}

TEST(SafetensorsSharded, OversizedTensorGetsAShardOfItsOwnAndOneShardStillHasAnIndex) {
  const std::string dir = test_dir();
  ASSERT_TRUE(write_safetensors_sharded(dir + "/big", five_tensors(), 1).ok());
  EXPECT_TRUE(std::filesystem::exists(dir + "/big/model-00005-of-00005.safetensors"));
  ASSERT_TRUE(write_safetensors_sharded(dir + "/one", five_tensors(), 1 << 20).ok());
  EXPECT_TRUE(std::filesystem::exists(dir + "/one/model-00001-of-00001.safetensors"));
  auto read = read_safetensors_sharded(dir + "/one");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->tensors.size(), 5u);
}

TEST(SafetensorsSharded, DirectoryWithASingleModelFileIsReadUnsharded) {
  const std::string dir = test_dir();
  ASSERT_TRUE(write_safetensors(dir + "/model.safetensors", {{"w", floats({5.0f})}}).ok());
  for (const std::string& where : {dir, dir + "/model.safetensors"}) {
    auto read = read_safetensors_sharded(where);
    ASSERT_TRUE(read.ok()) << read.status();
    EXPECT_THAT(names_of(read->tensors), ElementsAre("w"));
  }
}

TEST(SafetensorsSharded, EmptyDirectoryIsNotFound) {
  const std::string dir = test_dir();
  EXPECT_EQ(read_safetensors_sharded(dir).status().message(),
            dir + ": neither model.safetensors.index.json nor model.safetensors found");
}

TEST(SafetensorsSharded, RejectsNonPositiveShardSize) {
  const std::string dir = test_dir();
  EXPECT_EQ(write_safetensors_sharded(dir, five_tensors(), 0).message(),
            dir + ": max_shard_bytes must be positive, got 0");
}

class SafetensorsBadIndexTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = test_dir();
    index_ = dir_ + "/model.safetensors.index.json";
    ASSERT_TRUE(write_safetensors(dir_ + "/s1.safetensors", {{"a", floats({1.0f})}}).ok());
    ASSERT_TRUE(
        write_safetensors(dir_ + "/s2.safetensors", {{"b", floats({2.0f})}, {"c", floats({3.0f})}})
            .ok());
  }
  std::string read_with_index(const std::string& text) {
    write_bytes(index_, text);
    return std::string(read_safetensors_sharded(dir_).status().message());
  }
  std::string dir_;
  std::string index_;
};

TEST_F(SafetensorsBadIndexTest, AcceptsTheConsistentIndex) {
  write_bytes(index_, R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors",
                                         "c": "s2.safetensors"}})");
  auto read = read_safetensors_sharded(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(names_of(read->tensors), ElementsAre("a", "b", "c"));
  EXPECT_TRUE(read->metadata.empty());
}

TEST_F(SafetensorsBadIndexTest, MissingShardFile) {
  write_bytes(index_, R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors",
                                         "c": "s2.safetensors", "d": "s3.safetensors"}})");
  auto read = read_safetensors_sharded(dir_);
  EXPECT_EQ(read.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(read.status().message(),
            index_ + ": shard 's3.safetensors' (for tensor 'd') does not exist");
}

TEST_F(SafetensorsBadIndexTest, TensorNotInItsShard) {
  EXPECT_EQ(read_with_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors",
                                                "c": "s2.safetensors", "x": "s1.safetensors"}})"),
            index_ + ": tensor 'x' is mapped to shard 's1.safetensors', which does not hold it");
}

TEST_F(SafetensorsBadIndexTest, TensorInAnotherShardThanTheIndexSays) {
  EXPECT_EQ(read_with_index(R"({"weight_map": {"a": "s2.safetensors", "b": "s2.safetensors",
                                                "c": "s2.safetensors"}})"),
            index_ + ": tensor 'a' is mapped to shard 's2.safetensors', which does not hold it");
  EXPECT_EQ(read_with_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s1.safetensors",
                                                "c": "s2.safetensors"}})"),
            index_ + ": tensor 'b' is mapped to shard 's1.safetensors', which does not hold it");
}

TEST_F(SafetensorsBadIndexTest, ShardHoldsATensorTheIndexDoesNotList) {
  EXPECT_EQ(read_with_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})"),
            index_ + ": shard 's2.safetensors' holds tensor 'c', which the index does not list");
}

TEST_F(SafetensorsBadIndexTest, MalformedIndexFiles) {
  EXPECT_EQ(read_with_index("{"), index_ + ": index is not valid JSON");
  EXPECT_EQ(read_with_index("[]"), index_ + ": index is not a JSON object");
  EXPECT_EQ(read_with_index(R"({"metadata": {}})"),
            index_ + ": \"weight_map\" is missing or not an object");
  EXPECT_EQ(read_with_index(R"({"metadata": 3, "weight_map": {}})"),
            index_ + ": \"metadata\" is not an object");
  EXPECT_EQ(read_with_index(R"({"weight_map": {"a": 1}})"),
            index_ + ": weight_map entry for tensor 'a' is not a string");
  EXPECT_EQ(read_with_index(R"({"weight_map": {"a": "../s1.safetensors"}})"),
            index_ + ": shard '../s1.safetensors' for tensor 'a' is not a plain file name");
}

TEST_F(SafetensorsBadIndexTest, MalformedShardIsReportedByItsOwnPath) {
  write_bytes(dir_ + "/s2.safetensors", std::string(3, '\0'));
  EXPECT_EQ(read_with_index(R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})"),
            dir_ + "/s2.safetensors: file is 3 bytes, too short for the 8-byte header length");
}

// ----------------------------------------------------------------- comparing tensor sets

TEST(TensorSetDiff, ReportsMissingUnexpectedAndMismatchedSorted) {
  const std::map<std::string, TensorSpec> expected = {
      {"embed", {at::kBFloat16, {10, 4}}},
      {"norm", {at::kFloat, {4}}},
      {"head", {at::kBFloat16, {4, 10}}},
      {"layer.0", {at::kBFloat16, {4, 4}}},
  };
  const std::map<std::string, TensorSpec> actual = {
      {"embed", {at::kBFloat16, {10, 4}}},
      {"norm", {at::kBFloat16, {4}}},
      {"head", {at::kBFloat16, {4, 11}}},
      {"extra", {at::kFloat, {}}},
  };
  const TensorSetDiff diff = diff_tensor_specs(actual, expected);
  EXPECT_FALSE(diff.ok());
  EXPECT_THAT(diff.missing, ElementsAre("layer.0"));
  EXPECT_THAT(diff.unexpected, ElementsAre("extra"));
  EXPECT_THAT(diff.mismatched, ElementsAre("head: expected BF16 [4, 10], got BF16 [4, 11]",
                                           "norm: expected F32 [4], got BF16 [4]"));
  EXPECT_EQ(check_tensor_specs(actual, expected, "ckpt/model.safetensors").message(),
            "ckpt/model.safetensors: tensors do not match the expected set:\n"
            "missing (1):\n  layer.0\n"
            "unexpected (1):\n  extra\n"
            "mismatched (2):\n"
            "  head: expected BF16 [4, 10], got BF16 [4, 11]\n"
            "  norm: expected F32 [4], got BF16 [4]\n");
  EXPECT_TRUE(check_tensor_specs(expected, expected, "x").ok());
}

TEST(TensorSetDiff, ShortensLongLists) {
  TensorSetDiff diff;
  diff.missing = {"a", "b", "c"};
  EXPECT_EQ(diff.to_string(2), "missing (3):\n  a\n  b\n  ... and 1 more\n");
}

TEST(TensorSetDiff, SpecsOfLoadedTensorsMatchWhatWasWritten) {
  const std::string path = test_dir() + "/s.safetensors";
  const NamedTensors tensors = five_tensors();
  ASSERT_TRUE(write_safetensors(path, tensors).ok());
  auto read = read_safetensors(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_TRUE(diff_tensor_specs(specs_of(read->tensors), specs_of(tensors)).ok());
  EXPECT_EQ(spec_of(tensors[2].second), (TensorSpec{at::kBFloat16, {10}}));
  EXPECT_EQ(describe_spec({at::kComplexFloat, {2}}), "ComplexFloat [2]");
}

TEST(SafetensorsDtypeNames, MapBothWays) {
  EXPECT_EQ(*safetensors_dtype_name(at::kBFloat16), "BF16");
  EXPECT_EQ(*scalar_type_from_safetensors_dtype("BOOL"), at::kBool);
  EXPECT_EQ(scalar_type_from_safetensors_dtype("F8_E5M2").status().message(),
            "unknown safetensors dtype 'F8_E5M2' (supported: F64, F32, F16, BF16, I64, I32, "
            "I16, I8, U8, BOOL)");
  EXPECT_EQ(safetensors_dtype_name(at::kComplexDouble).status().message(),
            "dtype ComplexDouble has no safetensors name here (supported: F64, F32, F16, BF16, "
            "I64, I32, I16, I8, U8, BOOL)");
}

}  // namespace
}  // namespace gdr::io
