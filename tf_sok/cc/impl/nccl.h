// Collectives between GPU ranks driven by NCCL from tf_sok's own ops, on
// TensorFlow's compute stream: the all-to-all of the multi-rank lookup without
// a framework's background thread in between.
//
// libnccl.so.2 is opened at run time (dlopen; TF_SOK_NCCL_LIBRARY names
// another file), so the op library neither links nor needs NCCL until a
// communicator is created. A communicator lives in a process-wide registry
// under the key its creator chose; every collective names that key.
//
// Each function returns "" on success, else a message for the op's error.
// Every rank must issue the same collectives in the same order on a key.
#ifndef TF_SOK_CC_IMPL_NCCL_H_
#define TF_SOK_CC_IMPL_NCCL_H_

#include <cstdint>
#include <string>

#include "tf_sok/cc/impl/common.h"

namespace tf_sok {
namespace impl {
namespace nccl {

constexpr int kUniqueIdBytes = 128;

// The library's version ("2.28.9") or the reason it cannot be opened.
std::string Version(std::string* version);

// A fresh NCCL unique id (rank 0 makes it; the others receive it).
std::string GetUniqueId(char id[kUniqueIdBytes]);

// Joins communicator `key` as `rank` of `size` on the GPU of d's stream.
// Blocks until every rank has joined.
std::string Init(int64_t key, const char id[kUniqueIdBytes], int rank, int size, const GpuDevice& d);

// The number of ranks of communicator `key` (and this process's rank in it),
// or -1 if it does not exist.
int Size(int64_t key, int* rank = nullptr);

// True once this process holds communicators on more than one GPU (several
// ranks in one process, as under MirroredStrategy): then a rank's op that
// waits on its stream may be waiting for a peer whose op TensorFlow has yet
// to launch, possibly from the very thread that waits.
bool SeveralDevicesInProcess();

// Makes the GPU of `stream` current on the calling thread; "" or why not.
std::string MakeStreamDeviceCurrent(const GpuDevice& d);

// send_counts[p] (host) -> what each rank p sends here (host). Waits for the stream.
std::string ExchangeCounts(int64_t key, const GpuDevice& d, const int32_t* send_counts, int32_t* recv_counts);

// Sends send_bytes[p] bytes (consecutive, in rank order) of `send` to rank p and
// receives recv_bytes[p] bytes from rank p into `recv` (in rank order).
// recv_bytes[p] must equal what rank p sends here. Asynchronous on the stream.
std::string AllToAll(int64_t key, const GpuDevice& d, const void* send, const int64_t* send_bytes,
                     void* recv, const int64_t* recv_bytes);

// Every rank's `bytes` bytes, concatenated in rank order. Asynchronous.
std::string AllGather(int64_t key, const GpuDevice& d, const void* send, void* recv, int64_t bytes);

}  // namespace nccl
}  // namespace impl
}  // namespace tf_sok

#endif  // TF_SOK_CC_IMPL_NCCL_H_
