// Batch byte kernels over one region: XXH3-64 of many slices, and gathering pieces into rows.
#pragma once
#include <cstddef>
#include <cstdint>

namespace foresight {

// out[i] = XXH3_64bits(data + offset[i], length[i]) (seed 0, the same as xxhash.xxh3_64_intdigest).
// Throws InputError naming the slice if it leaves [0, size).
void xxh3_batch(const uint8_t* data, size_t size, const int64_t* offset, const int64_t* length, size_t n,
                uint64_t* out);

// Copies piece i = src[src_offset[i] :][: length[i]] to dst[dst_offset[i]:] or, when dst_offset is null,
// right after piece i-1 (from dst byte 0). Returns the bytes copied. Checks every piece before copying
// anything. Pieces may overlap each other or src (memmove semantics per piece).
int64_t gather(const uint8_t* src, size_t src_size, const int64_t* src_offset, const int64_t* length,
               const int64_t* dst_offset, size_t n, uint8_t* dst, size_t dst_size);

}  // namespace foresight
