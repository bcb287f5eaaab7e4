// Exception types of foresight's C++ core; csrc/bindings/_core.cpp maps each to a Python class.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

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

// cat("coalesce: extent ", i, " has negative length ", n) -> one message string.
template <class... Parts>
std::string cat(const Parts&... parts) {
    std::ostringstream out;
    (out << ... << parts);
    return out.str();
}

}  // namespace foresight
