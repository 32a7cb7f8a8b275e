// The names service: contexts find each other by name through a router.
//
//   names.register(name)  (msgpack, any caller)  names the caller (its
//                         auth_id) `name`: 1..64 bytes of [A-Za-z0-9._-].
//                         One name per context, unique among the living;
//                         a second name, or a name another holds, is a
//                         CallError. The name goes when its context does.
//   names.find(pattern)   (msgpack, any caller)  [[id, name], ...] of the
//                         names matching the glob `pattern` (* ? [], glob.h),
//                         sorted by name, at most kMaxFound.
// What a peer makes the router hold here is one bounded name per context.
//
// Thread safety: the methods run on pool workers (one mutex); the
// disconnect watcher on the broker thread.
// Ownership: the service borrows the Router, which must outlive its host.
#pragma once

#include <cstddef>
#include <memory>

#include "router/router.h"
#include "services/service.h"

namespace spindle::services {

inline constexpr const char* kNamesService = "names";
inline constexpr std::size_t kMaxNameSize = 64;
inline constexpr std::size_t kMaxFound = 4096;

std::unique_ptr<Service> make_names_service(Router& router);

}  // namespace spindle::services
