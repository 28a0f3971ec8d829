// Host memory advice for large tables: allow transparent huge pages for them.
// Rows of a big table are touched at random, so with 4 KiB pages nearly every
// row access also misses the TLB; 2 MiB pages remove most of those misses.
// Only the hint is given (the kernel's khugepaged then collapses the pages in
// the background). Collapsing synchronously (MADV_COLLAPSE) was measured to
// stall the first update for ~6 s per 3.8 GB of table and state, so it is not
// done. Best effort: without THP support the call simply fails. Memory allocated
// for such arrays (AllocateForRandomAccess) is advised before its first touch.
#ifndef TF_SOK_CC_IMPL_CPU_MEMORY_H_
#define TF_SOK_CC_IMPL_CPU_MEMORY_H_

#include <sys/mman.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <unordered_set>
#include <vector>

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

// `bytes` of host memory to release with std::free (nullptr when out of memory), `align`ed; from
// kAdviseAtLeast bytes on 2 MiB aligned and advised for huge pages before anything touches them, so
// that the first writes (a container's fill) already fault huge pages in where the kernel has them
// (THP "always" or "madvise"), with no wait for khugepaged. For large arrays read at random: a key
// map of 64M keys (2 GiB of buckets) is looked up 3x faster so (64 -> 21 ns a key, prefetched).
inline void* AllocateForRandomAccess(size_t bytes, size_t align = 64) {
  if (bytes < kAdviseAtLeast) return std::aligned_alloc(align, (std::max<size_t>(bytes, 1) + align - 1) / align * align);
  const size_t rounded = (bytes + kHugePage - 1) / kHugePage * kHugePage;
  void* p = std::aligned_alloc(kHugePage, rounded);
#ifdef MADV_HUGEPAGE
  if (p != nullptr) madvise(p, rounded, MADV_HUGEPAGE);
#endif
  return p;
}

// A std::allocator for large arrays read at random (AllocateForRandomAccess).
template <typename T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <typename U>
  HugePageAllocator(const HugePageAllocator<U>&) {}  // NOLINT(runtime/explicit)
  T* allocate(size_t n) {
    void* p = AllocateForRandomAccess(n * sizeof(T), alignof(T) > 64 ? alignof(T) : 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { std::free(p); }
  template <typename U>
  bool operator==(const HugePageAllocator<U>&) const { return true; }
  template <typename U>
  bool operator!=(const HugePageAllocator<U>&) const { return false; }
};

// A vector of such an array.
template <typename T>
using HugePageVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_CPU_MEMORY_H_
