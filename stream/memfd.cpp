// A memfd payload is sealed exactly once, by its creator, before anyone else
// can see it; a receiver trusts nothing but the seals it reads back with
// F_GET_SEALS. Without F_SEAL_WRITE the sender could still change the bytes
// under the receiver (the check-then-use race Mojo's docs warn about), and
// without SHRINK a truncate would turn the receiver's reads into SIGBUS: such
// an fd is refused, never mapped.
#include "stream/memfd.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <map>
#include <mutex>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"

namespace spindle {
namespace {

[[noreturn]] void throw_errno(const char* what) {
  throw std::system_error(errno, std::generic_category(), what);
}

UniqueFd new_memfd(std::size_t size) {
  UniqueFd fd(::memfd_create("spindle-payload", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd) throw_errno("memfd_create");
  if (::ftruncate(fd.get(), static_cast<off_t>(size)) < 0) throw_errno("ftruncate(memfd)");
  return fd;
}

// F_SEAL_WRITE is refused (EBUSY) while any process maps the memfd
// writable, or while any page of it carries a reference beyond its mappings:
// an I/O in flight, a vmsplice() into a pipe not yet read, or, for a moment,
// the kernel's own reclaim and page migration (after a wait of about 150 ms,
// which a loaded machine can outlast: CI saw it). Returns false on EBUSY.
bool try_seal(int fd) {
  for (;;) {
    if (::fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE) == 0) return true;
    if (errno == EBUSY) return false;
    if (errno != EINTR) throw_errno("fcntl(F_ADD_SEALS)");
  }
}

// A memfd that nobody has mapped or seen can only be held by the kernel for
// a moment: a few tries outlast that, where nothing else would do. A copy
// that send() makes tries once, since its bytes can still go inline: it may
// run on the broker thread, which each try can hold for 150 ms.
constexpr int kCopySealTries = 1, kBufferCopySealTries = 4;

void seal_fresh(int fd, int tries) {
  for (int tried = 1; !try_seal(fd); ++tried)
    if (tried >= tries)
      throw std::system_error(EBUSY, std::generic_category(), std::string(errtext::kMemfdPagesHeld));
}

// A new memfd of `size` bytes holding what `iov` points to, written with
// pwritev (no mapping), and sealed within `seal_tries` tries.
UniqueFd sealed_memfd_of(std::vector<iovec> iov, std::size_t size, int seal_tries) {
  UniqueFd fd = new_memfd(size);
  std::size_t done = 0, first = 0;
  while (first < iov.size()) {
    int cnt = static_cast<int>(std::min<std::size_t>(iov.size() - first, IOV_MAX));
    ssize_t n = ::pwritev(fd.get(), iov.data() + first, cnt, static_cast<off_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      throw_errno("pwritev(memfd)");
    }
    done += static_cast<std::size_t>(n);
    // Skip what was written, trimming a slice written in part.
    for (std::size_t k = static_cast<std::size_t>(n); k > 0 && first < iov.size();) {
      std::size_t take = std::min(k, iov[first].iov_len);
      iov[first].iov_base = static_cast<std::uint8_t*>(iov[first].iov_base) + take;
      iov[first].iov_len -= take;
      k -= take;
      if (iov[first].iov_len == 0) ++first;
    }
  }
  seal_fresh(fd.get(), seal_tries);
  return fd;
}

// A sealed copy of the `size` bytes of the memfd `src`, read through a
// mapping of its own.
UniqueFd sealed_copy_of(int src, std::size_t size) {
  void* a = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, src, 0);
  if (a == MAP_FAILED) throw_errno("mmap(memfd, PROT_READ)");
  struct Unmap {
    void* a;
    std::size_t n;
    ~Unmap() { ::munmap(a, n); }
  } unmap{a, size};
  return sealed_memfd_of({iovec{a, size}}, size, kBufferCopySealTries);
}

// Every live read-only mapping of a sealed memfd (map()), by address, for
// SealedMemfd::mapped_at(). An entry exists only while its Mapping holds the
// memfd, so a memfd found here is alive. A lookup runs once per large slice
// sent, an insert once per mapping: a mutex is cheap there. It is held
// across fork() (pthread_atfork), so no child inherits it locked.
class MappedRanges {
 public:
  static MappedRanges& get() {
    static MappedRanges* r = new MappedRanges;  // never destroyed: mappings may outlive statics
    return *r;
  }
  // The `size` bytes at `addr` are those of `memfd` from `offset`.
  void add(const std::uint8_t* addr, std::size_t size, const SealedMemfd* memfd, std::size_t offset) {
    std::lock_guard lk(mu_);
    by_addr_[addr] = Entry{size, memfd, offset};
  }
  void remove(const std::uint8_t* addr) {
    std::lock_guard lk(mu_);
    by_addr_.erase(addr);
  }
  std::optional<SealedMemfd::Found> find(const std::uint8_t* p, std::size_t n) {
    std::lock_guard lk(mu_);
    auto it = by_addr_.upper_bound(p);
    if (it != by_addr_.begin()) {  // a mapping that starts at or before p: does it hold them all?
      auto at = std::prev(it);
      const std::size_t into = static_cast<std::size_t>(p - at->first);
      if (into <= at->second.size && n <= at->second.size - into)
        return SealedMemfd::Found{at->second.memfd->shared_from_this(), at->second.offset + into, 0, n};
    }
    // The first range that starts inside them, if it ends inside them too.
    auto in = by_addr_.lower_bound(p);
    if (in != by_addr_.end() && in->first < p + n && in->second.size <= static_cast<std::size_t>(p + n - in->first))
      return SealedMemfd::Found{in->second.memfd->shared_from_this(), in->second.offset,
                                static_cast<std::size_t>(in->first - p), in->second.size};
    return std::nullopt;
  }

