// GGUF reader: round trips through the writer, and every kind of malformed file is rejected
// with a clear message (never a crash; this suite also runs under ASan+UBSan).
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstring>
#include <random>

#include "common/random_model.h"
#include "common/test_util.h"
#include "gguf/gguf.h"
#include "gguf/gguf_writer.h"
#include "model/model.h"

namespace d2o {
namespace {

std::vector<uint8_t> bytes_of(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t k = 0; k < n; ++k) v[k] = static_cast<uint8_t>(seed + k * 7);
  return v;
}

GgufWriter small_model() {
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_u32("llama.block_count", 2);
  w.add_f32("llama.rope.freq_base", 10000.0f);
  w.add_bool("tokenizer.ggml.add_bos_token", true);
  w.add_string_array("tokenizer.ggml.tokens", {"<s>", "a", "b"});
  w.add_i32_array("tokenizer.ggml.token_type", {3, 1, 1});
  w.add_f32_array("tokenizer.ggml.scores", {0.0f, -1.0f, -2.0f});
  w.add_tensor("a.weight", GgmlType::kF32, {4, 2}, bytes_of(32, 1));
  w.add_tensor("b.weight", GgmlType::kQ4_0, {64}, bytes_of(36, 2));
  w.add_tensor("c.weight", GgmlType::kF16, {3}, bytes_of(6, 3));
  return w;
}

Result<std::unique_ptr<GgufFile>> parse(const std::vector<uint8_t>& b) {
  return GgufFile::from_memory(b.data(), b.size(), "test.gguf");
}

// Expects a parse failure whose message contains `needle`.
void expect_error(const std::vector<uint8_t>& b, const std::string& needle) {
  auto r = parse(b);
  ASSERT_FALSE(r.ok()) << "expected an error containing '" << needle << "'";
  EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().to_string();
}

TEST(Gguf, RoundTripsMetadataAndTensors) {
  const auto b = small_model().to_bytes();
  auto r = parse(b);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  const GgufFile& f = **r;
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(*f.get_string("general.architecture"), "llama");
  EXPECT_EQ(*f.get_int("llama.block_count"), 2);
  EXPECT_FLOAT_EQ(static_cast<float>(*f.get_float("llama.rope.freq_base")), 10000.0f);
  EXPECT_TRUE(*f.get_bool("tokenizer.ggml.add_bos_token"));
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens")->at(2), "b");
  EXPECT_EQ(f.get_int_array("tokenizer.ggml.token_type")->at(0), 3);
  EXPECT_FLOAT_EQ(f.get_float_array("tokenizer.ggml.scores")->at(2), -2.0f);
  ASSERT_EQ(f.tensors().size(), 3u);
  const GgufTensorInfo* t = f.find_tensor("b.weight");
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->type, GgmlType::kQ4_0);
  EXPECT_EQ(t->n_bytes, 18u * 2);
  EXPECT_EQ(std::memcmp(f.tensor_data(*t), bytes_of(36, 2).data(), 36), 0);
  EXPECT_EQ(f.tensor_data(*t) - b.data(), static_cast<ptrdiff_t>(f.data_offset() + t->offset));
  EXPECT_EQ(f.data_offset() % 32, 0u);
}

TEST(Gguf, ReadTensorCopiesFromMemoryAndFromTheFile) {
  const auto b = small_model().to_bytes();
  auto mem = parse(b);
  ASSERT_TRUE(mem.ok()) << mem.status().to_string();
  const std::string path = test::scratch_path("read_tensor.gguf");
  ASSERT_TRUE(small_model().write(path).ok());
  auto file = GgufFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  for (const GgufFile* f : {mem->get(), file->get()}) {
    const GgufTensorInfo* t = f->find_tensor("b.weight");
    ASSERT_NE(t, nullptr);
    std::vector<uint8_t> got(t->n_bytes, 0xEE);
    ASSERT_TRUE(f->read_tensor(*t, got.data()).ok());
    EXPECT_EQ(got, bytes_of(36, 2));
  }
}

// A slice of a tensor's bytes, from memory and from the file; a slice outside the tensor is an
// error, nothing is read.
TEST(Gguf, ReadTensorBytesReadsASliceAndRefusesOneOutside) {
  const auto b = small_model().to_bytes();
  auto mem = parse(b);
  ASSERT_TRUE(mem.ok()) << mem.status().to_string();
  const std::string path = test::scratch_path("read_tensor_bytes.gguf");
  ASSERT_TRUE(small_model().write(path).ok());
  auto file = GgufFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  for (const GgufFile* f : {mem->get(), file->get()}) {
    const GgufTensorInfo* t = f->find_tensor("b.weight");
    ASSERT_NE(t, nullptr);
    const std::vector<uint8_t> all = bytes_of(36, 2);
    ASSERT_EQ(all.size(), t->n_bytes);
    std::vector<uint8_t> got(5, 0xEE);
    ASSERT_TRUE(f->read_tensor_bytes(*t, 3, 5, got.data()).ok());
    EXPECT_EQ(got, std::vector<uint8_t>(all.begin() + 3, all.begin() + 8));
    for (const auto& [offset, n] :
         {std::pair<uint64_t, uint64_t>{t->n_bytes - 2, 3}, {t->n_bytes + 1, 0},
          {1, ~uint64_t{0}}}) {
      std::fill(got.begin(), got.end(), 0xEE);
      const Status s = f->read_tensor_bytes(*t, offset, n, got.data());
      EXPECT_FALSE(s.ok());
      EXPECT_NE(s.message().find("outside tensor 'b.weight'"), std::string::npos) << s.message();
      EXPECT_EQ(got, std::vector<uint8_t>(5, 0xEE));
    }
  }
}

