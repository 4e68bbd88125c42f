// megatron.optimizer._state_io: optimizer states in files, read into and written from host
// buffers by a pool of threads doing pread/pwrite. A request is cut into chunks that the
// threads take from one queue, so several are in flight at once and the drive sees a queue
// depth of up to `threads`. The Python layer (megatron/optimizer/state_io.py) owns buffers.
// Threads, not io_uring: they already reach the disk's O_DIRECT limit measured by dd and a
// plain pwritev loop (bench/nvme_optimizer.py), at a few syscalls per MiB.
#include <errno.h>
#include <fcntl.h>
#include <pybind11/pybind11.h>
#include <sys/stat.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace state_io {
namespace {

constexpr int64_t kAlignment = 4096;  // O_DIRECT's requirement on every filesystem we use

[[noreturn]] void raise_errno(int error, const std::string& path) {
  errno = error;
  PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
  throw py::error_already_set();
}

std::tuple<int, bool> open_file(const std::string& path, int64_t nbytes, bool direct) {
  if (nbytes < 0) throw py::value_error("nbytes=" + std::to_string(nbytes) + " must be >= 0");
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC;
  int fd = -1;
  {
    py::gil_scoped_release release;
    do {
      fd = ::open(path.c_str(), flags | (direct ? O_DIRECT : 0), 0600);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0 && direct && errno == EINVAL) {  // tmpfs and others refuse O_DIRECT
      direct = false;
      do {
        fd = ::open(path.c_str(), flags, 0600);
      } while (fd < 0 && errno == EINTR);
    }
  }
  if (fd < 0) raise_errno(errno, path);
  int error = 0;
  if (nbytes > 0) {
    py::gil_scoped_release release;
    // Reserving the blocks now makes a full disk fail here, not in the middle of a step.
    // fallocate(2), not posix_fallocate: glibc's emulation of the latter writes a byte per
    // block, which an O_DIRECT fd refuses, and hides EOPNOTSUPP.
    error = ::fallocate(fd, 0, 0, nbytes) != 0 ? errno : 0;
    if (error == EOPNOTSUPP || error == ENOSYS) {
      struct stat st;
      error = ::fstat(fd, &st) != 0 ? errno : 0;
      if (!error && st.st_size < nbytes) error = ::ftruncate(fd, nbytes) != 0 ? errno : 0;
    }
  }
  if (error) {
    ::close(fd);
    raise_errno(error, path);
  }
  return {fd, direct};
}

void close_file(int fd) {
  if (::close(fd) != 0 && errno != EINTR) raise_errno(errno, "fd " + std::to_string(fd));
}

class Engine {
 public:
  Engine(int threads, int64_t chunk_bytes) : threads_(threads), chunk_bytes_(chunk_bytes) {
    if (threads < 1) throw py::value_error("threads=" + std::to_string(threads) + " must be >= 1");
    if (chunk_bytes < kAlignment || chunk_bytes % kAlignment != 0) {
      throw py::value_error("chunk_bytes=" + std::to_string(chunk_bytes) +
                            " must be a positive multiple of " + std::to_string(kAlignment));
    }
    try {
      for (int t = 0; t < threads; ++t) workers_.emplace_back([this] { work(); });
    } catch (...) {  // a thread could not start: join those that did
      shutdown();
      throw;
    }
  }
  ~Engine() { shutdown(); }
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  uint64_t submit(int fd, uintptr_t address, int64_t nbytes, int64_t offset, bool write) {
    if (nbytes < 0 || offset < 0) {
      throw py::value_error("nbytes=" + std::to_string(nbytes) + " and offset=" +
                            std::to_string(offset) + " must be >= 0");
    }
    const int fl = ::fcntl(fd, F_GETFL);
    if (fl < 0) raise_errno(errno, "fd " + std::to_string(fd));
    if (fl & O_DIRECT) check_aligned(address, nbytes, offset);
    auto ticket = std::make_shared<Ticket>();
    std::lock_guard<std::mutex> lock(mutex_);
    if (closing_) throw std::runtime_error("Engine.submit after shutdown()");
    const uint64_t id = next_id_++;
    for (int64_t done = 0; done < nbytes; done += chunk_bytes_) {
      const int64_t n = std::min(chunk_bytes_, nbytes - done);
      queue_.push_back({ticket, fd, reinterpret_cast<char*>(address) + done, n, offset + done,
                        write});
      ++ticket->pending;
    }
    tickets_.emplace(id, std::move(ticket));
    wake_.notify_all();
    return id;
  }

