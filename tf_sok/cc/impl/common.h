// Device contexts and error reporting shared by the CPU and CUDA functors.
// Nothing here includes TensorFlow: the kernels under cc/kernels/ adapt these
// types to OpKernelContext.
#ifndef TF_SOK_CC_IMPL_COMMON_H_
#define TF_SOK_CC_IMPL_COMMON_H_

#include <cstddef>
#include <cstdint>
#include <functional>

#if defined(__CUDACC__)
#define TF_SOK_HD __host__ __device__ __forceinline__
#else
#define TF_SOK_HD inline
#endif

namespace tf_sok {
namespace impl {

// Scratch memory that lives until the calling kernel returns.
class ScratchAllocator {
 public:
  virtual ~ScratchAllocator() = default;
  // Returns nullptr when the allocation fails.
  virtual void* Allocate(size_t bytes) = 0;
};

// Runs fn(begin, end) over [0, total) in parallel; cost is a per-item estimate
// in cycles, used by the host thread pool to size the shards.
using ParallelFor = std::function<void(int64_t total, int64_t cost,
                                       const std::function<void(int64_t, int64_t)>& fn)>;

struct CpuDevice {
  ParallelFor parallel_for;
  ScratchAllocator* scratch;
};

struct GpuDevice {
  void* stream;  // cudaStream_t owned by TensorFlow
  ScratchAllocator* scratch;
};

// What went wrong, in terms the kernel turns into an InvalidArgument message.
enum class ErrorKind : int32_t {
  kOk = 0,
  kIdOutOfRange = 1,     // value = the id, item = flat position of the id
  kBadSplits = 2,        // value = the offending split, item = its index
  kOutOfMemory = 3,
  kCudaError = 4,        // value = cudaError_t
  kNotAscending = 5,     // indices promised strictly ascending are not; value = the index
  kUnsupported = 6,      // a functor asked for what it does not do (a caller's bug)
};

// Keys that name a row of one of several tables: (table << kTableShift) | row.
constexpr int kTableShift = 40;
constexpr long long kRowMask = (1LL << kTableShift) - 1;

// Ids of a table of `rows` rows (0: not known) lie in [0, IdLimit(rows)).
TF_SOK_HD long long IdLimit(long long rows) { return rows > 0 ? rows : kRowMask + 1; }

struct Error {
  ErrorKind kind = ErrorKind::kOk;
  int32_t group = -1;    // feature (lookup) or table (optimizer) index, or -1
  int64_t item = -1;
  int64_t value = 0;
  int64_t limit = 0;     // kIdOutOfRange: the bound the id broke
  bool ok() const { return kind == ErrorKind::kOk; }
};

// An Error as kernels on a device record it (the first writer wins), laid out
// as kErrorRecordWords int64 words so that it can travel as a tensor: a GPU
// lookup hands it on as its status output instead of waiting for it.
struct ErrorRecord {
  int32_t kind;
  int32_t group;
  int64_t item;
  int64_t value;
  int64_t limit;  // kIdOutOfRange: the rows of the id's table
};
constexpr int kErrorRecordWords = 4;
static_assert(sizeof(ErrorRecord) == kErrorRecordWords * sizeof(int64_t), "ErrorRecord layout");

inline Error FromRecord(const ErrorRecord& r) {
  Error e;
  e.kind = static_cast<ErrorKind>(r.kind);
  e.group = r.group;
  e.item = r.item;
  e.value = r.value;
  e.limit = r.limit;
  return e;
}

}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_COMMON_H_
