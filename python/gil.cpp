// GilForSend: whether a send from Python keeps the GIL (binding.h says why).
//
// Thread: constructed and destroyed on the sending thread, which holds the
// GIL at both ends. The hook runs on that thread too, inside the send, never
// under a lock of ours (broker/wait_hook.h).
#include "binding.h"

namespace spindle::python {

GilForSend::GilForSend(const Payload& body) {
  if (body.size() > kKeepGilMax || body.memfd_span().memfd) {
    released_ = PyEval_SaveThread();
    return;
  }
  hook_.arg = this;
  hook_.release = [](void* self) {
    auto* g = static_cast<GilForSend*>(self);
    g->waiting_ = PyEval_SaveThread();
  };
  hook_.reacquire = [](void* self) {
    auto* g = static_cast<GilForSend*>(self);
    PyEval_RestoreThread(g->waiting_);
    g->waiting_ = nullptr;
  };
  scope_.emplace(hook_);
}

GilForSend::~GilForSend() {
  scope_.reset();
  if (released_) PyEval_RestoreThread(released_);
}

}  // namespace spindle::python