 private:
  struct Entry {
    std::size_t size;
    const SealedMemfd* memfd;
    std::size_t offset;
  };
  MappedRanges() {
    // Only the forking thread runs these; the child's copy is unlocked by it.
    ::pthread_atfork([] { get().mu_.lock(); }, [] { get().mu_.unlock(); }, [] { get().mu_.unlock(); });
  }
  std::mutex mu_;
  std::map<const std::uint8_t*, Entry> by_addr_;
};

// Keeps a read-only mapping, and the memfd behind it, alive for a Payload.
// The `length` bytes at `bytes` within it are the memfd's from `offset`
// (all of it, for map(); the range, for map_into(), whose bytes around it
// stay charged by `kept`).
class Mapping {
 public:
  Mapping(void* addr, std::size_t size, std::shared_ptr<const SealedMemfd> memfd, const std::uint8_t* bytes,
          std::size_t length, std::size_t offset, Charge kept = {})
      : addr_(addr), size_(size), bytes_(bytes), memfd_(std::move(memfd)), kept_(std::move(kept)) {
    MappedRanges::get().add(bytes_, length, memfd_.get(), offset);
  }
  ~Mapping() {
    MappedRanges::get().remove(bytes_);
    ::munmap(addr_, size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

 private:
  void* addr_;
  std::size_t size_;
  const std::uint8_t* bytes_;
  std::shared_ptr<const SealedMemfd> memfd_;
  Charge kept_;
};

std::size_t page_size() {
  static const std::size_t p = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return p;
}
std::size_t page_up(std::size_t n) { return (n + page_size() - 1) / page_size() * page_size(); }

}  // namespace

std::shared_ptr<const SealedMemfd> SealedMemfd::copy_of(const Payload& bytes) {
  std::vector<iovec> iov;
  for (const Slice& s : bytes.slices()) iov.push_back({const_cast<std::uint8_t*>(s.data), s.size});
  return std::make_shared<SealedMemfd>(sealed_memfd_of(std::move(iov), bytes.size(), kCopySealTries),
                                       bytes.size());
}

std::shared_ptr<const SealedMemfd> SealedMemfd::adopt(UniqueFd fd, std::string& error,
                                                      std::shared_ptr<Account> account,
                                                      PeerCharge how, std::shared_ptr<void> fd_charge) {
  int seals = ::fcntl(fd.get(), F_GET_SEALS);
  if (seals < 0) {
    error = fmt::format("not a memfd (F_GET_SEALS: {})", errno_text(errno));
    return nullptr;
  }
  if ((seals & kRequiredSeals) != kRequiredSeals) {
    error = fmt::format("memfd is not sealed against writing and resizing (seals 0x{:x}, need 0x{:x})",
                        seals, kRequiredSeals);
    return nullptr;
  }
  struct stat st {};
  if (::fstat(fd.get(), &st) < 0) {
    error = fmt::format("fstat(memfd): {}", errno_text(errno));
    return nullptr;
  }
  const auto size = static_cast<std::size_t>(st.st_size);
  if (account) {
    if (how == PeerCharge::kAlways) {
      account->charge(size);
    } else if (!account->try_charge_within(size)) {
      error = fmt::format("{} bytes do not fit the sender's memory allowance ({})", size, account->holdings());
      return nullptr;
    }
  }
  auto m = std::make_shared<SealedMemfd>(std::move(fd), size);
  if (account) m->charge_ = Charge(std::move(account), size);
  m->fd_charge_ = std::move(fd_charge);
  return m;
}

Payload SealedMemfd::map() const {
  if (size_ == 0) return {};
  void* addr = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd_.get(), 0);
  if (addr == MAP_FAILED) throw_errno("mmap(memfd, PROT_READ)");
  std::shared_ptr<const SealedMemfd> self = shared_from_this();
  auto owner = std::make_shared<Mapping>(addr, size_, self, static_cast<const std::uint8_t*>(addr), size_, 0);
  Payload p;
  p.append(Slice{std::move(owner), static_cast<const std::uint8_t*>(addr), size_});
  p.set_memfd(std::move(self));  // resending this payload passes the fd again
  return p;
}

// One contiguous read-only view, so that a decoder reads the body in place
// (msgpack by reference needs one range), built from page mappings: the
// memfd's pages that hold the range, mapped private, with the bytes before
// and after the range written around it. Those writes copy at most the
// first and last of the memfd's pages (copy on write) and fill anonymous
// pages beside them; every other page is the memfd's own, never copied.
Payload SealedMemfd::map_into(const Payload& around, std::size_t at, std::size_t offset, std::size_t length,
                              Charge kept) const {
  if (length == 0 || offset > size_ || length > size_ - offset || at > around.size())
    throw std::system_error(EINVAL, std::generic_category(), "memfd range outside the memfd");
  const std::size_t head = at, tail = around.size() - at;
  const std::size_t skew = offset % page_size();
  const std::size_t file_lo = offset - skew, file_hi = page_up(offset + length);
  const std::size_t before = page_up(head > skew ? head - skew : 0);
  const std::size_t after = page_up(offset + length + tail > file_hi ? offset + length + tail - file_hi : 0);
  const std::size_t total = before + (file_hi - file_lo) + after;
  void* region = ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (region == MAP_FAILED) throw_errno("mmap(anonymous)");
  auto* base = static_cast<std::uint8_t*>(region);
  if (::mmap(base + before, file_hi - file_lo, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd_.get(),
             static_cast<off_t>(file_lo)) == MAP_FAILED) {
    const int err = errno;
    ::munmap(region, total);
    throw std::system_error(err, std::generic_category(), "mmap(memfd, MAP_PRIVATE | MAP_FIXED)");
  }
  std::uint8_t* range = base + before + skew;
  std::uint8_t* out = range - head;
  std::size_t pos = 0;  // in `around`
  for (const Slice& s : around.slices()) {
    const std::size_t first = pos < head ? std::min(s.size, head - pos) : 0;  // this slice's head bytes
    if (first) std::memcpy(out + pos, s.data, first);
    if (s.size > first) std::memcpy(out + pos + first + length, s.data + first, s.size - first);
    pos += s.size;
  }
  if (::mprotect(region, total, PROT_READ) < 0) {
    const int err = errno;
    ::munmap(region, total);
    throw std::system_error(err, std::generic_category(), "mprotect(PROT_READ)");
  }
  std::shared_ptr<const SealedMemfd> self = shared_from_this();
  auto owner = std::make_shared<Mapping>(region, total, self, range, length, offset, std::move(kept));
  Payload p;
  p.append(Slice{std::move(owner), out, head + length + tail});
  p.set_memfd_span(MemfdSpan{std::move(self), at, offset, length});
  return p;
}

std::optional<SealedMemfd::Found> SealedMemfd::mapped_at(const std::uint8_t* p, std::size_t n) {
  return MappedRanges::get().find(p, n);
}

Payload memfd_ready(const Payload& bytes, std::size_t inline_max) {
  const auto slices = bytes.slices();
  std::size_t largest = 0, at = 0, pos = 0;
  for (std::size_t i = 0; i < slices.size(); ++i) {
    if (slices[i].size > slices[largest].size) {
      largest = i;
      at = pos;
    }
    pos += slices[i].size;
  }
  if (slices.empty() || bytes.size() - slices[largest].size >= inline_max)
    return SealedMemfd::copy_of(bytes)->map();
  const Slice& big = slices[largest];
  if (auto found = SealedMemfd::mapped_at(big.data, big.size);
      found && found->length >= found->memfd->size() / 2 && bytes.size() - found->length < inline_max) {
    Payload out = bytes;
    out.set_memfd_span(MemfdSpan{std::move(found->memfd), at + found->skip, found->offset, found->length});
    return out;
  }
  Payload alone;
  alone.append(Slice{nullptr, big.data, big.size});
  Payload around;
  for (std::size_t i = 0; i < slices.size(); ++i)
    if (i != largest) around.append(slices[i]);
  return SealedMemfd::copy_of(alone)->map_into(around, at, 0, big.size);
}

PayloadBuffer::PayloadBuffer(std::size_t size) : fd_(new_memfd(size)), size_(size) {
  if (size == 0) return;
  void* a = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_.get(), 0);
  if (a == MAP_FAILED) throw_errno("mmap(memfd, PROT_WRITE)");
  addr_ = static_cast<std::uint8_t*>(a);
}

