// Host memory advice for large tables: allow transparent huge pages for them.
// Rows of a big table are touched at random, so with 4 KiB pages nearly every
// row access also misses the TLB; 2 MiB pages remove most of those misses.
// Only the hint is given (the kernel's khugepaged then collapses the pages in
// the background). Collapsing synchronously (MADV_COLLAPSE) was measured to
// stall the first update for ~6 s per 3.8 GB of table and state, so it is not
// done. Best effort: without THP support the call simply fails.
#ifndef TF_SOK_CC_IMPL_CPU_MEMORY_H_
#define TF_SOK_CC_IMPL_CPU_MEMORY_H_

#include <sys/mman.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <unordered_set>

namespace tf_sok {
namespace impl {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kAdviseAtLeast = size_t{64} << 20;  // smaller tables fit the TLB anyway

// Asks once per buffer (by address) for huge pages.
inline void AdviseHugePages(const void* data, size_t bytes) {
  if (bytes < kAdviseAtLeast) return;
  static std::mutex mu;
  static std::unordered_set<const void*>* seen = new std::unordered_set<const void*>();
  {
    std::lock_guard<std::mutex> l(mu);
    if (!seen->insert(data).second) return;
  }
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHugePage - 1) & ~(kHugePage - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHugePage - 1);
  if (end <= begin) return;
  void* p = reinterpret_cast<void*>(begin);
#ifdef MADV_HUGEPAGE
  madvise(p, end - begin, MADV_HUGEPAGE);
#endif
}

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_CPU_MEMORY_H_