  // Blocks (without the GIL) until every chunk of the ticket completed, then forgets it.
  // Several threads may wait on one ticket: all return (or raise) once it completes.
  void wait(uint64_t id) {
    std::shared_ptr<Ticket> ticket = find(id);
    {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lock(mutex_);
      ticket->finished.wait(lock, [&] { return ticket->pending == 0; });
      tickets_.erase(id);
    }
    if (ticket->error) {
      py::object e = py::reinterpret_steal<py::object>(
          PyObject_CallFunction(PyExc_OSError, "is", ticket->error, ticket->message.c_str()));
      if (!e) throw py::error_already_set();
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(e.ptr())), e.ptr());
      throw py::error_already_set();
    }
  }

  bool done(uint64_t id) {
    std::shared_ptr<Ticket> ticket = find(id);
    std::lock_guard<std::mutex> lock(mutex_);
    return ticket->pending == 0;
  }

  // Finishes the queued chunks, then joins every worker. Idempotent.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      closing_ = true;
      wake_.notify_all();
    }
    for (auto& w : workers_) {
      if (w.joinable()) w.join();
    }
    workers_.clear();
  }

  int threads() const { return threads_; }
  int64_t chunk_bytes() const { return chunk_bytes_; }

 private:
  struct Ticket {
    int64_t pending = 0;  // chunks not yet completed; guarded by mutex_
    int error = 0;        // the first failure's errno; guarded by mutex_ until pending == 0
    std::string message;
    std::condition_variable finished;
  };
  struct Chunk {
    std::shared_ptr<Ticket> ticket;
    int fd;
    char* data;
    int64_t nbytes;
    int64_t offset;
    bool write;
  };

  static void check_aligned(uintptr_t address, int64_t nbytes, int64_t offset) {
    const std::pair<const char*, uint64_t> values[] = {
        {"address", address}, {"nbytes", static_cast<uint64_t>(nbytes)},
        {"offset", static_cast<uint64_t>(offset)}};
    for (const auto& [name, value] : values) {
      if (value % kAlignment != 0) {
        throw py::value_error(std::string(name) + "=" + std::to_string(value) +
                              " is not a multiple of " + std::to_string(kAlignment) +
                              ", which O_DIRECT requires");
      }
    }
  }

  std::shared_ptr<Ticket> find(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = tickets_.find(id);
    if (it == tickets_.end()) {
      throw py::key_error("ticket " + std::to_string(id) + " is unknown or already waited");
    }
    return it->second;
  }

  // Loops over short transfers and EINTR; returns 0 or an errno (EIO for a read past EOF).
  static int transfer(const Chunk& c, std::string* message) {
    int64_t done = 0;
    while (done < c.nbytes) {
      const ssize_t r = c.write ? ::pwrite(c.fd, c.data + done, c.nbytes - done, c.offset + done)
                                : ::pread(c.fd, c.data + done, c.nbytes - done, c.offset + done);
      if (r < 0 && errno == EINTR) continue;
      const int64_t at = c.offset + done;
      if (r < 0) {
        const int error = errno;
        *message = std::string(std::strerror(error)) + (c.write ? " writing" : " reading") +
                   " fd " + std::to_string(c.fd) + " at offset " + std::to_string(at);
        return error;
      }
      if (r == 0) {  // pread at EOF (pwrite of n > 0 bytes never returns 0)
        *message = "read past the end of fd " + std::to_string(c.fd) + " at offset " +
                   std::to_string(at);
        return EIO;
      }
      done += r;
    }
    return 0;
  }

  void work() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return closing_ || !queue_.empty(); });
      if (queue_.empty()) return;  // closing and drained
      Chunk c = std::move(queue_.front());
      queue_.pop_front();
      const bool skip = c.ticket->error != 0;  // the ticket failed already: do not go on
      lock.unlock();
      std::string message;
      const int error = skip ? 0 : transfer(c, &message);
      lock.lock();
      if (error && !c.ticket->error) {
        c.ticket->error = error;
        c.ticket->message = std::move(message);
      }
      if (--c.ticket->pending == 0) c.ticket->finished.notify_all();
    }
  }

  const int threads_;
  const int64_t chunk_bytes_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Chunk> queue_;
  std::unordered_map<uint64_t, std::shared_ptr<Ticket>> tickets_;
  uint64_t next_id_ = 1;
  bool closing_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace
}  // namespace state_io

PYBIND11_MODULE(_state_io, m) {
  using state_io::Engine;
  m.doc() = "Optimizer-state files: O_DIRECT open with a buffered fallback, threaded pread/pwrite";
  m.attr("ALIGNMENT") = state_io::kAlignment;
  m.def("open_file", &state_io::open_file, py::arg("path"), py::arg("nbytes"), py::arg("direct"),
        "Creates or opens path (0600), reserves nbytes; returns (fd, direct in effect).");
  m.def("close_file", &state_io::close_file, py::arg("fd"));
  py::class_<Engine>(m, "Engine")
      .def(py::init<int, int64_t>(), py::arg("threads"), py::arg("chunk_bytes"))
      .def("submit", &Engine::submit, py::arg("fd"), py::arg("address"), py::arg("nbytes"),
           py::arg("offset"), py::arg("write"))
      .def("wait", &Engine::wait, py::arg("ticket"))
      .def("done", &Engine::done, py::arg("ticket"))
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("threads", &Engine::threads)
      .def_property_readonly("chunk_bytes", &Engine::chunk_bytes);
}
