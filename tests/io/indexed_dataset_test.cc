// Tests for io/indexed_dataset: round trips for every token dtype, the exact .idx bytes
// from Megatron's layout, one exact message per bad or truncated file, and byte-level text
// conversion (including the embedded corpus).
#include "io/indexed_dataset.h"
#include "tests/io/test_files.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <sstream>

namespace gdr::io {
namespace {

using ::testing::ElementsAre;
using ::testing::ElementsAreArray;

template <typename T>
std::string le(T value) {
  std::string out(sizeof(T), '\0');
  std::memcpy(out.data(), &value, sizeof(T));  // the test host is little-endian, like the format
  return out;
}

// An .idx file assembled field by field from Megatron's _IndexWriter, independently of
// our builder. The counts default to the array sizes.
struct IdxFields {
  std::string magic = std::string("MMIDIDX\0\0", 9);
  uint64_t version = 1;
  uint8_t code = 8;
  std::vector<int32_t> lengths;
  std::vector<int64_t> pointers;
  std::vector<int64_t> documents;
  std::optional<uint64_t> sequence_count;
  std::optional<uint64_t> document_count;
  std::string trailing;
};

IdxFields fields(uint8_t code, std::vector<int32_t> lengths, std::vector<int64_t> pointers,
                 std::vector<int64_t> documents, std::string trailing = "") {
  IdxFields f;
  f.code = code;
  f.lengths = std::move(lengths);
  f.pointers = std::move(pointers);
  f.documents = std::move(documents);
  f.trailing = std::move(trailing);
  return f;
}

std::string idx_bytes(const IdxFields& f) {
  std::string out = f.magic + le(f.version) + le(f.code) +
                    le<uint64_t>(f.sequence_count.value_or(f.lengths.size())) +
                    le<uint64_t>(f.document_count.value_or(f.documents.size()));
  for (int32_t v : f.lengths) out += le(v);
  for (int64_t v : f.pointers) out += le(v);
  for (int64_t v : f.documents) out += le(v);
  return out + f.trailing;
}

std::string u16s(std::vector<uint16_t> values) {
  std::string out;
  for (uint16_t v : values) out += le(v);
  return out;
}

// ---------------------------------------------------------------------------- round trips

struct DtypeCase {
  TokenDType dtype;
  int64_t min;
  int64_t max;
};

class IndexedDatasetDtypeTest : public testing::TestWithParam<DtypeCase> {};

TEST_P(IndexedDatasetDtypeTest, RoundTripsDocumentsSequencesAndExtremeTokens) {
  const DtypeCase c = GetParam();
  const std::string prefix = test_dir() + "/ds";
  const std::vector<std::vector<int64_t>> sequences = {
      {c.min, 0, c.max, 1}, {2, 3}, {}, {c.max, c.min}, {5}};
  auto builder = IndexedDatasetBuilder::create(prefix, c.dtype);
  ASSERT_TRUE(builder.ok()) << builder.status();
  ASSERT_TRUE(builder->add_item(sequences[0]).ok());
  ASSERT_TRUE(builder->add_item(sequences[1]).ok());
  builder->end_document();  // document 0: sequences 0, 1
  ASSERT_TRUE(builder->add_item(sequences[2]).ok());
  builder->end_document();  // document 1: the empty sequence 2
  builder->end_document();  // document 2: no sequences at all
  ASSERT_TRUE(builder->add_item(sequences[3]).ok());
  ASSERT_TRUE(builder->add_item(sequences[4]).ok());
  EXPECT_FALSE(std::filesystem::exists(prefix + ".bin"));
  EXPECT_FALSE(std::filesystem::exists(prefix + ".idx"));
  ASSERT_TRUE(builder->finalize().ok());  // closes document 3: sequences 3, 4

  auto ds = IndexedDataset::open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->dtype(), c.dtype);
  EXPECT_EQ(ds->num_sequences(), 5);
  EXPECT_EQ(ds->num_documents(), 4);
  EXPECT_EQ(ds->num_tokens(), 9);
  EXPECT_THAT(ds->document_indices(), ElementsAre(0, 2, 3, 3, 5));
  EXPECT_THAT(ds->sequence_lengths(), ElementsAre(4, 2, 0, 2, 1));
  const int64_t item = token_dtype_size(c.dtype);
  EXPECT_THAT(ds->sequence_pointers(), ElementsAre(0, 4 * item, 6 * item, 6 * item, 8 * item));
  for (int64_t i = 0; i < 5; ++i) {
    auto tokens = ds->sequence(i);
    ASSERT_TRUE(tokens.ok()) << tokens.status();
    EXPECT_THAT(*tokens, ElementsAreArray(sequences[i])) << "sequence " << i;
  }
  EXPECT_THAT(*ds->get(0, 1, 2), ElementsAre(0, c.max));
  EXPECT_THAT(*ds->get(0, 3), ElementsAre(1));
  EXPECT_THAT(*ds->get(0, 4), ElementsAre());
  EXPECT_EQ(std::filesystem::file_size(prefix + ".bin"), static_cast<uintmax_t>(9 * item));
}

INSTANTIATE_TEST_SUITE_P(AllTokenDtypes, IndexedDatasetDtypeTest,
                         testing::Values(DtypeCase{TokenDType::kUInt8, 0, 255},
                                         DtypeCase{TokenDType::kInt8, -128, 127},
                                         DtypeCase{TokenDType::kInt16, -32768, 32767},
                                         DtypeCase{TokenDType::kInt32, INT32_MIN, INT32_MAX},
                                         DtypeCase{TokenDType::kInt64, INT64_MIN, INT64_MAX},
                                         DtypeCase{TokenDType::kUInt16, 0, 65535}),
                         [](const testing::TestParamInfo<DtypeCase>& info) {
                           return std::string(token_dtype_name(info.param.dtype));
                         });

TEST(IndexedDataset, BuilderWritesMegatronsExactBytes) {
  const std::string prefix = test_dir() + "/ds";
  auto builder = IndexedDatasetBuilder::create(prefix, TokenDType::kUInt16);
  ASSERT_TRUE(builder.ok());
  ASSERT_TRUE(builder->add_item(std::vector<int64_t>{1, 2, 3}).ok());
  builder->end_document();
  ASSERT_TRUE(builder->add_item(std::vector<int64_t>{7}).ok());
  builder->end_document();
  ASSERT_TRUE(builder->finalize().ok());
  EXPECT_EQ(read_bytes(prefix + ".idx"), idx_bytes(fields(8, {3, 1}, {0, 6}, {0, 1, 2})));
  EXPECT_EQ(read_bytes(prefix + ".bin"), u16s({1, 2, 3, 7}));
}

TEST(IndexedDataset, ReadsAHandBuiltMultimodalIndexIgnoringSequenceModes) {
  const std::string prefix = test_dir() + "/mm";
  write_bytes(prefix + ".idx", idx_bytes(fields(8, {3, 2, 1}, {0, 6, 10}, {0, 2, 3},
                                                std::string("\x00\x01\x00", 3))));
  write_bytes(prefix + ".bin", u16s({1, 2, 3, 4, 5, 65535}));
  auto ds = IndexedDataset::open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_THAT(*ds->sequence(2), ElementsAre(65535));
  EXPECT_THAT(*ds->sequence(1), ElementsAre(4, 5));
}

TEST(IndexedDataset, OutOfRangeReadsAreErrors) {
  const std::string prefix = test_dir() + "/ds";
  write_bytes(prefix + ".idx", idx_bytes(fields(1, {2}, {0}, {0, 1})));
  write_bytes(prefix + ".bin", "ab");
  auto ds = IndexedDataset::open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_EQ(ds->get(1).status().message(), prefix + ": sequence index 1 out of range [0, 1)");
  EXPECT_EQ(ds->get(-1).status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_EQ(ds->get(0, 1, 2).status().message(),
            prefix + ": tokens [1, 3) out of range for sequence 0 of length 2");
  EXPECT_EQ(ds->get(0, 3).status().message(),
            prefix + ": tokens [3, 2) out of range for sequence 0 of length 2");
}

// ------------------------------------------------------------------------ bad files

// A valid uint16 dataset (sequences [1 2 3] [4 5] [65535], documents {0, 1}, {2}) that each
// case below breaks in one way.
IdxFields good_fields() { return fields(8, {3, 2, 1}, {0, 6, 10}, {0, 2, 3}); }
const std::string kGoodBin = u16s({1, 2, 3, 4, 5, 65535});

struct BadCase {
  const char* name;
  std::string idx;
  std::string bin;
  std::string message;  // "{idx}" and "{bin}" stand for the file paths
};

IdxFields with(std::function<void(IdxFields&)> change) {
  IdxFields f = good_fields();
  change(f);
  return f;
}

std::vector<BadCase> bad_cases() {
  const std::string good = idx_bytes(good_fields());
  return {
      {"IndexShorterThanHeader", good.substr(0, 20), kGoodBin,
       "{idx}: index is 20 bytes, shorter than its 34-byte header"},
      {"BadMagic", idx_bytes(with([](IdxFields& f) { f.magic = std::string("MMIDIDY\0\0", 9); })),
       kGoodBin, "{idx}: bad magic: expected \"MMIDIDX\\x00\\x00\", got \"MMIDIDY\\x00\\x00\""},
      {"UnsupportedVersion", idx_bytes(with([](IdxFields& f) { f.version = 2; })), kGoodBin,
       "{idx}: unsupported version 2 (expected 1)"},
      {"UnknownDtypeCode", idx_bytes(with([](IdxFields& f) { f.code = 9; })), kGoodBin,
       "{idx}: unknown dtype code 9 (expected 1..8)"},
      {"ZeroDtypeCode", idx_bytes(with([](IdxFields& f) { f.code = 0; })), kGoodBin,
       "{idx}: unknown dtype code 0 (expected 1..8)"},
      {"FloatDtypeCode", idx_bytes(with([](IdxFields& f) { f.code = 7; })), kGoodBin,
       "{idx}: dtype code 7 (float32) is not a token dtype"},
      {"TruncatedArrays", good.substr(0, good.size() - 5), kGoodBin,
       "{idx}: index is 89 bytes but its counts (3 sequences, 3 document indices) need 94"},
      {"SequenceCountTooLarge", idx_bytes(with([](IdxFields& f) { f.sequence_count = 5; })),
       kGoodBin,
       "{idx}: index is 94 bytes but its counts (5 sequences, 3 document indices) need 118"},
      {"CountsOverflow",
       idx_bytes(with([](IdxFields& f) { f.sequence_count = uint64_t{1} << 62; })), kGoodBin,
       "{idx}: index is 94 bytes but its counts (4611686018427387904 sequences, 3 document "
       "indices) need more than 2^64"},
      {"TrailingBytes", idx_bytes(with([](IdxFields& f) { f.trailing = "xy"; })), kGoodBin,
       "{idx}: index has 2 bytes after the document indices; its counts (3 sequences, 3 "
       "document indices) allow 0 or 3"},
      {"NoDocumentIndices", idx_bytes(with([](IdxFields& f) { f.documents = {}; })), kGoodBin,
       "{idx}: no document indices (expected at least the leading 0)"},
      {"DocumentIndicesNotStartingAtZero", idx_bytes(with([](IdxFields& f) {
         f.documents = {1, 2, 3};
       })),
       kGoodBin, "{idx}: document indices must start at 0, got 1"},
      {"DocumentIndicesNotMonotonic", idx_bytes(with([](IdxFields& f) {
         f.documents = {0, 2, 1, 3};
       })),
       kGoodBin, "{idx}: document indices are not monotonic: index 2 is 1 after 2"},
      {"LastDocumentIndexNotSequenceCount", idx_bytes(with([](IdxFields& f) {
         f.documents = {0, 2};
       })),
       kGoodBin, "{idx}: last document index is 2, expected the sequence count 3"},
      {"NegativeLength", idx_bytes(with([](IdxFields& f) {
         f.lengths = {3, -1, 1};
       })),
       kGoodBin, "{idx}: sequence 1 has negative length -1"},
      {"NegativePointer", idx_bytes(with([](IdxFields& f) {
         f.pointers = {0, -6, 10};
       })),
       kGoodBin, "{idx}: sequence 1 has negative pointer -6"},
      {"PointerPastEndOfBin", idx_bytes(with([](IdxFields& f) {
         f.pointers = {0, 6, 12};
       })),
       kGoodBin,
       "{idx}: sequence 2 (1 uint16 tokens at byte 12) ends at byte 14, past the end of {bin} "
       "(12 bytes)"},
      {"TruncatedBin", good, kGoodBin.substr(0, 11),
       "{idx}: sequence 2 (1 uint16 tokens at byte 10) ends at byte 12, past the end of {bin} "
       "(11 bytes)"},
  };
}

std::string fill_paths(std::string message, const std::string& prefix) {
  for (const auto& [key, value] : {std::pair<std::string, std::string>{"{idx}", prefix + ".idx"},
                                   {"{bin}", prefix + ".bin"}}) {
    for (size_t at = message.find(key); at != std::string::npos; at = message.find(key)) {
      message.replace(at, key.size(), value);
    }
  }
  return message;
}

class IndexedDatasetBadFileTest : public testing::TestWithParam<BadCase> {};

TEST_P(IndexedDatasetBadFileTest, IsRejectedWithAMessageNamingFileAndProblem) {
  const std::string prefix = test_dir() + "/ds";
  write_bytes(prefix + ".idx", GetParam().idx);
  write_bytes(prefix + ".bin", GetParam().bin);
  auto ds = IndexedDataset::open(prefix);
  ASSERT_FALSE(ds.ok());
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_EQ(ds.status().message(), fill_paths(GetParam().message, prefix));
}

INSTANTIATE_TEST_SUITE_P(Cases, IndexedDatasetBadFileTest, testing::ValuesIn(bad_cases()),
                         [](const testing::TestParamInfo<BadCase>& info) {
                           return std::string(info.param.name);
                         });

TEST(IndexedDataset, GoodFilesOfTheBadCasesOpen) {
  const std::string prefix = test_dir() + "/ds";
  write_bytes(prefix + ".idx", idx_bytes(good_fields()));
  write_bytes(prefix + ".bin", kGoodBin);
  EXPECT_TRUE(IndexedDataset::open(prefix).ok());
}

TEST(IndexedDataset, MissingFilesAreNotFound) {
  const std::string prefix = test_dir() + "/ds";
  auto ds = IndexedDataset::open(prefix);
  EXPECT_EQ(ds.status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(ds.status().message(), prefix + ".idx: open failed: No such file or directory");
  write_bytes(prefix + ".idx", idx_bytes(good_fields()));
  EXPECT_EQ(IndexedDataset::open(prefix).status().message(),
            prefix + ".bin: open failed: No such file or directory");
}

// ------------------------------------------------------------------------ builder errors

TEST(IndexedDatasetBuilder, RejectsTokensThatDoNotFitAndFloatDtypes) {
  const std::string prefix = test_dir() + "/ds";
  EXPECT_EQ(IndexedDatasetBuilder::create(prefix, TokenDType::kFloat32).status().message(),
            prefix + ": dtype code 7 is not a token dtype");
  auto builder = IndexedDatasetBuilder::create(prefix, TokenDType::kUInt8);
  ASSERT_TRUE(builder.ok());
  ASSERT_TRUE(builder->add_item(std::vector<int64_t>{1}).ok());
  EXPECT_EQ(builder->add_item(std::vector<int64_t>{1, 256}).message(),
            prefix + ": token 256 at position 1 of sequence 1 does not fit uint8 [0, 255]");
  EXPECT_EQ(builder->add_item(std::vector<int64_t>{-1}).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(builder->num_sequences(), 1);  // the rejected sequences were not appended
  ASSERT_TRUE(builder->finalize().ok());
  EXPECT_EQ(builder->add_item(std::vector<int64_t>{1}).message(),
            prefix + ": add_item after finalize");
  EXPECT_EQ(builder->finalize().message(), prefix + ": finalized twice");
  auto ds = IndexedDataset::open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_THAT(ds->document_indices(), ElementsAre(0, 1));
}

TEST(IndexedDatasetBuilder, AbandonedBuilderLeavesNoFiles) {
  const std::string dir = test_dir();
  {
    auto builder = IndexedDatasetBuilder::create(dir + "/ds", TokenDType::kInt32);
    ASSERT_TRUE(builder.ok());
    ASSERT_TRUE(builder->add_item(std::vector<int64_t>{1, 2}).ok());
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

// ---------------------------------------------------------------------- text conversion

std::string decode_text(const std::vector<int64_t>& tokens) {
  std::string out;
  for (int64_t t : tokens) out.push_back(static_cast<char>(t));
  return out;
}

TEST(BuildIndexedDatasetFromText, OneDocumentPerParagraphOneTokenPerByte) {
  const std::string dir = test_dir();
  write_bytes(dir + "/t.txt",
              "\nFirst line one\n  line two\n\n\n \t \nSecond \xc3\xa9\r\n\r\nThird, no newline");
  for (TokenDType dtype : {TokenDType::kUInt8, TokenDType::kUInt16}) {
    const std::string prefix = dir + "/" + token_dtype_name(dtype);
    auto stats = build_indexed_dataset_from_text(dir + "/t.txt", prefix, dtype);
    ASSERT_TRUE(stats.ok()) << stats.status();
    EXPECT_EQ(stats->num_documents, 3);
    auto ds = IndexedDataset::open(prefix);
    ASSERT_TRUE(ds.ok()) << ds.status();
    EXPECT_EQ(ds->dtype(), dtype);
    EXPECT_THAT(ds->document_indices(), ElementsAre(0, 1, 2, 3));
    EXPECT_EQ(decode_text(*ds->sequence(0)), "First line one\n  line two\n");
    EXPECT_EQ(decode_text(*ds->sequence(1)), "Second \xc3\xa9\r\n");
    EXPECT_EQ(decode_text(*ds->sequence(2)), "Third, no newline\n");
    EXPECT_THAT(*ds->get(1, 7, 2), ElementsAre(0xc3, 0xa9));  // bytes, not chars: unsigned
    EXPECT_EQ(stats->num_tokens, ds->num_tokens());
    EXPECT_EQ(ds->num_tokens(), 26 + 11 + 18);
  }
}

TEST(BuildIndexedDatasetFromText, RejectsWideDtypesAndMissingText) {
  const std::string dir = test_dir();
  EXPECT_EQ(build_indexed_dataset_from_text(dir + "/t.txt", dir + "/ds", TokenDType::kInt32)
                .status()
                .message(),
            dir + "/ds: byte-level tokens need dtype uint8 or uint16, got int32");
  EXPECT_EQ(build_indexed_dataset_from_text(dir + "/t.txt", dir + "/ds").status().message(),
            dir + "/t.txt: open failed: No such file or directory");
}

TEST(BuildIndexedDatasetFromText, ConvertsTheEmbeddedCorpus) {
  // data/corpus.txt, a data dependency of this test, relative to the runfiles root.
  const std::string corpus = "data/corpus.txt";
  ASSERT_TRUE(std::filesystem::exists(corpus));
  const std::string prefix = test_dir() + "/corpus";
  auto stats = build_indexed_dataset_from_text(corpus, prefix);
  ASSERT_TRUE(stats.ok()) << stats.status();
  auto ds = IndexedDataset::open(prefix);
  ASSERT_TRUE(ds.ok()) << ds.status();
  EXPECT_GT(ds->num_documents(), 200);
  EXPECT_EQ(ds->num_documents(), ds->num_sequences());
  EXPECT_GT(ds->num_tokens(), 50'000);
  EXPECT_LE(ds->num_tokens(), static_cast<int64_t>(std::filesystem::file_size(corpus)));
  EXPECT_EQ(decode_text(*ds->sequence(0)),
            "History of LZMA Utils and XZ Utils\n==================================\n");
}

}  // namespace
}  // namespace gdr::io
