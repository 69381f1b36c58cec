// A persistent pool of worker threads for the CPU kernels' loops.
//
// NOTE: why not at::parallel_for: with libgomp, a parallel region started from a thread other than the
// process's first (the engine's step loop runs in its own thread) made a decode step ~1.7x slower than
// the same step on the main thread, although one large matmul alone scaled the same on both. These
// workers do not care which thread calls them: they spin briefly between calls (a decode step makes
// about 150 back to back) and sleep when idle.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

class WorkerPool {
 public:
  // The process's pool: at::get_num_threads() - 1 workers, the caller being the last.
  static WorkerPool& instance();

  // Runs fn(first, last) over [begin, end) in chunks of at least `grain`, on the workers and the
  // caller; returns when all are done. fn must not throw or call run() itself.
  void run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);

  ~WorkerPool();

 private:
  explicit WorkerPool(int num_workers);
  void worker_loop(uint64_t seen);
  void do_tasks();

  std::vector<std::thread> threads_;
  std::mutex run_mutex_;  // one caller at a time
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> num_sleeping_{0};
  std::atomic<int> num_busy_{0};
  std::atomic<int64_t> next_task_{0};
  std::atomic<bool> stopping_{false};
  const std::function<void(int64_t, int64_t)>* fn_ = nullptr;
  int64_t begin_ = 0, end_ = 0, chunk_ = 1, num_tasks_ = 0;
};
