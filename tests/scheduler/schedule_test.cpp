#include "strata/scheduler/schedule.h"

#include <gtest/gtest.h>

#include "strata/base/error.h"

namespace strata {
namespace {

Schedule three_layers() {
  // forward 0,1,2 then backward 2,1,0; tensor 100 (an embedding) used first and last.
  Schedule s;
  s.append({"fwd0", {{0, Access::Read}, {100, Access::Read}}});
  s.append({"fwd1", {{1, Access::Read}}});
  s.append({"fwd2", {{2, Access::Read}}});
  s.append({"bwd2", {{2, Access::Read}, {12, Access::Write}}});
  s.append({"bwd1", {{1, Access::Read}, {11, Access::Write}}});
  s.append({"bwd0", {{0, Access::Read}, {10, Access::Write}, {100, Access::ReadWrite}}});
  return s;
}

TEST(Schedule, NextUseFindsTheNextStepThatTouchesATensor) {
  const Schedule s = three_layers();
  EXPECT_EQ(s.next_use(1, 0), 1u);
  EXPECT_EQ(s.next_use(1, 2), 4u);
  EXPECT_EQ(s.next_use(2, 4), Schedule::kNever);
  EXPECT_EQ(s.next_use(2, 4, /*cyclic=*/true), 6u + 2u);  // next iteration's fwd2
  EXPECT_EQ(s.next_use(999, 0), Schedule::kNever);
  EXPECT_EQ(s.last_use(100), 5u);
  EXPECT_EQ(s.last_use(12), 3u);
}

TEST(Schedule, RejectsAStepThatNamesATensorTwice) {
  Schedule s;
  EXPECT_THROW(s.append({"bad", {{7, Access::Read}, {7, Access::Write}}}), Error);
  EXPECT_TRUE(s.empty());
}

}  // namespace
}  // namespace strata
