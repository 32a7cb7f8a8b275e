#include "broker/errors.h"

#include <string.h>

namespace spindle {

const char* errno_text(int err) {
  const char* d = ::strerrordesc_np(err);
  return d ? d : "unknown error";
}

}  // namespace spindle
