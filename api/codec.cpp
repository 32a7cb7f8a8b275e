// The check before unpacking: msgpack-c++ allocates a container's elements
// when it reads the container's header, trusting the count it declares. A
// walk over the bytes first keeps a count of the values still owed; every
// value needs at least one byte, so a count above the bytes left cannot be
// honest and the input is refused before anything is allocated. The walk is
// iterative (no recursion a deep input could overflow) and O(size).
//
// Fd arguments: encode_args() packs the fds' indexes and hands the fds to
// payload_of(), which keeps them in the Payload's owner, so they close with
// the Payload if it is never sent. The owner is made with a deleter of its
// own type: std::get_deleter recognises it in fds_of(), which is how
// Context::start_call finds the fds of arguments that were encoded earlier
// (an Asio deferred call encodes at once and sends when awaited).
#include "spindle/codec.h"

#include <memory>
#include <string>

#include <fmt/format.h>

namespace spindle::detail {
namespace {

std::uint64_t read_be(const std::uint8_t* p, int n) {
  std::uint64_t v = 0;
  for (int i = 0; i < n; ++i) v = (v << 8) | p[i];
  return v;
}

// "" when `b` holds exactly one msgpack value whose containers declare no
// more elements than there are bytes; otherwise what is wrong.
std::string check_shape(std::span<const std::uint8_t> b) {
  std::uint64_t owed = 1;  // values still to read
  std::size_t i = 0;
  const std::size_t n = b.size();
  auto need = [&](std::uint64_t k) { return k <= n - i; };
  while (owed > 0) {
    if (i >= n) return "truncated";
    const std::uint8_t t = b[i++];
    --owed;
    std::uint64_t skip = 0, children = 0;
    if (t <= 0x7f || t >= 0xe0 || (t >= 0xc0 && t <= 0xc3)) {
      // fixint, nil, bool: nothing follows
    } else if (t >= 0x80 && t <= 0x8f) {
      children = 2 * (t & 0x0f);
    } else if (t >= 0x90 && t <= 0x9f) {
      children = t & 0x0f;
    } else if (t >= 0xa0 && t <= 0xbf) {
      skip = t & 0x1f;
    } else {
      switch (t) {
        case 0xc1: return "byte 0xc1 is never used by msgpack";
        case 0xc4: case 0xc5: case 0xc6: case 0xd9: case 0xda: case 0xdb: {  // bin, str
          int w = (t == 0xc4 || t == 0xd9) ? 1 : (t == 0xc5 || t == 0xda) ? 2 : 4;
          if (!need(w)) return "truncated";
          skip = read_be(&b[i], w);
          i += w;
          break;
        }
        case 0xc7: case 0xc8: case 0xc9: {  // ext 8/16/32: length, type, data
          int w = t == 0xc7 ? 1 : t == 0xc8 ? 2 : 4;
          if (!need(w + 1)) return "truncated";
          skip = read_be(&b[i], w) + 1;
          i += w;
          break;
        }
        case 0xca: skip = 4; break;
        case 0xcb: skip = 8; break;
        case 0xcc: case 0xd0: skip = 1; break;
        case 0xcd: case 0xd1: skip = 2; break;
        case 0xce: case 0xd2: skip = 4; break;
        case 0xcf: case 0xd3: skip = 8; break;
        case 0xd4: skip = 2; break;
        case 0xd5: skip = 3; break;
        case 0xd6: skip = 5; break;
        case 0xd7: skip = 9; break;
        case 0xd8: skip = 17; break;
        case 0xdc: case 0xdd: case 0xde: case 0xdf: {  // array 16/32, map 16/32
          int w = (t == 0xdc || t == 0xde) ? 2 : 4;
          if (!need(w)) return "truncated";
          children = read_be(&b[i], w) * ((t >= 0xde) ? 2 : 1);
          i += w;
          break;
        }
        default: return "unknown type byte";
      }
    }
    if (!need(skip)) return "truncated";
    i += skip;
    owed += children;
    if (owed > n - i) return "a container declares more elements than the input has bytes";
  }
  if (i != n) return "bytes left over after the value";
  return {};
}

thread_local FdEncoding* t_encoding = nullptr;
thread_local const FdSet* t_received = nullptr;

struct ArgsWithFds {
  msgpack::sbuffer bytes;
  FdSet fds;
};
// Its type is the tag fds_of() looks for.
struct ArgsWithFdsDeleter {
  void operator()(ArgsWithFds* a) const { delete a; }
};

}  // namespace

std::string msgpack_shape_problem(std::span<const std::uint8_t> bytes) { return check_shape(bytes); }

FdEncoding::FdEncoding() : outer_(t_encoding) { t_encoding = this; }
FdEncoding::~FdEncoding() { t_encoding = outer_; }
FdEncoding* FdEncoding::current() { return t_encoding; }

std::uint8_t FdEncoding::add(UniqueFd fd) {
  if (fds_.size() >= kMaxFdsPerMessage)
    throw Error(fmt::format("a call can pass at most {} fds (SCM_MAX_FD)", kMaxFdsPerMessage));
  fds_.push_back(std::move(fd));
  return static_cast<std::uint8_t>(fds_.size() - 1);
}

ReceivedFds::ReceivedFds(const FdSet& fds) : outer_(t_received) { t_received = &fds; }
ReceivedFds::~ReceivedFds() { t_received = outer_; }
const FdSet* ReceivedFds::current() { return t_received; }

namespace {
thread_local const CallingContext* t_caller = nullptr;
}  // namespace
CallingContext::CallingContext(std::uint32_t auth_id) : outer_(t_caller), auth_id_(auth_id) { t_caller = this; }
CallingContext::~CallingContext() { t_caller = outer_; }
std::optional<std::uint32_t> CallingContext::current() {
  if (!t_caller) return std::nullopt;
  return t_caller->auth_id_;
}

Payload payload_of(msgpack::sbuffer&& buf, std::vector<UniqueFd> fds) {
  std::shared_ptr<ArgsWithFds> owner(new ArgsWithFds{std::move(buf), FdSet(std::move(fds))},
                                     ArgsWithFdsDeleter{});
  Payload p;
  p.append(Slice{owner, reinterpret_cast<const std::uint8_t*>(owner->bytes.data()), owner->bytes.size()});
  return p;
}

FdSet fds_of(const Payload& args) {
  auto slices = args.slices();
  if (slices.size() != 1 || !std::get_deleter<ArgsWithFdsDeleter>(slices[0].owner)) return {};
  return static_cast<const ArgsWithFds*>(slices[0].owner.get())->fds;
}

Payload payload_of(msgpack::sbuffer&& buf) {
  auto owner = std::make_shared<msgpack::sbuffer>(std::move(buf));
  Payload p;
  p.append(Slice{owner, reinterpret_cast<const std::uint8_t*>(owner->data()), owner->size()});
  return p;
}

namespace {

// The value inside a whole-message padded value (kPaddedExtType), or `b`
// itself; `b` has passed check_shape, so an ext's length is within it.
std::span<const std::uint8_t> unpadded(std::span<const std::uint8_t> b, std::string& problem) {
  std::size_t len_bytes = 0;
  switch (b.empty() ? 0 : b[0]) {
    case 0xc7: len_bytes = 1; break;  // ext 8
    case 0xc8: len_bytes = 2; break;  // ext 16
    case 0xc9: len_bytes = 4; break;  // ext 32
    default: return b;
  }
  const std::size_t head = 1 + len_bytes + 1;
  if (static_cast<std::int8_t>(b[head - 1]) != kPaddedExtType) return b;
  std::span<const std::uint8_t> body = b.subspan(head);
  const std::size_t pad = body.size() < 2 ? 0 : read_be(body.data(), 2);
  if (body.size() < 2 || pad > body.size() - 2) {
    problem = "a padded value (ext type 83) whose pad runs past its end";
    return {};
  }
  std::span<const std::uint8_t> inner = body.subspan(2 + pad);
  problem = check_shape(inner);
  return inner;
}

}  // namespace

msgpack::object_handle unpack_checked(const Payload& bytes, std::string_view what) {
  std::string joined;
  std::span<const std::uint8_t> b = bytes.contiguous();
  if (b.empty() && !bytes.empty()) {
    joined = bytes.to_string();
    b = {reinterpret_cast<const std::uint8_t*>(joined.data()), joined.size()};
  }
  std::string problem = check_shape(b);
  if (problem.empty()) b = unpadded(b, problem);
  if (!problem.empty())
    throw DecodeError(std::string(what) + ": not one msgpack value (" + problem + ")");
  try {
    return msgpack::unpack(reinterpret_cast<const char*>(b.data()), b.size());
  } catch (const std::exception& e) {
    throw_decode_error(what, e);
  }
}

void throw_decode_error(std::string_view what, const std::exception& e) {
  throw DecodeError(std::string(what) + ": " + e.what());
}

}  // namespace spindle::detail

