#include "tf_sok/cc/impl/watchdog.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

namespace tf_sok {
namespace impl {
namespace {

using Clock = std::chrono::steady_clock;

struct Watch {
  std::string what;
  Clock::time_point opened;
  Clock::time_point deadline;
};

// One per process, never destroyed (its thread may outlive static destruction).
class Watchdog {
 public:
  int64_t Open(const std::string& what, double timeout_s) {
    const auto now = Clock::now();
    const auto deadline = now + std::chrono::duration_cast<Clock::duration>(
                                    std::chrono::duration<double>(timeout_s));
    std::lock_guard<std::mutex> lock(mu_);
    if (!started_) {
      std::thread([this] { Run(); }).detach();
      started_ = true;
    }
    const int64_t token = next_++;
    open_.emplace(token, Watch{what, now, deadline});
    wake_.notify_one();
    return token;
  }

  void Close(int64_t token) {
    std::lock_guard<std::mutex> lock(mu_);
    open_.erase(token);
  }

  int64_t Count() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int64_t>(open_.size());
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (open_.empty()) {
        wake_.wait(lock);
        continue;
      }
      const auto now = Clock::now();
      auto first = open_.begin();
      for (auto it = open_.begin(); it != open_.end(); ++it) {
        if (it->second.deadline < first->second.deadline) first = it;
      }
      if (first->second.deadline <= now) Expire(first->second, now);
      const Clock::time_point next = first->second.deadline;  // a copy: Close may erase the watch meanwhile
      wake_.wait_until(lock, next);
    }
  }

  [[noreturn]] static void Expire(const Watch& w, Clock::time_point now) {
    const double waited = std::chrono::duration<double>(now - w.opened).count();
    std::fprintf(stderr,
                 "tf_sok: %s has waited %.0f s for the other ranks (TF_SOK_COLLECTIVE_TIMEOUT): a rank ran a "
                 "different collective, is stuck, or has died. Ending this process (exit code %d) so that the "
                 "launcher stops the job.\n",
                 w.what.c_str(), waited, kWatchdogExitCode);
    std::fflush(stderr);
    std::fflush(stdout);
    std::_Exit(kWatchdogExitCode);
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::map<int64_t, Watch> open_;
  int64_t next_ = 1;
  bool started_ = false;
};

Watchdog& Get() {
  static Watchdog* dog = new Watchdog();
  return *dog;
}

}  // namespace

int64_t OpenWatch(const std::string& what, double timeout_s) { return Get().Open(what, timeout_s); }
void CloseWatch(int64_t token) { Get().Close(token); }
int64_t OpenWatches() { return Get().Count(); }

}  // namespace impl
}  // namespace tf_sok
