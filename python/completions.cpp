// How calls end, for Python: outcome tuples, and the queue that carries
// asynchronous completions from the broker thread to a Python thread.
//
// Thread: Completions::push() runs on the broker thread and takes only a C++
// lock; get() runs on the package's completion thread, waits without the
// GIL and takes the GIL back only after dropping the lock, so the broker
// never waits for a thread that waits for the GIL. outcome_of() needs the
// GIL.
#include "binding.h"

#include <optional>
#include <utility>

namespace spindle::python {

py::tuple outcome_of(std::exception_ptr e) {
  auto t = [](Outcome k, const std::string& a, const std::string& b = {}) {
    return py::make_tuple(static_cast<int>(k), py::bytes(a), py::bytes(b));
  };
  try {
    std::rethrow_exception(e);
  } catch (const CallError& x) {
    return t(kCallError, x.type(), x.message());
  } catch (const ChannelError& x) {
    return t(kChannel, x.what());
  } catch (const TimeoutError& x) {
    return t(kTimeout, x.what());
  } catch (const ShutdownError& x) {
    return t(kShutdown, x.what());
  } catch (const std::exception& x) {
    return t(kOtherError, x.what());
  } catch (...) {
    return t(kOtherError, "a non-standard C++ exception");
  }
}

void Completions::push(Item item) {
  {
    std::lock_guard lk(mu_);
    items_.push_back(std::move(item));
  }
  cv_.notify_one();
}

py::object Completions::get() {
  std::deque<Item> batch;
  {
    py::gil_scoped_release nogil;  // taken back only after the lock is dropped
    std::unique_lock lk(mu_);
    cv_.wait(lk, [&] { return closed_ || !items_.empty(); });
    batch.swap(items_);
  }
  if (batch.empty()) return py::none();  // closed
  // Every completion queued so far, under one taking of the GIL: with many
  // calls in flight, replies come in bursts, and a GIL hand-off per reply
  // (with the thread that submits the next calls) cost more than the reply.
  py::list out(batch.size());
  std::size_t i = 0;
  for (Item& item : batch) {
    py::tuple outcome = item.error ? outcome_of(item.error)
                                   : py::make_tuple(static_cast<int>(kOk), payload_object(std::move(item.result)), py::none());
    out[i++] = py::make_tuple(item.token, std::move(outcome));
  }
  return out;
}

void Completions::close() {
  {
    std::lock_guard lk(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

}  // namespace spindle::python
