#include "kernels.hpp"

#include <cstring>

#include "errors.hpp"

#define XXH_INLINE_ALL
#include <xxhash.h>

namespace foresight {
namespace {

// True when [offset, offset + length) lies inside [0, size), without overflow.
bool inside(int64_t offset, int64_t length, size_t size) {
    return offset >= 0 && length >= 0 && static_cast<uint64_t>(offset) <= size &&
           static_cast<uint64_t>(length) <= size - static_cast<uint64_t>(offset);
}

}  // namespace

void xxh3_batch(const uint8_t* data, size_t size, const int64_t* offset, const int64_t* length, size_t n,
                uint64_t* out) {
    for (size_t i = 0; i < n; ++i)
        if (!inside(offset[i], length[i], size))
            throw InputError(cat("xxh3_batch: slice ", i, " (offset ", offset[i], ", length ", length[i],
                                 ") is outside the buffer of ", size, " bytes"));
    for (size_t i = 0; i < n; ++i) out[i] = XXH3_64bits(data + offset[i], static_cast<size_t>(length[i]));
}

int64_t gather(const uint8_t* src, size_t src_size, const int64_t* src_offset, const int64_t* length,
               const int64_t* dst_offset, size_t n, uint8_t* dst, size_t dst_size) {
    int64_t at = 0;
    for (size_t i = 0; i < n; ++i) {
        if (!inside(src_offset[i], length[i], src_size))
            throw InputError(cat("gather: piece ", i, " (offset ", src_offset[i], ", length ", length[i],
                                 ") is outside the source of ", src_size, " bytes"));
        const int64_t to = dst_offset ? dst_offset[i] : at;
        if (!inside(to, length[i], dst_size))
            throw InputError(cat("gather: piece ", i, " (", length[i], " bytes to destination offset ", to,
                                 ") does not fit the destination of ", dst_size, " bytes"));
        at = to + length[i];
    }
    int64_t copied = 0;
    at = 0;
    for (size_t i = 0; i < n; ++i) {
        const int64_t to = dst_offset ? dst_offset[i] : at;
        std::memmove(dst + to, src + src_offset[i], static_cast<size_t>(length[i]));
        at = to + length[i];
        copied += length[i];
    }
    return copied;
}

}  // namespace foresight
