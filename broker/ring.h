// Ring: a FIFO of movable values in one growable array.
//
// For queues on the hot path that must not allocate per element once warm
// (std::deque allocates a node every few elements): the array doubles when
// full and never shrinks, so a queue that has seen its peak depth costs no
// allocation again. A popped slot is reset to a default value at once, so
// whatever it held (a payload, fds) is released when it leaves the queue.
//
// Thread safety: none (one owner thread). Ownership: owns its elements.
#pragma once

#include <cstddef>
#include <utility>
#include <vector>

namespace spindle {

template <class T>
class Ring {
 public:
  bool empty() const { return count_ == 0; }
  std::size_t size() const { return count_; }
  T& front() { return slots_[head_]; }
  T& back() { return slots_[(head_ + count_ - 1) & mask()]; }
  T& operator[](std::size_t i) { return slots_[(head_ + i) & mask()]; }

  void push_back(T&& v) {
    if (count_ == slots_.size()) grow();
    slots_[(head_ + count_) & mask()] = std::move(v);
    ++count_;
  }
  void push_front(T&& v) {
    if (count_ == slots_.size()) grow();
    head_ = (head_ + slots_.size() - 1) & mask();
    slots_[head_] = std::move(v);
    ++count_;
  }
  void pop_front() {
    slots_[head_] = T{};
    head_ = (head_ + 1) & mask();
    --count_;
  }
  void clear() {
    while (!empty()) pop_front();
  }

 private:
  std::size_t mask() const { return slots_.size() - 1; }
  void grow() {
    std::vector<T> bigger(slots_.empty() ? 8 : slots_.size() * 2);
    for (std::size_t i = 0; i < count_; ++i) bigger[i] = std::move((*this)[i]);
    slots_.swap(bigger);
    head_ = 0;
  }

  std::vector<T> slots_;  // a power of two in size
  std::size_t head_ = 0, count_ = 0;
};

}  // namespace spindle
