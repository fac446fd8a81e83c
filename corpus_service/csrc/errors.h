// Engine exceptions. Each maps to one Python exception class in corpus_service/exceptions.py (all
// ValueError subclasses), so callers, and the gRPC layer choosing status codes, can tell them apart
// without reading messages.
#pragma once

#include <stdexcept>

namespace ngc {

struct UnknownRequest : std::invalid_argument {  // a request id that is not live
  using std::invalid_argument::invalid_argument;
};
struct AlreadyExists : std::invalid_argument {  // a live request id or corpus name taken again
  using std::invalid_argument::invalid_argument;
};
struct NotFound : std::invalid_argument {  // an external corpus that does not exist or is not loading
  using std::invalid_argument::invalid_argument;
};
struct LimitExceeded : std::length_error {  // a configured bound (requests, external tokens)
  using std::length_error::length_error;
};
struct StaleVersion : std::invalid_argument {  // a policy version older than the namespace's announced one
  using std::invalid_argument::invalid_argument;
};
struct CorruptSnapshot : std::runtime_error {  // a snapshot file refused before anything was built
  using std::runtime_error::runtime_error;
};

struct IOFailure : std::runtime_error {  // reading or writing a file failed (maps to OSError)
  using std::runtime_error::runtime_error;
};

}  // namespace ngc
