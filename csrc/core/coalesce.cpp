#include "coalesce.hpp"

#include <algorithm>
#include <limits>

#include "errors.hpp"

namespace foresight {
namespace {

void check_options(const CoalesceOptions& o) {
    if (o.align < 1 || (o.align & (o.align - 1)) != 0)
        throw InputError(cat("coalesce: align must be a power of two >= 1, got ", o.align));
    if (o.max_gap < 0) throw InputError(cat("coalesce: max_gap must be >= 0, got ", o.max_gap));
    // max_transfer below align is allowed: it turns merging off (every transfer then exceeds it).
    if (o.max_transfer < 1) throw InputError(cat("coalesce: max_transfer must be >= 1, got ", o.max_transfer));
}

void check_extents(const int32_t* file, const int64_t* offset, const int64_t* length, size_t n,
                   const CoalesceOptions& o) {
    // Leave room to round the end up to align without overflow.
    const int64_t limit = std::numeric_limits<int64_t>::max() - o.align;
    for (size_t i = 0; i < n; ++i) {
        if (file[i] < 0) throw InputError(cat("coalesce: extent ", i, " has negative file index ", file[i]));
        if (offset[i] < 0) throw InputError(cat("coalesce: extent ", i, " has negative offset ", offset[i]));
        if (length[i] < 0) throw InputError(cat("coalesce: extent ", i, " has negative length ", length[i]));
        if (offset[i] > limit - length[i])
            throw InputError(cat("coalesce: extent ", i, " (offset ", offset[i], ", length ", length[i],
                                 ") overflows a 64-bit file position"));
        if (o.file_sizes) {
            if (static_cast<size_t>(file[i]) >= o.num_files)
                throw InputError(cat("coalesce: extent ", i, " names file ", file[i], " but file_sizes has ",
                                     o.num_files, " entries"));
            const int64_t size = o.file_sizes[file[i]];
            if (offset[i] + length[i] > size)
                throw FormatError(cat("coalesce: extent ", i, " (file ", file[i], ", offset ", offset[i],
                                      ", length ", length[i], ") ends at ", offset[i] + length[i],
                                      ", past the end of the file (", size, " bytes)"));
        }
    }
}

// Per file by offset; at equal offsets the longest first (the rest then fall inside it, whatever the input
// order); then input order, so keys are unique and std::sort is stable here.
struct Key {
    int64_t offset;
    int64_t length;
    size_t index;
    int32_t file;
    bool operator<(const Key& b) const {
        if (file != b.file) return file < b.file;
        if (offset != b.offset) return offset < b.offset;
        if (length != b.length) return length > b.length;
        return index < b.index;
    }
};

}  // namespace

Transfers coalesce(const int32_t* file, const int64_t* offset, const int64_t* length, size_t n,
                   const CoalesceOptions& o) {
    check_options(o);
    check_extents(file, offset, length, n, o);

    Transfers out;
    out.extent_dest.assign(n, 0);
    std::vector<Key> keys;
    keys.reserve(n);
    for (size_t i = 0; i < n; ++i) {
        out.requested_bytes += length[i];
        if (length[i] > 0) keys.push_back(Key{offset[i], length[i], i, file[i]});
    }
    std::sort(keys.begin(), keys.end());

    const int64_t A = o.align, G = o.max_gap, M = o.max_transfer;
    auto down = [A](int64_t x) { return x & ~(A - 1); };
    auto up = [A](int64_t x) { return (x + A - 1) & ~(A - 1); };

    bool open = false;
    int32_t cur_file = 0;
    int64_t cur_start = 0, cur_end = 0, cur_dest = 0;  // the open transfer: [cur_start, cur_end) -> cur_dest
    int64_t run_offset = 0, run_dest = 0;  // a run of file-contiguous transfers is also dest-contiguous
    int64_t raw_end = 0;                   // furthest byte any extent of the run asked for

    auto close_transfer = [&]() {
        out.file.push_back(cur_file);
        out.offset.push_back(cur_start);
        out.length.push_back(cur_end - cur_start);
        out.needed.push_back(std::min(raw_end, cur_end) - cur_start);
        out.dest.push_back(cur_dest);
        out.read_bytes += cur_end - cur_start;
        out.total_bytes = cur_dest + (cur_end - cur_start);  // lengths are multiples of A: stays aligned
    };
    auto open_transfer = [&](int32_t f, int64_t start, int64_t end, bool continues_run) {
        if (open) close_transfer();
        open = true;
        cur_file = f;
        cur_start = start;
        cur_end = end;
        cur_dest = out.total_bytes;
        if (!continues_run) {
            run_offset = start;
            run_dest = cur_dest;
            raw_end = 0;
        }
    };

    for (const Key& k : keys) {
        const int64_t s = k.offset, e = s + k.length;
        const int64_t bs = down(s), be = up(e);
        if (!open || k.file != cur_file) {
            open_transfer(k.file, bs, be, false);
        } else if (be <= cur_end) {
            // Already covered by the open transfer.
        } else if (bs < cur_end) {
            // Shares an aligned block with the open transfer: grow it, or continue right after it so
            // transfers never overlap (the extent then spans both, contiguous in the region too).
            if (be - cur_start <= M) cur_end = be;
            else open_transfer(k.file, cur_end, be, true);
        } else if (bs - cur_end <= G && be - cur_start <= M) {
            cur_end = be;  // read the gap rather than issue another I/O
        } else {
            open_transfer(k.file, bs, be, bs == cur_end);
        }
        raw_end = std::max(raw_end, e);
        out.extent_dest[k.index] = run_dest + (s - run_offset);
    }
    if (open) close_transfer();
    return out;
}

}  // namespace foresight
