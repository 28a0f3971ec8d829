// The collective watchdog: a rank that waits in a collective for longer than its
// timeout (its peers ran another collective, stopped or died) ends its process with
// a message naming the collective, so that the launcher stops the job instead of
// every rank waiting forever. TensorFlow-free; the kernels open and close watches.
#pragma once

#include <cstdint>
#include <string>

namespace tf_sok {
namespace impl {

// Exit status of a process ended by the watchdog (as `timeout(1)` uses).
constexpr int kWatchdogExitCode = 124;

// Opens a watch on collective `what` (a description for the message) that ends the
// process unless closed within `timeout_s` seconds. Returns its token (> 0).
int64_t OpenWatch(const std::string& what, double timeout_s);

// Closes a watch; closing an unknown or already closed token does nothing.
void CloseWatch(int64_t token);

// Number of open watches (for tests).
int64_t OpenWatches();

}  // namespace impl
}  // namespace tf_sok
