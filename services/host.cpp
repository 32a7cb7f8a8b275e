// The thread that receives a request (the broker for a peer's, the caller's
// own for a call from this process) decodes the envelope (a bounded copy of
// the names) only to pick the lane; the worker decodes it again rather than
// carrying a decoded copy through the lane, which holds plain Messages.
// Policies run on the worker too: a custom predicate is user code and may be
// slow. Picking the lane takes only the host's mutex and the lane set's, so
// the handler may run on any thread: a local call reaches a worker with one
// wake-up, not two (caller to broker, broker to worker).
#include "services/host.h"

#include <thread>

#include <fmt/format.h>

#include "broker/errors.h"
#include "broker/log.h"
#include "services/envelope.h"
#include "services/reasons.h"

namespace spindle::services {

ServiceHost::ServiceHost(Router& router, Pool& pool, std::vector<std::unique_ptr<Service>> initial)
    : router_(router), pool_(pool) {
  if (!pool_.attached_broker()) pool_.attach(router_.broker());
  for (auto& s : initial) add(std::move(s));
  HandlerOptions anywhere;
  anywhere.any_thread = true;
  // Both sides store, then load the other's flag, all seq_cst: either the
  // caller sees the entrance closed, or the destructor sees it inside.
  // The count drops however the handler ends (it may throw): a count left
  // behind would hold the destructor forever.
  auto handler = [this, gate = entrance_, &router = router_](Message&& m) {
    struct Inside {
      Entrance& e;
      explicit Inside(Entrance& en) : e(en) { e.inside.fetch_add(1); }
      ~Inside() { e.inside.fetch_sub(1); }
    } inside(*gate);
    if (gate->closed.load()) return send_dead_reply(router, m, reason::kShuttingDown);
    on_request(std::move(m));
  };
  handle_ = router_.add_handler(std::move(handler), anywhere, kHandleCallService);
  if (handle_ == 0) throw Error("CALL_SERVICE (110) already has a handler on this router");
  // Services outlive the workers: on_shutdown runs once they have all left.
  // It is user code, so it runs outside mu_: it may call back into the host
  // (find(), names(), add()), which would deadlock on a mutex held here.
  // Hosted services are never removed, so the pointers stay valid.
  pool_.on_stopped([this] {
    std::vector<std::pair<std::string, Service*>> hosted;
    {
      std::lock_guard lk(mu_);
      for (auto& [name, e] : services_) hosted.emplace_back(name, e.service.get());
    }
    for (auto& [name, svc] : hosted) {
      try {
        svc->on_shutdown();
      } catch (const std::exception& ex) {
        log().error("service {}: on_shutdown threw: {}", name, ex.what());
      } catch (...) {
        // Not left to the pool's catch: the other services' on_shutdown still runs.
        log().error("service {}: on_shutdown threw a non-std exception", name);
      }
    }
  });
}

ServiceHost::~ServiceHost() {
  entrance_->closed.store(true);
  while (entrance_->inside.load() > 0) std::this_thread::yield();
  pool_.stop();
  del_handler_on_broker(router_, handle_);
}

Service& ServiceHost::add(std::unique_ptr<Service> service) {
  if (!service) throw Error("ServiceHost::add: no service");
  Service& svc = *service;
  std::lock_guard lk(mu_);
  if (services_.count(svc.name())) throw Error(fmt::format("service {} is already hosted", svc.name()));
  LaneOptions lo;
  lo.name = svc.name();
  lo.serialized = svc.mode() == RunMode::kSerialized;
  Lane& lane = pool_.add_lane(
      std::move(lo), [this, &svc](Message&& m) { run(svc, std::move(m)); },
      [this](Message&& m, std::string_view why) { reject(m, why); });
  services_.emplace(svc.name(), Entry{std::move(service), &lane});
  return svc;
}

Service* ServiceHost::find(std::string_view name) const {
  std::lock_guard lk(mu_);
  auto it = services_.find(name);
  return it == services_.end() ? nullptr : it->second.service.get();
}

std::vector<std::string> ServiceHost::names() const {
  std::lock_guard lk(mu_);
  std::vector<std::string> out;
  for (auto& [name, e] : services_) out.push_back(name);
  return out;
}

HostStats ServiceHost::stats() const {
  return HostStats{received_.load(), answered_.load(), rejected_.load()};
}

void ServiceHost::reject(const Message& m, std::string_view why) {
  ++rejected_;
  // `why` carries the caller's own bytes (the service or method name it
  // asked for): escaped ({:?}), so one record stays one line whatever they
  // hold. The dead reply carries them as they came: they are the caller's.
  log().debug("service call from context {} rejected: {:?}", m.header.src_id, why);
  send_dead_reply(router_, m, why);
}

void ServiceHost::on_request(Message&& m) {
  ++received_;
  DecodeResult d = decode_call(m.data);
  if (!d.ok()) return reject(m, d.error);
  Lane* lane = nullptr;
  Service* svc = nullptr;
  {
    std::lock_guard lk(mu_);
    auto it = services_.find(d.envelope.service);
    if (it != services_.end()) {
      lane = it->second.lane;
      svc = it->second.service.get();
    }
  }
  if (!lane) return reject(m, fmt::format("{}: {}", reason::kUnknownService, d.envelope.service));
  // Methods are all exposed before the service is hosted: find() reads a
  // map nobody writes any more.
  if (svc->mode() == RunMode::kConcurrent)
    if (const Service::Exposed* ex = svc->find(d.envelope.method); ex && ex->on_receiver)
      return run(*svc, std::move(m));
  const Router::ShareKey key = router_.share_key(m.header.auth_id);
  pool_.submit(*lane, std::move(m), key.sender, key.uid);
}

void ServiceHost::run(Service& svc, Message&& m) {
  DecodeResult d = decode_call(m.data);
  if (!d.ok()) return reject(m, d.error);  // cannot happen: checked on arrival
  const Service::Exposed* method = svc.find(d.envelope.method);
  if (!method)
    return reject(m, fmt::format("{}: {}.{}", reason::kUnknownMethod, svc.name(), d.envelope.method));
  if (d.envelope.msgpack() != (method->encoding == Encoding::kMsgpack))
    return reject(m, fmt::format("{}: {}.{} takes {} arguments; the call sent {}",
                                 reason::kWrongEncoding, svc.name(), d.envelope.method,
                                 method->encoding == Encoding::kMsgpack ? "msgpack" : "raw",
                                 d.envelope.msgpack() ? "msgpack" : "raw"));
  Caller caller{m.header.src_id, m.header.auth_id, router_.id(), router_.parent_id()};
  if (!method->access.allows(caller))
    return reject(m, fmt::format("{}: {}.{} ({}) refused context {}", reason::kRefused, svc.name(),
                                 d.envelope.method, method->access.description(), caller.auth_id));
  ++answered_;
  Message head;
  head.header = m.header;  // the request minus its bytes: the args share them
  head.fds = std::move(m.fds);  // fd arguments of a typed call (<spindle/codec.h>)
  head.sender_charge = std::move(m.sender_charge);  // held until the answer goes (ReplyState)
  Request req(router_, std::move(head), caller, svc.name(), std::move(d.envelope.method),
              std::move(d.envelope.args));
  svc.run(req, *method);
}

}  // namespace spindle::services
