// A framework-less test harness for the torch-free kernels (run by ctest as fastdist_kernel_tests).
//
//   FD_TEST(pack_matches_reference) {
//     FD_EXPECT(got == want, "n=" << n << " got " << int(got) << " want " << int(want));
//   }
//
// A test fails when any FD_EXPECT in it fails; the first few failures of each test are printed.
#pragma once
#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace fastdist::testing {

struct TestCase {
  std::string name;
  std::function<void()> fn;
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

// Failures of the test that is running now (reset by the runner before each test).
inline int& current_failures() {
  static int failures = 0;
  return failures;
}

struct Registrar {
  Registrar(const char* name, std::function<void()> fn) { registry().push_back({name, std::move(fn)}); }
};

inline void report_failure(const char* file, int line, const char* expr, const std::string& detail) {
  constexpr int kPrintedPerTest = 5;
  if (current_failures()++ < kPrintedPerTest) {
    std::cerr << "  " << file << ":" << line << ": expected " << expr << (detail.empty() ? "" : ": ") << detail
              << "\n";
  }
}

}  // namespace fastdist::testing

#define FD_TEST(name)                                                             \
  static void name();                                                             \
  static const ::fastdist::testing::Registrar fd_test_registrar_##name(#name, name); \
  static void name()

// FD_EXPECT(cond, stream-expression) — the second argument is streamed into the failure message.
#define FD_EXPECT(cond, detail)                                                      \
  do {                                                                               \
    if (!(cond)) {                                                                   \
      std::ostringstream fd_detail_;                                                 \
      fd_detail_ << detail;                                                          \
      ::fastdist::testing::report_failure(__FILE__, __LINE__, #cond, fd_detail_.str()); \
    }                                                                                \
  } while (0)
