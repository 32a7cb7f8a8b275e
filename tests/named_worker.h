// A named router client for the names tests: connects under `name`, serves
// `upper` (which answers "<name>:<TEXT>") to anyone on a thread of its own,
// and closes and joins when it goes out of scope.
#pragma once

#include <algorithm>
#include <cctype>
#include <string>
#include <thread>

#include <spindle/connection.h>
#include <spindle/spindle.h>

namespace spindle::testutil {

inline constexpr method<std::string(std::string)> upper{"upper"};

struct Worker {
  Worker(const std::string& socket, const std::string& name)
      : conn(Connection::open(socket, {.name = name})) {
    conn.expose(upper, [name](std::string s) {
      std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::toupper(c); });
      return name + ":" + s;
    }, Allow::kAnyone);
    thread = std::thread([this] { conn.serve(); });
  }
  ~Worker() {
    conn.close();
    thread.join();
  }
  Connection conn;
  std::thread thread;
};

}  // namespace spindle::testutil
