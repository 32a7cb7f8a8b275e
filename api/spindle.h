// <spindle/spindle.h>: everything a Spindle user needs, and nothing of the
// internals: no Asio, spdlog or Boost header is reached from here (CI checks
// it). Completion tokens are opt-in: <spindle/asio.h>.
//
// Start at docs/GUIDE.md.
#pragma once

#include <spindle/channel.h>
#include <spindle/child.h>
#include <spindle/codec.h>
#include <spindle/connection.h>
#include <spindle/context.h>
#include <spindle/errors.h>
#include <spindle/log.h>
#include <spindle/fds.h>
#include <spindle/message.h>
#include <spindle/method.h>
#include <spindle/options.h>
#include <spindle/payload.h>
#include <spindle/router_services.h>
#include <spindle/runtime.h>
#include <spindle/send_batch.h>
#include <spindle/slots.h>
#include <spindle/ssh.h>
#include <spindle/zygote.h>
