// A persistent pool of kernel threads: created once per configuration, shared by every
// optimizer group of the process, so a step never spawns a thread (S 3.2 keeps the CPU
// optimizer beside the compute and copy threads; spawning per call costs and oversubscribes).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace cpu_adam {

class WorkerPool {
 public:
  // threads workers, pinned to cores[t % cores.size()] when cores is not empty. One thread
  // and no pinning means no worker at all: run() then executes in the caller.
  WorkerPool(int threads, std::vector<int> cores);
  ~WorkerPool();
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  // Runs body(k) for k in [0, count) on the workers; blocks until every k has run and
  // rethrows the first exception a body raised. Callers on several threads may run jobs
  // at once: workers serve them in submission order, block by block. static_split: worker
  // w first takes the blocks of its own share [w * count / T, (w + 1) * count / T), the same
  // on every call of the same count, and then helps with the others' shares; otherwise
  // every worker takes the next unclaimed block. Which worker runs a block never changes
  // what the block computes.
  void run(int64_t count, const std::function<void(int64_t)>& body, bool static_split = false);
  // Joins every worker; later run() calls fail. Idempotent.
  void close();

  int threads() const { return threads_; }
  const std::vector<int>& cores() const { return cores_; }
  int worker_count() const { return static_cast<int>(workers_.size()); }

 private:
  // One worker's share of a job's blocks under static_split: [next, end) still unclaimed,
  // on a cache line of its own.
  struct alignas(64) Share {
    std::atomic<int64_t> next{0};
    int64_t end = 0;
  };

  struct Job {
    const std::function<void(int64_t)>* body;
    int64_t count;
    std::unique_ptr<Share[]> shares;  // static_split: one per worker; else null
    // Every worker takes its blocks from here: on a cache line of its own, so that the
    // claims do not keep invalidating the fields below (written under mutex_).
    alignas(64) std::atomic<int64_t> next{0};
    alignas(64) int64_t done = 0;  // guarded by mutex_
    int active = 0;    // workers holding a pointer to this job; guarded by mutex_
    std::exception_ptr error;
    std::condition_variable finished;
  };

  void work(int index);
  // The next block of `job` for worker `index` to run, or -1 when every block is claimed.
  int64_t claim(Job& job, int index);

  const int threads_;
  const std::vector<int> cores_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Job*> queue_;
  bool closing_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace cpu_adam
