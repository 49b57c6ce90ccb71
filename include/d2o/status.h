// Status and Result<T>: how every fallible operation in d2o reports failure.
//
// Anything that comes from outside the process (model files, tokenizer data, CLI flags, HTTP
// bodies, sizes) is validated and, when wrong, reported as a Status whose message says what was
// wrong and, where possible, what to do about it. Library code never aborts on bad input; internal
// invariants use D2O_ASSERT (src/core/assert.h) instead.
#pragma once

#include <optional>
#include <string>
#include <utility>

namespace d2o {

enum class StatusCode {
  kOk = 0,
  kInvalidArgument,    // a flag, spec, token id, size ... is not acceptable
  kNotFound,           // a file, key or tensor is missing
  kIoError,            // the OS refused (open, read, mmap)
  kFormatError,        // a file is malformed (bad magic, truncated, out-of-bounds offsets)
  kUnsupported,        // well-formed but not handled (architecture, tensor type, version)
  kResourceExhausted,  // a memory cap or context limit would be exceeded
  kInternal,           // a bug: should not happen
};

const char* status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

  static Status ok_status() { return Status(); }
  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }
  // "format error: <message>", for printing.
  std::string to_string() const;

  // Prepends context ("loading model.gguf: ") to the message; keeps the code.
  Status with_context(const std::string& context) const {
    if (ok()) return *this;
    return Status(code_, context + ": " + message_);
  }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

inline Status invalid_argument(std::string m) { return {StatusCode::kInvalidArgument, std::move(m)}; }
inline Status not_found(std::string m) { return {StatusCode::kNotFound, std::move(m)}; }
inline Status io_error(std::string m) { return {StatusCode::kIoError, std::move(m)}; }
inline Status format_error(std::string m) { return {StatusCode::kFormatError, std::move(m)}; }
inline Status unsupported(std::string m) { return {StatusCode::kUnsupported, std::move(m)}; }
inline Status resource_exhausted(std::string m) {
  return {StatusCode::kResourceExhausted, std::move(m)};
}
inline Status internal_error(std::string m) { return {StatusCode::kInternal, std::move(m)}; }

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : value_(std::move(value)) {}  // NOLINT(google-explicit-constructor)
  Result(Status status) : status_(std::move(status)) {  // NOLINT(google-explicit-constructor)
    if (status_.ok()) status_ = internal_error("Result constructed from an OK status");
  }

  bool ok() const { return value_.has_value(); }
  const Status& status() const { return status_; }
  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }

 private:
  std::optional<T> value_;
  Status status_;
};

}  // namespace d2o

#define D2O_CONCAT_INNER_(a, b) a##b
#define D2O_CONCAT_(a, b) D2O_CONCAT_INNER_(a, b)

// Returns the Status from the enclosing function when `expr` is not OK.
#define D2O_RETURN_IF_ERROR(expr)              \
  do {                                         \
    ::d2o::Status d2o_status_ = (expr);        \
    if (!d2o_status_.ok()) return d2o_status_; \
  } while (0)

// `D2O_ASSIGN_OR_RETURN(auto x, make_x());` unwraps a Result or returns its Status.
#define D2O_ASSIGN_OR_RETURN(lhs, expr) \
  D2O_ASSIGN_OR_RETURN_IMPL_(D2O_CONCAT_(d2o_result_, __LINE__), lhs, expr)
#define D2O_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                               \
  if (!tmp.ok()) return tmp.status();              \
  lhs = std::move(tmp).value()
