// Extent coalescing: one step's extents (file, offset, length) -> few large aligned transfers,
// plus where each extent's first byte lands in one contiguous destination region.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace foresight {

struct CoalesceOptions {
    int64_t max_gap = 0;              // merge neighbours when the bytes read in between (aligned) are <= this
    int64_t max_transfer = 1 << 20;   // a merged transfer stays <= this; one longer extent is its own
                                      // transfer (below align: no merging, one transfer per extent)
    int64_t align = 4096;             // power of two; transfer offsets, lengths and destinations are multiples
    const int64_t* file_sizes = nullptr;  // optional, num_files entries: extents must lie inside their file
    size_t num_files = 0;
};

// Transfer k reads file[k] bytes [offset[k], offset[k] + length[k]) into region[dest[k] :][: length[k]].
// length[k] is a multiple of align, so the read may run past the end of the file; the reader must accept
// a short read that delivers at least needed[k] bytes (everything any extent asked for).
// Extent i is region[extent_dest[i] :][: its length] (0 for zero-length extents, which cause no read).
// Transfers that continue each other in the file also continue each other in the region, which is how
// an extent may span two of them (when merging would exceed max_transfer) and still be one view.
struct Transfers {
    std::vector<int32_t> file;
    std::vector<int64_t> offset, length, needed, dest;
    std::vector<int64_t> extent_dest;
    int64_t total_bytes = 0;      // size of the destination region
    int64_t requested_bytes = 0;  // sum of extent lengths (duplicates counted each time)
    int64_t read_bytes = 0;       // sum of transfer lengths
};

// O(n log n). Throws InputError for bad arguments and FormatError for an extent past its file's end.
Transfers coalesce(const int32_t* file, const int64_t* offset, const int64_t* length, size_t n,
                   const CoalesceOptions& options);

}  // namespace foresight
