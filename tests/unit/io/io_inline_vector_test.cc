#include "io/inline_vector.h"

#include <gtest/gtest.h>

#include <memory>
#include <vector>

namespace qcowfs {
namespace {

// Move-only elements that own memory: a lost, doubled or unmoved element shows
// as a wrong value (and as a leak or double free under ASan).
std::vector<int> values(const InlineVector<std::unique_ptr<int>, 2>& v) {
  std::vector<int> out;
  for (const auto& p : v) out.push_back(*p);
  return out;
}

TEST(InlineVector, KeepsElementsInlineThenSpillsToTheHeapInOrder) {
  InlineVector<std::unique_ptr<int>, 2> v;
  EXPECT_TRUE(v.empty());
  v.push_back(std::make_unique<int>(1));
  v.push_back(std::make_unique<int>(2));
  const auto* inline_data = v.data();
  EXPECT_EQ(values(v), (std::vector<int>{1, 2}));
  v.push_back(std::make_unique<int>(3));  // past N: all three move to the heap
  EXPECT_NE(v.data(), inline_data);
  v.push_back(std::make_unique<int>(4));
  EXPECT_EQ(values(v), (std::vector<int>{1, 2, 3, 4}));
  EXPECT_EQ(*v.back(), 4);
  EXPECT_EQ(*v[2], 3);
  v.clear();
  EXPECT_EQ(v.size(), 0u);
  v.push_back(std::make_unique<int>(5));  // inline again after clear
  EXPECT_EQ(v.data(), inline_data);
  EXPECT_EQ(values(v), (std::vector<int>{5}));
}

TEST(InlineVector, ReserveBeyondTheInlineRoomKeepsTheElements) {
  InlineVector<std::unique_ptr<int>, 2> v;
  v.push_back(std::make_unique<int>(7));
  v.reserve(2);  // fits inline: stays
  EXPECT_EQ(values(v), (std::vector<int>{7}));
  v.reserve(5);
  v.push_back(std::make_unique<int>(8));
  EXPECT_EQ(values(v), (std::vector<int>{7, 8}));
}

}  // namespace
}  // namespace qcowfs
