// One table, name -> id and id -> name, under a mutex that is held only to
// look up, add, erase or copy (the broker thread takes it too). A
// registration adds a disconnect watcher for its context (only if it is
// still routed: one that left meanwhile would never fire it), which erases
// the entry (a name can be taken again only once its holder has gone, so the
// check is by id).
#include "services/names.h"

#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "broker/errors.h"
#include "services/glob.h"
#include "spindle/codec.h"

namespace spindle::services {
namespace {

struct Table {
  std::mutex mu;
  std::map<std::string, std::uint32_t, std::less<>> by_name;
  std::map<std::uint32_t, std::string> by_id;
};

// A call's arguments are one msgpack string of at most kMaxNameSize bytes:
// anything longer is refused before it is decoded (decoding a body that
// came in several slices first joins them into one copy).
constexpr std::size_t kMaxArgsSize = kMaxNameSize + 16;

void check_args_size(const Request& r, std::string_view method) {
  if (r.args().size() > kMaxArgsSize)
    throw Error(fmt::format("names.{}: the arguments are {} bytes; a name or pattern is at most {}", method,
                            r.args().size(), kMaxNameSize));
}

bool valid_name(std::string_view n) {
  if (n.empty() || n.size() > kMaxNameSize) return false;
  for (char c : n)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-')) return false;
  return true;
}

}  // namespace

std::unique_ptr<Service> make_names_service(Router& router) {
  auto table = std::make_shared<Table>();
  auto s = std::make_unique<Service>(kNamesService, RunMode::kConcurrent);
  s->expose(
      "register", Access::any(),
      [table, &router](Request& r) {
        check_args_size(r, "register");
        auto [name] = detail::decode_args<std::string>(r.args());
        if (!valid_name(name))
          throw Error(fmt::format("names.register: a name is 1 to {} bytes of A-Z a-z 0-9 . _ -", kMaxNameSize));
        const std::uint32_t who = r.caller().auth_id;
        {
          std::lock_guard lk(table->mu);
          if (auto it = table->by_id.find(who); it != table->by_id.end())
            throw Error(fmt::format("names.register: context {} is already named {}", who, it->second));
          if (auto it = table->by_name.find(name); it != table->by_name.end())
            throw Error(fmt::format("names.register: {} is taken by context {}", name, it->second));
          table->by_name.emplace(name, who);
          table->by_id.emplace(who, name);
        }
        std::weak_ptr<Table> weak = table;
        auto erase = [weak, who](const std::string&) {
          auto t = weak.lock();
          if (!t) return;
          std::lock_guard lk(t->mu);
          auto it = t->by_id.find(who);
          if (it == t->by_id.end()) return;
          t->by_name.erase(it->second);
          t->by_id.erase(it);
        };
        // A caller that left while this ran would keep its name forever.
        if (!router.watch_if_routed(who, erase)) {
          erase({});
          throw Error(fmt::format("names.register: context {} is not connected", who));
        }
        return detail::encode_void();
      },
      Encoding::kMsgpack);
  s->expose(
      "find", Access::any(),
      [table](Request& r) {
        check_args_size(r, "find");
        auto [pattern] = detail::decode_args<std::string>(r.args());
        if (pattern.empty() || pattern.size() > kMaxNameSize)
          throw Error(fmt::format("names.find: a pattern is 1 to {} bytes", kMaxNameSize));
        // Matched on a copy: the broker thread takes the table's mutex when
        // a named context leaves, and must never wait for a scan.
        std::vector<std::tuple<std::uint32_t, std::string>> names, found;
        {
          std::lock_guard lk(table->mu);
          names.reserve(table->by_name.size());
          for (auto& [name, id] : table->by_name) names.emplace_back(id, name);
        }
        for (auto& entry : names) {
          if (found.size() == kMaxFound) break;
          if (glob_match(pattern, std::get<1>(entry))) found.push_back(std::move(entry));
        }
        return detail::encode_value(found);
      },
      Encoding::kMsgpack);
  return s;
}

}  // namespace spindle::services