namespace spindle {

namespace {
void pack_fd_index(Packer& p, std::uint8_t index) {
  p.pack_ext(1, kFdExtType);
  const char byte = static_cast<char>(index);
  p.pack_ext_body(&byte, 1);
}
detail::FdEncoding& encoding() {
  detail::FdEncoding* e = detail::FdEncoding::current();
  // encode_args() sets one up for every method with a UniqueFd parameter.
  if (!e) throw Error("a UniqueFd is encoded only as an argument of a typed call");
  return *e;
}
}  // namespace

void codec<UniqueFd>::encode(Packer& p, UniqueFd&& fd) {
  if (!fd) {
    p.pack_nil();  // no fd: the callee gets an empty UniqueFd
    return;
  }
  pack_fd_index(p, encoding().add(std::move(fd)));
}

void codec<UniqueFd>::encode(Packer& p, const UniqueFd& fd) {
  if (!fd) {
    p.pack_nil();  // no fd: the callee gets an empty UniqueFd
    return;
  }
  detail::FdEncoding& e = encoding();
  pack_fd_index(p, e.add(dup_fd(fd.get())));
}

UniqueFd codec<UniqueFd>::decode(const msgpack::object& o) {
  if (o.type == msgpack::type::NIL) return UniqueFd();
  if (o.type != msgpack::type::EXT || o.via.ext.type() != kFdExtType || o.via.ext.size != 1)
    throw DecodeError("an fd argument is msgpack ext type 70 holding a one-byte index");
  const FdSet* fds = detail::ReceivedFds::current();
  if (!fds) throw DecodeError("an fd argument decodes only inside an exposed function's call");
  const auto index = static_cast<std::uint8_t>(o.via.ext.data()[0]);
  if (index >= fds->size())
    throw DecodeError(fmt::format("fd argument #{}, but the message carries {} fd(s) (did the sender's "
                                  "transport drop them?)",
                                  index, fds->size()));
  return dup_fd((*fds)[index]);  // ours; the message's copy closes with it
}

}  // namespace spindle
