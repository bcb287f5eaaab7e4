// Exception types of foresight's C++ core; csrc/bindings/_core.cpp maps each to a Python class.
#pragma once
#include <stdexcept>
#include <string>
#include <type_traits>

namespace foresight {

// Bad arguments (negative length, mismatched sizes, bad option): Python ValueError.
struct InputError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

// Input that contradicts the data it describes (an extent past the end of its file):
// Python foresight.errors.FormatError.
struct FormatError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Use of an object after close(): Python ValueError, like I/O on a closed file.
struct ClosedError : std::logic_error {
    using std::logic_error::logic_error;
};

// A host resource could not be obtained (mmap failed): Python OSError with the errno text.
struct SystemError : std::runtime_error {
    int err;
    SystemError(const std::string& what, int err_) : std::runtime_error(what), err(err_) {}
};

namespace detail {
inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, const char* s) { out += s; }
inline void append(std::string& out, char c) { out += c; }
template <class T, class = std::enable_if_t<std::is_integral_v<T>>>
void append(std::string& out, T v) {
    out += std::to_string(v);
}
}  // namespace detail

// cat("coalesce: extent ", i, " has negative length ", n) -> one message string.
// Built from std::string and std::to_string only, never iostreams: a stream formats numbers through the
// locale's facets, which break when this module carries its own libstdc++ (-static-libstdc++) and another
// copy is loaded too (torch's): the message then stops at the first number, or the process crashes.
template <class... Parts>
std::string cat(const Parts&... parts) {
    std::string out;
    (detail::append(out, parts), ...);
    return out;
}

}  // namespace foresight