// A file truncated by another process while it is open (e.g. overwritten during a load) must give
// an error, not a SIGBUS from touching mapped pages past the new end of the file.
TEST(Gguf, FileTruncatedAfterOpeningIsAnErrorNotACrash) {
  const std::string path = test::scratch_path("truncated.gguf");
  ASSERT_TRUE(small_model().write(path).ok());
  auto file = GgufFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  const GgufTensorInfo* t = (*file)->find_tensor("c.weight");
  ASSERT_NE(t, nullptr);
  ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>((*file)->data_offset())), 0);
  std::vector<uint8_t> got(t->n_bytes);
  const Status s = (*file)->read_tensor(*t, got.data());
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), StatusCode::kIoError);
  EXPECT_NE(s.message().find("changed while it was being read"), std::string::npos)
      << s.to_string();
}

TEST(Gguf, ModelFileTruncatedDuringLoadIsAnErrorNotACrash) {
  test::RandomModelConfig cfg;
  cfg.n_layer = 2;
  cfg.n_embd = 64;
  cfg.n_head = 4;
  cfg.n_head_kv = 2;
  cfg.n_vocab = 300;
  const std::string path = test::scratch_path("truncated_model.gguf");
  ASSERT_TRUE(test::make_random_model(cfg).write(path).ok());
  auto file = GgufFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status().to_string();
  // Keep the metadata and half of the tensor data.
  const off_t keep = static_cast<off_t>((*file)->data_offset() +
                                        ((*file)->file_size() - (*file)->data_offset()) / 2);
  ASSERT_EQ(::truncate(path.c_str(), keep), 0);
  auto model = Model::load(**file);
  ASSERT_FALSE(model.ok());
  EXPECT_EQ(model.status().code(), StatusCode::kIoError);
  EXPECT_NE(model.status().message().find("changed while it was being read"), std::string::npos)
      << model.status().to_string();
}

TEST(Gguf, TypedGettersReportMissingAndMistypedKeys) {
  const auto b = small_model().to_bytes();
  auto r = parse(b);
  ASSERT_TRUE(r.ok());
  auto missing = (*r)->get_int("llama.nothing");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  auto wrong = (*r)->get_int("general.architecture");
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.status().code(), StatusCode::kFormatError);
  EXPECT_EQ(*(*r)->get_int_or("llama.nothing", 7), 7);
}

TEST(Gguf, OpensFromDiskAndReportsMissingFiles) {
  const std::string path = ::d2o::test::scratch_path("d2o_gguf_ok.gguf");
  ASSERT_TRUE(small_model().write(path).ok());
  auto r = GgufFile::open(path);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ((*r)->tensors().size(), 3u);
  auto none = GgufFile::open(path + ".missing");
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kIoError);
  auto dir = GgufFile::open(::d2o::test::scratch_dir());
  ASSERT_FALSE(dir.ok());
}

TEST(Gguf, EveryTruncationIsRejected) {
  const auto b = small_model().to_bytes();
  for (size_t n = 0; n < b.size(); ++n) {
    std::vector<uint8_t> cut(b.begin(), b.begin() + static_cast<ptrdiff_t>(n));
    auto r = parse(cut);
    // A prefix may only parse if nothing that matters was cut (never the case here: the last
    // tensor's data runs to the end of the file).
    EXPECT_FALSE(r.ok()) << "prefix of " << n << " bytes parsed";
  }
}

TEST(Gguf, TruncatedTensorDataSaysSo) {
  auto b = small_model().to_bytes();
  b.resize(b.size() - 3);
  expect_error(b, "past the end of the file");
}

TEST(Gguf, BadMagic) {
  auto b = small_model().to_bytes();
  b[0] = 'X';
  expect_error(b, "bad magic");
  expect_error({}, "not a GGUF file");
}

TEST(Gguf, UnsupportedVersions) {
  for (uint32_t v : {1u, 4u, 0x03000000u}) {
    GgufWriter w = small_model();
    w.set_version(v);
    auto r = parse(w.to_bytes());
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), StatusCode::kUnsupported) << r.status().to_string();
    EXPECT_NE(r.status().message().find("version"), std::string::npos);
  }
  GgufWriter w2 = small_model();
  w2.set_version(2);
  EXPECT_TRUE(parse(w2.to_bytes()).ok());
}

