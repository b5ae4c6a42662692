// Runs every FD_TEST linked into fastdist_kernel_tests; exits non-zero when any of them fails.
#include "testing.h"

int main() {
  using namespace fastdist::testing;
  int passed = 0, failed = 0;
  for (const TestCase& test : registry()) {
    current_failures() = 0;
    test.fn();
    if (current_failures() == 0) {
      ++passed;
      std::cout << "PASS " << test.name << "\n";
    } else {
      ++failed;
      std::cout << "FAIL " << test.name << " (" << current_failures() << " failed checks)\n";
    }
  }
  std::cout << passed << " passed, " << failed << " failed\n";
  return failed == 0 ? 0 : 1;
}