PayloadBuffer::PayloadBuffer(PayloadBuffer&& o) noexcept
    : fd_(std::move(o.fd_)), addr_(o.addr_), size_(o.size_) {
  o.addr_ = nullptr;
  o.size_ = 0;
}

PayloadBuffer::~PayloadBuffer() {
  if (addr_) ::munmap(addr_, size_);
}

Payload PayloadBuffer::seal(View view) && {
  if (!fd_) throw Error("PayloadBuffer::seal(): the buffer was already sealed");
  // The kept view, at the same address: a private copy-on-write mapping of
  // `fd`, which shows its bytes and, from then on, only this process's writes.
  auto keep_private_view_of = [this](int fd) {
    if (::mmap(addr_, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0) == MAP_FAILED)
      throw_errno("mmap(memfd, MAP_PRIVATE | MAP_FIXED)");
  };
  // F_SEAL_WRITE is refused (EBUSY) while a writable shared mapping exists;
  // a private one does not count (only VM_SHARED mappings can write back).
  if (addr_ && view == View::kKeepPrivate) {
    keep_private_view_of(fd_.get());
  } else if (addr_) {
    if (::munmap(addr_, size_) < 0) throw_errno("munmap(memfd)");
    addr_ = nullptr;
  }
  // A process forked while this buffer was open still maps it writable (or
  // the kernel holds a page): the message is then a sealed copy of the bytes
  // as they are now. Slower, never wrong; the usual case costs no copy.
  UniqueFd sealed;
  if (try_seal(fd_.get())) {
    sealed = std::move(fd_);
  } else {
    sealed = sealed_copy_of(fd_.get(), size_);
    // A kept view of the old memfd would still show, in every page it has
    // not written, what the forked process writes there: it maps the copy.
    if (addr_) keep_private_view_of(sealed.get());
  }
  fd_.reset();
  auto memfd = std::make_shared<SealedMemfd>(std::move(sealed), size_);
  if (!addr_) size_ = 0;
  return memfd->map();
}

}  // namespace spindle
