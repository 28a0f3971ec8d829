// Tuning settings read from the environment (the benchmarks' side-by-side switches).
#ifndef TF_SOK_CC_IMPL_ENV_H_
#define TF_SOK_CC_IMPL_ENV_H_

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <set>
#include <string>

namespace tf_sok {
namespace impl {

// The number environment variable `name` holds, read at each call: nullopt when it is unset or empty,
// and when it holds anything but a number in [lo, hi] (a whole one where `whole`), which is then
// reported on stderr (once per process and variable), naming the variable, its value and the range.
inline std::optional<double> EnvNumber(const char* name, double lo, double hi, bool whole) {
  const char* v = std::getenv(name);
  if (v == nullptr || v[0] == 0) return std::nullopt;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (end != v && *end == 0 && x >= lo && x <= hi && (!whole || x == std::floor(x))) return x;
  static std::mutex mu;
  static std::set<std::string> told;
  std::lock_guard<std::mutex> lock(mu);
  if (told.insert(name).second)
    std::fprintf(stderr, "tf_sok: %s=\"%s\" is ignored: not %s in [%g, %g]\n", name, v,
                 whole ? "a whole number" : "a number", lo, hi);
  return std::nullopt;
}

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_ENV_H_