TEST(Gguf, AbsurdDimensions) {
  for (int64_t bad : {int64_t{0}, int64_t{-5}, int64_t{1} << 50}) {
    GgufWriter w;
    w.add_tensor("t", GgmlType::kF32, {4, bad}, bytes_of(16, 0));
    expect_error(w.to_bytes(), "dimension");
  }
  GgufWriter w;
  w.add_tensor("t", GgmlType::kF32, {1, 1, 1, 1, 1}, bytes_of(4, 0));
  expect_error(w.to_bytes(), "dimensions");
  // Element count overflow: each dimension allowed, the product not.
  GgufWriter o;
  o.add_tensor("t", GgmlType::kF32, {int64_t{1} << 40, int64_t{1} << 40}, bytes_of(4, 0));
  expect_error(o.to_bytes(), "overflow");
}

TEST(Gguf, AbsurdCounts) {
  auto b = small_model().to_bytes();
  auto patch64 = [&](size_t at, uint64_t v) {
    std::vector<uint8_t> c = b;
    std::memcpy(c.data() + at, &v, 8);
    return c;
  };
  expect_error(patch64(8, uint64_t{1} << 40), "tensor count");
  expect_error(patch64(16, uint64_t{1} << 40), "metadata count");
  // A plausible count that the file cannot hold is a truncation, not a crash or a huge allocation.
  EXPECT_FALSE(parse(patch64(16, 100000)).ok());
  // The first key's length field, made huge.
  expect_error(patch64(24, uint64_t{1} << 60), "implausibly large");
  // A string array claiming more elements than bytes remain.
  GgufWriter w;
  w.add_string_array("k", {"a"});
  auto s = w.to_bytes();
  // header(24) + key len(8) + "k"(1) + type(4) + elem type(4) = 41: the array count.
  uint64_t huge = uint64_t{1} << 27;
  std::memcpy(s.data() + 41, &huge, 8);
  expect_error(s, "does not fit");
}

TEST(Gguf, OverlappingTensors) {
  GgufWriter w;
  w.add_tensor("a", GgmlType::kF32, {16}, bytes_of(64, 0), 0);
  w.add_tensor("b", GgmlType::kF32, {16}, bytes_of(64, 0), 32);
  expect_error(w.to_bytes(), "overlap");
}

TEST(Gguf, UnknownTensorType) {
  GgufWriter w;
  w.add_tensor_raw("t", 99, {32}, bytes_of(64, 0));
  auto r = parse(w.to_bytes());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnsupported);
  EXPECT_NE(r.status().message().find("unknown tensor type 99"), std::string::npos);
}

TEST(Gguf, MisalignedOffsetsDuplicatesAndBadBlocks) {
  GgufWriter w;
  w.add_tensor("a", GgmlType::kF32, {4}, bytes_of(16, 0), 4);
  expect_error(w.to_bytes(), "alignment");
  GgufWriter d;
  d.add_tensor("a", GgmlType::kF32, {4}, bytes_of(16, 0));
  d.add_tensor("a", GgmlType::kF32, {4}, bytes_of(16, 0));
  expect_error(d.to_bytes(), "duplicate tensor");
  GgufWriter k;
  k.add_u32("x", 1);
  k.add_u32("x", 2);
  expect_error(k.to_bytes(), "duplicate metadata key");
  GgufWriter q;
  q.add_tensor("q", GgmlType::kQ4_0, {48}, bytes_of(36, 0));
  expect_error(q.to_bytes(), "block size");
  GgufWriter a;
  a.set_alignment(24);
  expect_error(a.to_bytes(), "power of two");
}

TEST(Gguf, InvalidValueTypes) {
  auto b = small_model().to_bytes();
  // header(24) + key len(8) + "general.architecture"(20) = 52: the first value type.
  uint32_t bad = 77;
  std::memcpy(b.data() + 52, &bad, 4);
  expect_error(b, "invalid value type");
}

// Random byte corruption: parsing must fail cleanly or succeed, never crash or hang.
TEST(Gguf, SurvivesRandomCorruption) {
  const auto good = small_model().to_bytes();
  std::mt19937 rng(42);
  int rejected = 0;
  for (int it = 0; it < 3000; ++it) {
    auto b = good;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int f = 0; f < flips; ++f) b[rng() % b.size()] = static_cast<uint8_t>(rng());
    auto r = parse(b);
    if (!r.ok()) {
      ++rejected;
      EXPECT_FALSE(r.status().message().empty());
    } else {
      for (const auto& t : (*r)->tensors()) {
        EXPECT_LE((*r)->data_offset() + t.offset + t.n_bytes, b.size());
      }
    }
  }
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace d2o
