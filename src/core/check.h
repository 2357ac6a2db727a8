// The one check family of dstrain.
//
//   DSTRAIN_CHECK(cond) << "context";       internal invariant; throws dstrain::Error with
//                                           statement, file:line, device and rank
//   DSTRAIN_USER_CHECK(cond) << "sentence"; a user's mistake (flag, file, size); throws
//                                           dstrain::UserError whose what() is the sentence alone
//   DSTRAIN_USER_ERROR() << "sentence";     the same, unconditionally
//
// A library never exits: only main turns these into a message and an exit code.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace dstrain {

// Internal failure (a bug, a broken invariant, a failed system call).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A user's mistake: what() is one clear sentence saying what to do.
class UserError : public Error {
 public:
  using Error::Error;
};

// Who is running: set by each rank thread so errors can name rank and device.
struct ErrorContext {
  int rank = -1;           // -1: not inside a rank
  std::string device;      // "cpu:0", "cuda:3"; empty when unknown
};
ErrorContext& thread_error_context();

namespace detail {

class CheckMessage {
 public:
  CheckMessage(const char* file, int line, const char* expr, bool user_error)
      : file_(file), line_(line), expr_(expr), user_error_(user_error) {}
  template <class T>
  CheckMessage& operator<<(const T& value) {
    stream_ << value;
    return *this;
  }
  [[noreturn]] void raise() const;

 private:
  const char* file_;
  int line_;
  const char* expr_;
  bool user_error_;
  std::ostringstream stream_;
};

struct CheckThrower {
  // `&` binds looser than `<<`, so the whole message is built before raise().
  [[noreturn]] void operator&(const CheckMessage& message) const { message.raise(); }
};

}  // namespace detail
}  // namespace dstrain

#define DSTRAIN_CHECK(cond)   \
  if (cond) {                 \
  } else                      \
    ::dstrain::detail::CheckThrower() & \
        ::dstrain::detail::CheckMessage(__FILE__, __LINE__, #cond, false)

#define DSTRAIN_USER_CHECK(cond) \
  if (cond) {                    \
  } else                         \
    ::dstrain::detail::CheckThrower() & \
        ::dstrain::detail::CheckMessage(__FILE__, __LINE__, #cond, true)

#define DSTRAIN_USER_ERROR() DSTRAIN_USER_CHECK(false)
