// AlignedBuffer's memory: 64-byte alignment on both sides of kMappedBytes (malloc below, its own
// mapping from there up), contents that survive until the next resize, and the allocation
// counter of the steady-state tests seeing both kinds.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>

#include "common/alloc_counter.h"
#include "core/mem.h"

namespace d2o {
namespace {

bool aligned64(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 64 == 0;
}

TEST(AlignedBlock, AlignedAndWritableOnBothSidesOfTheMappedSize) {
  for (size_t bytes :
       {size_t{64}, kMappedBytes - 64, kMappedBytes, kMappedBytes + 64, size_t{3} << 20}) {
    void* p = aligned_block_alloc(bytes);
    ASSERT_NE(p, nullptr) << bytes;
    EXPECT_TRUE(aligned64(p)) << bytes;
    std::memset(p, 0x5a, bytes);
    EXPECT_EQ(static_cast<unsigned char*>(p)[bytes - 1], 0x5a);
    aligned_block_free(p, bytes);
  }
}

TEST(AlignedBlock, BufferKeepsItsContentsAcrossMovesAndResizesAcrossTheMappedSize) {
  const size_t small = kMappedBytes / sizeof(float) / 2, large = 4 * kMappedBytes / sizeof(float);
  AlignedBuffer<float> a(small);
  for (size_t n : {large, small, large + 3, size_t{1}, large}) {
    a.resize(n);
    ASSERT_EQ(a.size(), n);
    ASSERT_TRUE(aligned64(a.data())) << n;
    for (size_t i = 0; i < n; ++i) a[i] = static_cast<float>(i);
    AlignedBuffer<float> b(std::move(a));
    ASSERT_EQ(b.size(), n);
    EXPECT_EQ(a.size(), 0u);
    EXPECT_EQ(b[n - 1], static_cast<float>(n - 1));
    a = std::move(b);
  }
  a.resize(0);
  EXPECT_EQ(a.data(), nullptr);
}

TEST(AlignedBlock, TheAllocationCounterSeesMappedBlocks) {
  test::g_allocations = 0;
  test::g_count_allocations = true;
  { AlignedBuffer<uint8_t> big(4 * kMappedBytes); }
  { AlignedBuffer<uint8_t> small(256); }
  test::g_count_allocations = false;
  EXPECT_EQ(test::g_allocations.load(), 2);
}

}  // namespace
}  // namespace d2o
