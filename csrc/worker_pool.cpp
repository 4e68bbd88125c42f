#include "worker_pool.h"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

#include <cstring>
#include <stdexcept>
#include <string>

namespace cpu_adam {
namespace {

void pin_current_thread(int core) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(core, &set);
  const int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  if (rc != 0) {
    throw std::runtime_error("cannot pin an optimizer thread to core " + std::to_string(core) +
                             ": " + std::strerror(rc));
  }
#else
  (void)core;
  throw std::runtime_error("pinning optimizer threads to cores is only supported on Linux");
#endif
}

}  // namespace

WorkerPool::WorkerPool(int threads, std::vector<int> cores)
    : threads_(threads), cores_(std::move(cores)) {
  if (threads < 1) throw std::invalid_argument("threads=" + std::to_string(threads) + " must be >= 1");
  if (threads == 1 && cores_.empty()) return;  // the caller runs every job itself
  // Workers pin themselves before taking work; the constructor reports a refused pinning.
  std::mutex started_mutex;
  std::condition_variable started_cv;
  int started = 0;
  std::exception_ptr pin_error;
  for (int t = 0; t < threads; ++t) {
    workers_.emplace_back([&, t] {
      std::exception_ptr error;
      try {
        if (!cores_.empty()) pin_current_thread(cores_[t % cores_.size()]);
      } catch (...) {
        error = std::current_exception();
      }
      {
        std::lock_guard<std::mutex> lock(started_mutex);
        if (error && !pin_error) pin_error = error;
        ++started;
        started_cv.notify_one();  // under the lock: the constructor's stack outlives it
      }
      if (!error) work(t);
    });
  }
  {
    std::unique_lock<std::mutex> lock(started_mutex);
    started_cv.wait(lock, [&] { return started == threads; });
  }
  if (pin_error) {
    close();
    std::rethrow_exception(pin_error);
  }
}

WorkerPool::~WorkerPool() { close(); }

void WorkerPool::close() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    closing_ = true;
  }
  wake_.notify_all();
  for (auto& w : workers_) {
    if (w.joinable()) w.join();
  }
}

int64_t WorkerPool::claim(Job& job, int index) {
  if (!job.shares) {
    const int64_t k = job.next++;
    return k < job.count ? k : -1;
  }
  for (int s = 0; s < threads_; ++s) {  // its own share first, then the next ones
    Share& share = job.shares[(index + s) % threads_];
    if (share.next.load(std::memory_order_relaxed) >= share.end) continue;
    const int64_t k = share.next++;
    if (k < share.end) return k;
  }
  return -1;
}

void WorkerPool::work(int index) {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    wake_.wait(lock, [&] { return closing_ || !queue_.empty(); });
    if (queue_.empty()) return;  // closing and nothing left to do
    Job* job = queue_.front();
    ++job->active;
    lock.unlock();
    int64_t ran = 0;
    for (int64_t k = claim(*job, index); k >= 0; k = claim(*job, index), ++ran) {
      try {
        (*job->body)(k);
      } catch (...) {
        std::lock_guard<std::mutex> guard(mutex_);
        if (!job->error) job->error = std::current_exception();
      }
    }
    lock.lock();
    // Every block is claimed: the job leaves the queue (once) so workers move on.
    if (!queue_.empty() && queue_.front() == job) queue_.pop_front();
    job->done += ran;
    --job->active;
    if (job->done == job->count && job->active == 0) job->finished.notify_all();
  }
}

void WorkerPool::run(int64_t count, const std::function<void(int64_t)>& body,
                     bool static_split) {
  if (count <= 0) return;
  if (workers_.empty()) {
    if (closing_) throw std::runtime_error("the optimizer's worker pool is closed");
    for (int64_t k = 0; k < count; ++k) body(k);
    return;
  }
  Job job;
  job.body = &body;
  job.count = count;
  if (static_split) {
    job.shares.reset(new Share[threads_]);
    for (int w = 0; w < threads_; ++w) {
      job.shares[w].next = count * w / threads_;
      job.shares[w].end = count * (w + 1) / threads_;
    }
  }
  std::unique_lock<std::mutex> lock(mutex_);
  if (closing_) throw std::runtime_error("the optimizer's worker pool is closed");
  queue_.push_back(&job);
  wake_.notify_all();
  // The job lives on this stack: return only once no worker can still touch it.
  job.finished.wait(lock, [&] { return job.done == job.count && job.active == 0; });
  lock.unlock();
  if (job.error) std::rethrow_exception(job.error);
}

}  // namespace cpu_adam
