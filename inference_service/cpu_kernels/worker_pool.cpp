#include "worker_pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <chrono>

namespace {
// How long an idle worker spins before it sleeps: longer than the Python between two kernel calls of a
// step, short enough that an idle server does not burn a core.
constexpr auto kSpin = std::chrono::microseconds(200);
}  // namespace

WorkerPool& WorkerPool::instance() {
  static WorkerPool* pool = new WorkerPool(std::max(0, at::get_num_threads() - 1));  // never destroyed: exit-safe
  return *pool;
}

WorkerPool::WorkerPool(int num_workers) {
  // Workers start from generation 0, not from whatever they read when they first run: a job posted
  // before a new thread gets going must still be seen as new.
  for (int i = 0; i < num_workers; ++i) threads_.emplace_back([this] { worker_loop(0); });
}

WorkerPool::~WorkerPool() {
  stopping_ = true;
  generation_.fetch_add(1);
  wake_.notify_all();
  for (auto& t : threads_) t.join();
}

void WorkerPool::do_tasks() {
  for (int64_t task = next_task_.fetch_add(1); task < num_tasks_; task = next_task_.fetch_add(1)) {
    const int64_t first = begin_ + task * chunk_;
    (*fn_)(first, std::min(end_, first + chunk_));
  }
}

void WorkerPool::worker_loop(uint64_t seen) {
  while (true) {
    const auto spin_until = std::chrono::steady_clock::now() + kSpin;
    while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < spin_until) {
      _mm_pause();
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      num_sleeping_.fetch_add(1);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
      num_sleeping_.fetch_sub(1);
    }
    seen = generation_.load();
    if (stopping_) return;
    do_tasks();
    num_busy_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void WorkerPool::run(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (begin >= end) return;
  const int64_t num_threads = static_cast<int64_t>(threads_.size()) + 1;
  const int64_t max_tasks = (end - begin + grain - 1) / std::max<int64_t>(grain, 1);
  if (threads_.empty() || max_tasks <= 1) {
    fn(begin, end);
    return;
  }
  std::lock_guard<std::mutex> guard(run_mutex_);
  num_tasks_ = std::min(max_tasks, num_threads);
  chunk_ = (end - begin + num_tasks_ - 1) / num_tasks_;
  num_tasks_ = (end - begin + chunk_ - 1) / chunk_;
  begin_ = begin, end_ = end, fn_ = &fn;
  next_task_.store(0);
  num_busy_.store(static_cast<int>(threads_.size()));
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);  // a worker between its check and its wait sees this
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  if (num_sleeping_.load() > 0) wake_.notify_all();
  do_tasks();
  while (num_busy_.load(std::memory_order_acquire) > 0) _mm_pause();
}
