// The built-in services' raw calls (services/client.h), behind a header that
// names none of the internals.
#include "spindle/router_services.h"

#include "services/builtin.h"
#include "services/client.h"

namespace spindle {

std::string router_ping(const Context& router, std::string_view text, std::chrono::milliseconds timeout) {
  return services::call_text(router, services::kPingService, services::kPingMethod, text, timeout);
}

std::string router_stats(const Context& router, std::chrono::milliseconds timeout) {
  return services::call_text(router, services::kStatsService, services::kStatsMethod, {}, timeout);
}

}  // namespace spindle
