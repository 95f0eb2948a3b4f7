#include "strata/base/units.h"

#include <gtest/gtest.h>

#include "strata/base/error.h"

namespace strata {
namespace {

TEST(ParseBytes, ReadsBinaryAndDecimalUnits) {
  EXPECT_EQ(parse_bytes("4096"), 4096u);
  EXPECT_EQ(parse_bytes("512MiB"), 512 * MiB);
  EXPECT_EQ(parse_bytes("512 mib"), 512 * MiB);
  EXPECT_EQ(parse_bytes("2GB"), 2'000'000'000u);
  EXPECT_EQ(parse_bytes("1.5GiB"), 3 * GiB / 2);
  EXPECT_EQ(parse_bytes("4k"), 4 * KiB);
  EXPECT_EQ(parse_bytes("1T"), 1024 * GiB);
  EXPECT_EQ(parse_bytes("  7B "), 7u);
}

TEST(ParseBytes, RejectsBadTextNamingTheKey) {
  for (const char* bad : {"", "-1", "12XB", "MiB", "1.5", "99999999999999999999", "20000000000T"}) {
    try {
      parse_bytes(bad, "device_budget");
      FAIL() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::invalid_argument);
      EXPECT_NE(std::string(e.what()).find("device_budget"), std::string::npos) << e.what();
    }
  }
}

TEST(FormatBytes, UsesBinaryUnits) {
  EXPECT_EQ(format_bytes(512), "512 B");
  EXPECT_EQ(format_bytes(4 * KiB), "4.00 KiB");
  EXPECT_EQ(format_bytes(3 * GiB / 2), "1.50 GiB");
}

}  // namespace
}  // namespace strata
