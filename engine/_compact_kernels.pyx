# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Compact plan loops: the keyed Feistel bijection, permuted block prefix sums, and the packer that
turns an item range into pieces on demand (see ``foresight.plan.compact`` and docs/formats.md).

Everything is integer arithmetic on uint64/int64, so results are identical on every machine. The
functions release the GIL; errors come back as negative codes that the Python side turns into
:class:`foresight.errors.PlanError` with the dataset, epoch and block named.

Example::

    import numpy as np
    from foresight import _compact_kernels
    x = np.arange(10, dtype=np.uint64)
    _compact_kernels.permute_many(x, 10, 12345)   # a permutation of 0..9, keyed by 12345
"""
from libc.stdint cimport int64_t, uint64_t, uint8_t, uint16_t, int32_t, uint32_t, uintptr_t
from posix.mman cimport MADV_WILLNEED, madvise, mincore
from posix.unistd cimport _SC_PAGESIZE, sysconf
from libc.string cimport memcpy
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_WRITABLE, PyBUF_C_CONTIGUOUS

# Token-count array element types, one code per dataset (the arrays are read through raw pointers so
# each dataset keeps its own dtype, e.g. a uint16 memmap for a huge corpus).
SIZE_U16, SIZE_I32, SIZE_U32, SIZE_I64 = 0, 1, 2, 3

# Error codes of pack_range (negative returns); info[0:4] = dataset, epoch, block position, block id.
cdef enum:
    # A block of at most this many documents is expanded at once when entered: its document ids first (pure
    # arithmetic), then their token counts in one gather loop whose loads the CPU overlaps, instead of one
    # dependent cache miss per document.
    BLOCK_BUFFER = 512

cdef enum:
    # Blocks ahead of a located position whose index pages are requested at once (MADV_WILLNEED), so a step whose
    # index is not in the page cache waits for its reads together rather than one after another.
    PREFETCH_BLOCKS = 64

cdef enum:
    # Packer.pack releases the GIL for windows of at least this many items (about 100 us and up). A step's share
    # (tens of items, a few us) keeps it: the loader's consumer thread would take it at once, and the pipeline
    # thread would then wait for it back (a thread switch each way, tens of us on a busy machine) for nothing.
    RELEASE_GIL_ITEMS = 2048

cdef uintptr_t PAGE_SIZE = <uintptr_t>sysconf(_SC_PAGESIZE)
cdef int _SIZE_BYTES[4]
_SIZE_BYTES[:] = [2, 4, 4, 8]

cdef enum:
    ERR_BLOCK_TOTAL = -1   # a block's documents do not add up to its stored total (token counts changed)
    ERR_EPOCHS = -2        # the stream ran past the plan's epochs (block prefix inconsistent)
    ERR_NEGATIVE = -3      # a negative token count


cdef inline uint64_t mix64(uint64_t z) noexcept nogil:
    """The splitmix64 finalizer."""
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline int half_bits(uint64_t m) noexcept nogil:
    """Half the bit width of the Feistel domain for [0, m): ceil(bit_length(m - 1) / 2), at least 1."""
    cdef uint64_t v = m - 1
    cdef int bits = 0
    while v:
        bits += 1
        v >>= 1
    bits = (bits + 1) // 2
    return bits if bits > 0 else 1


cdef inline uint64_t feistel(uint64_t x, uint64_t key, int half) noexcept nogil:
    """Four balanced Feistel rounds over [0, 2^(2*half))."""
    cdef uint64_t mask = (<uint64_t>1 << half) - 1
    cdef uint64_t left = x >> half
    cdef uint64_t right = x & mask
    cdef uint64_t f, j
    for j in range(4):
        f = mix64(key ^ ((j << 32) | right)) & mask
        f ^= left
        left = right
        right = f
    return (left << half) | right


cdef inline uint64_t permute(uint64_t x, uint64_t m, uint64_t key) noexcept nogil:
    """Position x of the keyed bijection of [0, m): Feistel with cycle-walking back into [0, m)."""
    if m <= 1:
        return 0
    cdef int half = half_bits(m)
    x = feistel(x, key, half)
    while x >= m:
        x = feistel(x, key, half)
    return x


cdef inline void feistel4(uint64_t* x, uint64_t key, int half) noexcept nogil:
    """``feistel`` of four values at once: four independent chains of multiplies in one loop body, which the CPU
    runs side by side (one chain alone waits on each multiply's latency)."""
    cdef uint64_t mask = (<uint64_t>1 << half) - 1
    cdef uint64_t l0 = x[0] >> half, l1 = x[1] >> half, l2 = x[2] >> half, l3 = x[3] >> half
    cdef uint64_t r0 = x[0] & mask, r1 = x[1] & mask, r2 = x[2] & mask, r3 = x[3] & mask
    cdef uint64_t f0, f1, f2, f3, j, jk
    for j in range(4):
        jk = key ^ (j << 32)  # feistel's key ^ ((j << 32) | right), the right half being below 2**32
        f0 = (mix64(jk ^ r0) & mask) ^ l0
        f1 = (mix64(jk ^ r1) & mask) ^ l1
        f2 = (mix64(jk ^ r2) & mask) ^ l2
        f3 = (mix64(jk ^ r3) & mask) ^ l3
        l0, l1, l2, l3 = r0, r1, r2, r3
        r0, r1, r2, r3 = f0, f1, f2, f3
    x[0] = (l0 << half) | r0
    x[1] = (l1 << half) | r1
    x[2] = (l2 << half) | r2
    x[3] = (l3 << half) | r3


cdef void permute_span(uint64_t lo, uint64_t hi, uint64_t m, uint64_t key, uint64_t* out) noexcept nogil:
    """``out[j - lo] = permute(j, m, key)`` for j in ``[lo, hi)``, at most BLOCK_BUFFER of them (a block's slot order,
    a batch of block ids): every position's first Feistel pass, then the cycle-walks of those still outside [0, m),
    one pass over the list of them at a time, four values per ``feistel4``. One by one, each value waits on its
    chain of multiplies and a branch taken about half the time (a domain up to 4x m) is mispredicted as often;
    here neither (about 2x faster over a block of 128 slots, 2.5x over 4096 block ids)."""
    cdef uint32_t pending[BLOCK_BUFFER]
    cdef uint64_t v[4]
    cdef Py_ssize_t n = <Py_ssize_t>(hi - lo), j, t, i, left, kept, rest
    cdef int half
    if m <= 1:
        for j in range(n):
            out[j] = 0
        return
    half = half_bits(m)
    for j in range(n):
        out[j] = lo + <uint64_t>j
        pending[j] = <uint32_t>j
    left = n
    while left:
        rest = left - left % 4
        for t in range(0, rest, 4):
            for i in range(4):
                v[i] = out[pending[t + i]]
            feistel4(v, key, half)
            for i in range(4):
                out[pending[t + i]] = v[i]
        for t in range(rest, left):
            out[pending[t]] = feistel(out[pending[t]], key, half)
        kept = 0
        for t in range(left):
            j = pending[t]
            pending[kept] = <uint32_t>j
            kept += out[j] >= m
        left = kept


def permute_span_many(uint64_t lo, uint64_t hi, uint64_t m, uint64_t key) -> object:
    """``permute(j, m, key)`` for j in ``[lo, hi)`` through ``permute_span`` (batches of BLOCK_BUFFER); for tests."""
    import numpy as np
    if not lo <= hi <= m:
        raise ValueError("permute_span_many: need lo <= hi <= m")
    out_arr = np.empty(hi - lo, dtype=np.uint64)
    cdef uint64_t[::1] out = out_arr
    cdef uint64_t a = lo, b
    with nogil:
        while a < hi:
            b = a + BLOCK_BUFFER if a + BLOCK_BUFFER < hi else hi
            permute_span(a, b, m, key, &out[0] + (a - lo))
            a = b
    return out_arr


cdef inline int64_t size_at(const void* base, int code, int64_t i) noexcept nogil:
    if code == 0:
        return (<const uint16_t*>base)[i]
    if code == 1:
        return (<const int32_t*>base)[i]
    if code == 2:
        return (<const uint32_t*>base)[i]
    return (<const int64_t*>base)[i]


def permute_many(const uint64_t[::1] x, uint64_t m, uint64_t key) -> object:
    """The bijection of [0, m) keyed by ``key`` applied to each of ``x`` (all < m)."""
    import numpy as np
    out_arr = np.empty(x.shape[0], dtype=np.uint64)
    cdef uint64_t[::1] out = out_arr
    cdef Py_ssize_t i
    for i in range(x.shape[0]):
        if x[i] >= m:
            raise ValueError(f"x[{i}] = {x[i]} is not below m = {m}")
    with nogil:
        for i in range(x.shape[0]):
            out[i] = permute(x[i], m, key)
    return out_arr


def block_prefix(const int64_t[::1] totals, uint64_t key, int64_t[::1] out) -> None:
    """``out[k + 1] = out[k] + totals[perm(k)]``, ``out[0] = 0``: the token prefix sums of the blocks
    in their permuted order (``perm`` is the bijection of [0, len(totals)) keyed by ``key``)."""
    cdef Py_ssize_t nb = totals.shape[0]
    cdef Py_ssize_t k, lo, hi
    cdef int64_t acc = 0
    cdef uint64_t idx[BLOCK_BUFFER]
    if out.shape[0] != nb + 1:
        raise ValueError("block_prefix: out must have len(totals) + 1 entries")
    with nogil:
        out[0] = 0
        # a batch of block ids first (pure arithmetic), then their totals in one gather loop whose cache misses
        # the CPU overlaps (totals of a large corpus are far bigger than the cache)
        lo = 0
        while lo < nb:
            hi = lo + BLOCK_BUFFER if lo + BLOCK_BUFFER < nb else nb
            permute_span(lo, hi, nb, key, idx)
            for k in range(lo, hi):
                acc += totals[<Py_ssize_t>idx[k - lo]]
                out[k + 1] = acc
            lo = hi


def add_rows(uint64_t base, int code, int64_t count, int64_t[::1] totals) -> int64_t:
    """``totals[k % nb] += sizes[k]`` for the ``count`` token counts at address ``base`` (element type ``code``,
    ``nb = len(totals)``; the first belongs to block 0): one chunk of whole rows of a dataset's counts. Tiled by
    columns so each tile of ``totals`` stays in cache while the chunk's rows are added into it. Returns the
    index of the first negative count, or -1."""
    cdef int64_t nb = totals.shape[0]
    cdef int64_t rows = (count + nb - 1) // nb if nb else 0
    cdef int64_t c0, c1, r, c, row_end, v
    cdef int64_t tile = 16384
    cdef const void* p = <const void*>base
    cdef int64_t bad = -1
    if nb == 0:
        return -1
    with nogil:
        c0 = 0
        while c0 < nb:
            c1 = c0 + tile if c0 + tile < nb else nb
            for r in range(rows):
                row_end = count - r * nb
                if row_end <= c0:
                    break
                if row_end > c1:
                    row_end = c1
                if code == 0:
                    for c in range(c0, row_end):
                        totals[c] += (<const uint16_t*>p)[r * nb + c]
                elif code == 2:
                    for c in range(c0, row_end):
                        totals[c] += (<const uint32_t*>p)[r * nb + c]
                else:
                    for c in range(c0, row_end):
                        v = size_at(p, code, r * nb + c)
                        if v < 0 and (bad < 0 or r * nb + c < bad):
                            bad = r * nb + c
                        totals[c] += v
            c0 = c1
    return bad


cdef inline int64_t tile_blocks(int64_t length, int64_t group, int64_t tile) noexcept nogil:
    """Blocks of a tile of ``length`` documents: ``group`` for a whole one; a shorter last tile (then ``tile`` is
    ``group * S``) keeps blocks of about S documents: ``ceil(length / S)``."""
    cdef int64_t per_block
    if length >= tile:
        return group
    per_block = tile // group
    return (length + per_block - 1) // per_block


cpdef int64_t tiled_blocks(int64_t n, int64_t group, int64_t tile) noexcept nogil:
    """Blocks of n documents in tiles of ``tile`` documents, ``group`` blocks per tile (``tile_blocks``: a shorter
    last tile has blocks of about ``tile / group`` documents, as many as it takes)."""
    cdef int64_t full = n // tile
    cdef int64_t rest = n - full * tile
    return full * group + (tile_blocks(rest, group, tile) if rest else 0)


def add_tiles(uint64_t base, int code, int64_t first, int64_t count, int64_t n, int64_t group, int64_t tile,
              int64_t[::1] totals) -> int64_t:
    """``totals[block(i)] += sizes[i]`` for documents ``i`` in ``[first, first + count)``, whose token counts
    start at address ``base`` (element type ``code``); ``first`` is a multiple of ``tile``. ``block(i)`` is the
    tiled layout's (``block_layout``): one sequential pass, each tile's ``group`` totals in cache. Returns the
    index of the first negative count, or -1."""
    cdef int64_t i, t, w, g, length, start, bad = -1, v, row, c
    cdef int64_t* out
    cdef const void* p = <const void*>base
    if first % tile or first + count > n or count < 0:
        raise ValueError("add_tiles: the range must start at a tile and lie within the dataset")
    if totals.shape[0] != tiled_blocks(n, group, tile):
        raise ValueError("add_tiles: totals must have one entry per block")
    with nogil:
        i = 0
        while i < count:
            t = (first + i) // tile
            start = t * tile
            length = n - start if n - start < tile else tile
            g = tile_blocks(length, group, tile)
            out = &totals[0] + t * group
            if start + length > first + count:
                length = first + count - start
            w = 0
            while w < length:   # rows of g documents: document w of the tile adds to the tile's block w % g
                row = g if g < length - w else length - w
                if code == 0:
                    for c in range(row):
                        out[c] += (<const uint16_t*>p)[i + w + c]
                else:
                    for c in range(row):
                        v = size_at(p, code, i + w + c)
                        if v < 0 and bad < 0:
                            bad = i + w + c
                        out[c] += v
                w += row
            i += length
    return bad


def min_positive_step(const int64_t[::1] a) -> int64_t:
    """The smallest ``a[i] - a[i - 1]`` that is > 0 (the fewest tokens of a non-empty block, over a segment of
    block prefix sums), or 0 if there is none."""
    cdef Py_ssize_t i
    cdef int64_t best = 0, d
    with nogil:
        for i in range(1, a.shape[0]):
            d = a[i] - a[i - 1]
            if d > 0 and (best == 0 or d < best):
                best = d
    return best


def first_decrease(const int64_t[::1] a) -> int64_t:
    """The first index i with ``a[i] < a[i - 1]``, or -1 (one pass at memory speed)."""
    cdef Py_ssize_t i
    cdef int64_t found = -1
    with nogil:
        for i in range(1, a.shape[0]):
            if a[i] < a[i - 1]:
                found = i
                break
    return found


cdef struct Cursor:
    int64_t epoch
    int64_t pos         # block position in the epoch's order
    int64_t block       # block id at that position
    int64_t count       # documents in that block
    int64_t first       # its first document (tile start + block's residue)
    int64_t stride      # documents between its slots (the tile's group width)
    uint64_t inner_key  # key of the in-block order
    int64_t slot        # position inside the block
    int64_t acc         # tokens of the block's earlier positions
    int64_t doc
    int64_t size
    int64_t off         # token offset inside doc (always < size)
    int64_t buffered    # the block's documents and sizes are in ids/sizes below (blocks of <= BLOCK_BUFFER)
    int64_t ids[BLOCK_BUFFER]
    int64_t sizes[BLOCK_BUFFER]


cdef struct Source:
    const void* sizes
    int code
    int64_t n
    int64_t nb
    int64_t group         # blocks per tile (format 2: nb, one tile)
    int64_t tile          # documents per tile (format 2: n)
    int64_t total
    int64_t epochs
    int64_t prefix_base   # offset of epoch 0's prefix in block_prefix; epoch e at + e * (nb + 1)
    int64_t key_base      # offset of epoch 0's keys in block_keys / inner_keys


cdef inline void block_layout(int64_t n, int64_t group, int64_t tile, int64_t block, int64_t* first,
                              int64_t* stride, int64_t* count) noexcept nogil:
    """Block ``block``'s documents: tile ``t = block // group`` holds documents ``[t*tile, t*tile + L)`` (L = tile, or
    what is left for the last), strided by its block count ``g = tile_blocks(L)``; residue ``r = block % group``
    holds ``t*tile + r + j*g`` for ``j < ceil((L - r) / g)``."""
    cdef int64_t t = block // group
    cdef int64_t base = t * tile
    cdef int64_t length = n - base if n - base < tile else tile
    cdef int64_t g = tile_blocks(length, group, tile)
    cdef int64_t r = block - t * group
    first[0] = base + r
    stride[0] = g
    count[0] = (length - r + g - 1) // g


cdef int enter_block(Cursor* c, const Source* s, const uint64_t* bkeys, const uint64_t* ikeys) noexcept nogil:
    c.block = <int64_t>permute(<uint64_t>c.pos, <uint64_t>s.nb, bkeys[s.key_base + c.epoch])
    block_layout(s.n, s.group, s.tile, c.block, &c.first, &c.stride, &c.count)
    c.inner_key = mix64(ikeys[s.key_base + c.epoch] ^ <uint64_t>c.block)
    c.slot = 0
    c.acc = 0
    cdef int64_t j
    c.buffered = c.count <= BLOCK_BUFFER
    if c.buffered:
        permute_span(0, <uint64_t>c.count, <uint64_t>c.count, c.inner_key, <uint64_t*>c.ids)
        for j in range(c.count):
            c.ids[j] = c.first + c.ids[j] * c.stride
        for j in range(c.count):
            c.sizes[j] = size_at(s.sizes, s.code, c.ids[j])
    return 0


cdef inline void load_doc(Cursor* c, const Source* s) noexcept nogil:
    if c.buffered:
        c.doc = c.ids[c.slot]
        c.size = c.sizes[c.slot]
        return
    c.doc = c.first + <int64_t>permute(<uint64_t>c.slot, <uint64_t>c.count, c.inner_key) * c.stride
    c.size = size_at(s.sizes, s.code, c.doc)


cdef int next_doc(Cursor* c, const Source* s, const int64_t* prefix, const uint64_t* bkeys,
                  const uint64_t* ikeys) noexcept nogil:
    """Move to the next document with at least one token, across blocks and epochs."""
    cdef const int64_t* p
    while True:
        c.acc += c.size
        c.slot += 1
        if c.slot == c.count:
            p = prefix + s.prefix_base + c.epoch * (s.nb + 1)
            if c.acc != p[c.pos + 1] - p[c.pos]:
                return ERR_BLOCK_TOTAL
            c.pos += 1
            if c.pos == s.nb:
                c.pos = 0
                c.epoch += 1
                if c.epoch >= s.epochs:
                    return ERR_EPOCHS
            enter_block(c, s, bkeys, ikeys)
        load_doc(c, s)
        if c.size < 0:
            return ERR_NEGATIVE
        if c.size > 0:
            c.off = 0
            return 0


cdef void prefetch_blocks(const Source* s, const int64_t* p, int64_t pos, int64_t u_end, uint64_t bkey) noexcept nogil:
    """Ask the kernel to read ahead the index entries of the blocks at positions ``pos..`` that start before token
    ``u_end`` of the epoch (at most PREFETCH_BLOCKS): one ``madvise(MADV_WILLNEED)`` per block, so their page faults
    overlap. Advisory (a hint changes no result; memory that is not a file mapping ignores it). Skipped for blocks
    strided further apart than a page (format 2), where a block's span is much of the index. A warm index costs one
    ``mincore``: when the first block's first page is resident the index is taken as cached and nothing is advised
    (a loader stepping through a cached plan paid ~5% of its throughput for advice it did not need)."""
    cdef int64_t first, stride, count, last = pos + PREFETCH_BLOCKS
    cdef uintptr_t item = <uintptr_t>_SIZE_BYTES[s.code], lo, hi
    cdef unsigned char resident = 0
    cdef bint checked = False
    while pos < s.nb and pos < last and p[pos] < u_end:
        block_layout(s.n, s.group, s.tile, <int64_t>permute(<uint64_t>pos, <uint64_t>s.nb, bkey), &first, &stride,
                     &count)
        if <uintptr_t>stride * item > PAGE_SIZE:
            return
        lo = <uintptr_t>s.sizes + <uintptr_t>first * item
        hi = <uintptr_t>s.sizes + <uintptr_t>(first + (count - 1) * stride + 1) * item
        lo -= lo % PAGE_SIZE
        if not checked:  # a failed mincore (not a mapping we can ask about) falls through to advising
            checked = True
            if mincore(<void*>lo, PAGE_SIZE, &resident) == 0 and resident & 1:
                return
        madvise(<void*>lo, hi - lo, MADV_WILLNEED)
        pos += 1


cdef int locate(Cursor* c, const Source* s, int64_t t, const int64_t* prefix, const uint64_t* bkeys,
                const uint64_t* ikeys, int64_t tokens_ahead) noexcept nogil:
    """Place the cursor at stream token t: epoch by division, block by a search of the epoch's prefix sums,
    document by walking the block's order from its start. The blocks of the next ``tokens_ahead`` tokens (this
    epoch's) are prefetched first."""
    cdef int64_t e = t // s.total
    cdef int64_t u = t - e * s.total
    cdef const int64_t* p
    cdef int64_t lo = 0, hi = s.nb, mid, off, guess, step
    if e >= s.epochs:
        return ERR_EPOCHS
    p = prefix + s.prefix_base + e * (s.nb + 1)
    # largest lo with p[lo] <= u (then p[lo + 1] > u). Block totals are alike, so p is close to a line: start at
    # the interpolated position and gallop out to a bracket, touching one or two pages of block_prefix where a
    # plain binary search touches about log2(nb) / 2 of them spread over the segment (page faults when cold).
    guess = <int64_t>(<double>u / <double>s.total * <double>s.nb)
    guess = 0 if guess < 0 else (s.nb - 1 if guess > s.nb - 1 else guess)
    step = 1
    if p[guess] <= u:
        lo = guess
        hi = guess + 1
        while p[hi] <= u:     # p[nb] = total > u ends it
            lo = hi
            hi = lo + step if lo + step < s.nb else s.nb
            step <<= 1
    else:
        hi = guess
        lo = guess - 1
        while p[lo] > u:      # p[0] = 0 <= u ends it
            hi = lo
            lo = hi - step if hi - step > 0 else 0
            step <<= 1
    while hi - lo > 1:
        mid = (lo + hi) >> 1
        if p[mid] <= u:
            lo = mid
        else:
            hi = mid
    c.epoch = e
    c.pos = lo
    if tokens_ahead > 0:
        prefetch_blocks(s, p, lo, u + tokens_ahead, bkeys[s.key_base + e])
    enter_block(c, s, bkeys, ikeys)
    return walk_to(c, s, u - p[lo])


cdef int walk_to(Cursor* c, const Source* s, int64_t off) noexcept nogil:
    """Move the cursor from the start of its current slot to the token ``off`` tokens past it, in its block
    (skipping empty documents)."""
    while True:
        if c.slot == c.count:
            return ERR_BLOCK_TOTAL
        load_doc(c, s)
        if c.size < 0:
            return ERR_NEGATIVE
        if off < c.size:
            c.off = off
            return 0
        off -= c.size
        c.acc += c.size
        c.slot += 1


cdef int seek_in_block(Cursor* c, const Source* s, int64_t t, const int64_t* prefix) noexcept nogil:
    """Move a placed cursor forward to stream token t when t lies in its block at or after its document's start
    (a rank's next share of a step, a few documents on): 1 when moved (or an error code), 0 when t is elsewhere
    (then ``locate``)."""
    cdef int64_t e = t // s.total
    cdef int64_t u = t - e * s.total
    cdef const int64_t* p
    cdef int64_t doc_start
    cdef int rc
    if e != c.epoch:
        return 0
    p = prefix + s.prefix_base + e * (s.nb + 1)
    doc_start = p[c.pos] + c.acc
    if u < doc_start or u >= p[c.pos + 1]:
        return 0
    rc = walk_to(c, s, u - doc_start)
    return rc if rc < 0 else 1


cdef void prefetch_past_block(const Cursor* c, const Source* s, int64_t t_end, const int64_t* prefix,
                              const uint64_t* bkeys) noexcept nogil:
    """``prefetch_blocks`` for a cursor that was not located (it continues): the blocks after its own that start
    before stream token ``t_end`` (its own block's documents are read already)."""
    cdef const int64_t* p = prefix + s.prefix_base + c.epoch * (s.nb + 1)
    cdef int64_t u_end = t_end - c.epoch * s.total
    if c.pos + 1 < s.nb and p[c.pos + 1] < u_end:
        prefetch_blocks(s, p, c.pos + 1, u_end, bkeys[s.key_base + c.epoch])




cdef struct Out:
    int64_t* item_ptr   # stop - start + 1 entries
    uint16_t* dataset   # the pieces: capacity entries each
    int64_t* sample
    int64_t* offset
    int64_t* length
    int64_t capacity


class PackError(Exception):
    """A packing error: ``args`` = (code, dataset, epoch, block position, block id); the Python side names it."""


cdef inline void* buffer_of(object array, Py_buffer* view) except NULL:
    """The writable data address of a C-contiguous array (``view`` released by the caller)."""
    PyObject_GetBuffer(array, view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
    return view.buf


cdef class Packer:
    """The packer of one compact plan: its datasets' descriptors checked and laid out once, and one cursor per
    dataset kept from call to call, so that consecutive ranges (a loader's steps) continue where the last one
    stopped instead of placing their cursors again (a binary search and a block of permutations each), and a
    rank's next share in the same block walks forward to it. Not thread-safe: one per thread
    (``CompactPlan`` keeps them thread-local).

    ``Packer(seq_len, *descriptors)`` takes ``pack_range``'s arguments between ``seq_len`` and ``item_ptr``;
    ``pack(start, stop)`` returns the pieces of the global items ``[start, stop)`` exactly as ``pack_range`` does
    from scratch (raising :class:`PackError` where it returns a negative code). ``locates`` counts the cursors
    placed from scratch (the rest continued or walked forward).

    Example::

        packer = Packer(seq_len, *descriptors)
        item_ptr, dataset, sample, offset, length = packer.pack(0, 64)
    """
    cdef object _keep           # the arrays the pointers below read or write
    cdef Py_ssize_t D
    cdef int64_t R, seq_len, row, serial
    cdef const uint16_t* pattern
    cdef const int64_t* rank
    cdef const int64_t* counts
    cdef const int64_t* prefix
    cdef const uint64_t* bkeys
    cdef const uint64_t* ikeys
    cdef Source* sources
    cdef int64_t* cmem          # D rows of ``row`` int64: one Cursor each
    cdef int64_t* placed        # the dataset-local item a cursor sits at the start of (-1: not placed)
    cdef int64_t* touched       # the call that last moved a dataset's cursor
    cdef object _scratch        # item_ptr and piece columns of pack(), grown to the largest call
    cdef Out scratch
    cdef public int64_t locates

    def __init__(self, int64_t seq_len,
                 const uint16_t[::1] pattern, const int64_t[::1] pattern_rank, const int64_t[::1] period_counts,
                 const uint64_t[::1] size_ptrs, const int32_t[::1] size_codes, const int64_t[::1] n_docs,
                 const int64_t[::1] n_blocks, const int64_t[::1] block_groups, const int64_t[::1] tile_docs,
                 const int64_t[::1] totals, const int64_t[::1] epochs,
                 const int64_t[::1] prefix_base, const int64_t[::1] key_base,
                 const int64_t[::1] prefix, const uint64_t[::1] block_keys, const uint64_t[::1] inner_keys):
        import numpy as np
        cdef Py_ssize_t D = n_docs.shape[0], d
        cdef int64_t R = pattern.shape[0]
        if block_groups.shape[0] != D or tile_docs.shape[0] != D:
            raise ValueError("pack_range: one block group and tile per dataset")
        if R < 1 or pattern_rank.shape[0] != R or period_counts.shape[0] != D:
            raise ValueError("pack_range: inconsistent blend pattern")
        if seq_len < 1:
            raise ValueError("pack_range: seq_len must be >= 1")
        for d in range(D):
            if (size_ptrs[d] == 0 or n_blocks[d] < 1 or totals[d] < 1 or block_groups[d] < 1 or tile_docs[d] < 1 or
                    n_blocks[d] != tiled_blocks(n_docs[d], block_groups[d], tile_docs[d]) or
                    prefix_base[d] + epochs[d] * (n_blocks[d] + 1) > prefix.shape[0] or
                    key_base[d] + epochs[d] > block_keys.shape[0] or key_base[d] + epochs[d] > inner_keys.shape[0]):
                raise ValueError(f"pack_range: dataset {d} is described inconsistently")
        for d in range(R):
            if pattern[d] >= D:
                raise ValueError("pack_range: blend pattern names a dataset out of range")
        self.D, self.R, self.seq_len = D, R, seq_len
        self.pattern, self.rank, self.counts = &pattern[0], &pattern_rank[0], &period_counts[0]
        self.prefix, self.bkeys, self.ikeys = &prefix[0], &block_keys[0], &inner_keys[0]
        # One cursor per dataset (8 KiB with its block buffer), written only once its dataset is first placed, so a
        # large mixture's unused cursors cost address space, not memory.
        self.row = sizeof(Cursor) // 8 + 1
        cursors_arr = np.empty((D, self.row), dtype=np.int64)
        state_arr = np.full((2, D), -1, dtype=np.int64)
        sources_arr = np.zeros(D * sizeof(Source), dtype=np.uint8)  # a C array of D Sources
        cdef int64_t[:, ::1] cmem = cursors_arr
        cdef int64_t[:, ::1] state = state_arr
        cdef uint8_t[::1] smem = sources_arr
        self.cmem, self.placed, self.touched = &cmem[0, 0], &state[0, 0], &state[1, 0]
        self.sources = <Source*>&smem[0]
        cdef Source* ss
        for d in range(D):
            ss = self.sources + d
            ss.sizes = <const void*>size_ptrs[d]
            ss.code = size_codes[d]
            ss.n = n_docs[d]
            ss.nb = n_blocks[d]
            ss.group = block_groups[d]
            ss.tile = tile_docs[d]
            ss.total = totals[d]
            ss.epochs = epochs[d]
            ss.prefix_base = prefix_base[d]
            ss.key_base = key_base[d]
        self._keep = (pattern, pattern_rank, period_counts, prefix, block_keys, inner_keys, cursors_arr, state_arr,
                      sources_arr)
        self.serial = 0
        self.locates = 0
        self._grow(0, 0)

    cdef void _grow(self, int64_t items, int64_t pieces) except *:
        import numpy as np
        cdef int64_t[::1] ptr = np.empty(items + 1, dtype=np.int64)
        cdef uint16_t[::1] ds = np.empty(max(pieces, 1), dtype=np.uint16)
        cdef int64_t[:, ::1] cols = np.empty((3, max(pieces, 1)), dtype=np.int64)
        self._scratch = (ptr, ds, cols)
        self.scratch.item_ptr, self.scratch.dataset = &ptr[0], &ds[0]
        self.scratch.sample, self.scratch.offset, self.scratch.length = &cols[0, 0], &cols[1, 0], &cols[2, 0]
        self.scratch.capacity = pieces

    cdef inline Cursor* cursor(self, Py_ssize_t d) noexcept nogil:
        return <Cursor*>(self.cmem + d * self.row)

    cdef int place(self, Py_ssize_t d, int64_t k, int64_t ahead) noexcept nogil:
        """Put dataset d's cursor at the start of its item k, the first of this call's items of d: where it already
        is, a walk forward in its block, or located from scratch; the blocks of the next ``ahead`` tokens are
        prefetched."""
        cdef Cursor* cs = self.cursor(d)
        cdef const Source* ss = self.sources + d
        cdef int64_t t = k * self.seq_len
        cdef int rc = 0
        if self.placed[d] != k:
            rc = seek_in_block(cs, ss, t, self.prefix) if self.placed[d] >= 0 else 0
            if rc == 0:
                self.locates += 1
                return locate(cs, ss, t, self.prefix, self.bkeys, self.ikeys, ahead)
            if rc < 0:
                return rc
        prefetch_past_block(cs, ss, t + ahead, self.prefix, self.bkeys)
        return 0

    cdef int64_t pack_into(self, int64_t start, int64_t stop, const Out* out, int64_t* info) noexcept nogil:
        """The pieces of the global items ``[start, stop)`` into ``out`` (the first ``out.capacity`` of them); the
        number of pieces, or a negative error code with ``info`` = (dataset, epoch, block position, block id)."""
        cdef int64_t i, q, r, k, need, take, avail, ahead, n = 0
        cdef int64_t capacity = out.capacity, R = self.R, seq_len = self.seq_len
        cdef int rc = 0
        cdef Py_ssize_t d = 0
        cdef Cursor* cs = NULL
        cdef const Source* ss
        self.serial += 1
        out.item_ptr[0] = 0
        for i in range(start, stop):
            r = i // R
            q = i - r * R
            d = self.pattern[q]
            k = r * self.counts[d] + self.rank[q]
            cs = self.cursor(d)
            ss = self.sources + d
            if self.touched[d] != self.serial or self.placed[d] != k:
                self.touched[d] = self.serial
                # this call's items of d, about (stop - i) * c_d / R of them, are tokens ahead of k * seq_len
                ahead = ((min(stop - i, <int64_t>1 << 24) * self.counts[d] + R - 1) // R + 1) * seq_len + 1
                rc = self.place(d, k, ahead)
                if rc < 0:
                    break
            need = seq_len + 1
            while True:
                avail = cs.size - cs.off
                take = need if need < avail else avail
                if n < capacity:
                    out.dataset[n] = <uint16_t>d
                    out.sample[n] = cs.doc
                    out.offset[n] = cs.off
                    out.length[n] = take
                n += 1
                need -= take
                if need == 0:
                    cs.off += take - 1   # the next item starts at this one's last token
                    break
                rc = next_doc(cs, ss, self.prefix, self.bkeys, self.ikeys)
                if rc < 0:
                    break
            if rc < 0:
                break
            self.placed[d] = k + 1
            out.item_ptr[i - start + 1] = n
        if rc < 0:
            info[0] = d
            info[1] = cs.epoch if cs != NULL else 0
            info[2] = cs.pos if cs != NULL else 0
            info[3] = cs.block if cs != NULL else 0
            for i in range(self.D):  # a cursor stopped by an error is nowhere in particular
                self.placed[i] = -1
            return rc
        return n

    cdef int64_t pack_held(self, int64_t start, int64_t stop, int64_t* info):
        """``pack_into`` the scratch arrays, with the GIL released only for windows of RELEASE_GIL_ITEMS or more."""
        cdef int64_t total
        if stop - start < RELEASE_GIL_ITEMS:
            return self.pack_into(start, stop, &self.scratch, info)
        with nogil:
            total = self.pack_into(start, stop, &self.scratch, info)
        return total

    def pack(self, int64_t start, int64_t stop) -> tuple:
        """``(item_ptr, dataset, sample, offset, length)`` of the global items ``[start, stop)`` (new arrays;
        ``item_ptr`` starts at 0), as ``pack_range`` gives them. Raises :class:`PackError` on a packing error."""
        import numpy as np
        cdef int64_t total, n = stop - start
        cdef int64_t info[4]
        cdef Py_buffer view
        if start < 0 or stop < start:
            raise ValueError("Packer.pack: need 0 <= start <= stop")
        if n + 1 > self._scratch[0].shape[0]:
            self._grow(n, self.scratch.capacity)
        total = self.pack_held(start, stop, info)
        if total > self.scratch.capacity:  # the arrays hold the most pieces of any call so far: rarely grown
            self._grow(n, total + total // 4)
            total = self.pack_held(start, stop, info)
        if total < 0:
            raise PackError(total, info[0], info[1], info[2], info[3])
        arrays = (np.empty(n + 1, dtype=np.int64), np.empty(total, dtype=np.uint16), np.empty(total, dtype=np.int64),
                  np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64))
        cdef void* sources[5]
        sources[:] = [<void*>self.scratch.item_ptr, <void*>self.scratch.dataset, <void*>self.scratch.sample,
                      <void*>self.scratch.offset, <void*>self.scratch.length]
        cdef size_t sizes[5]
        sizes[:] = [<size_t>(n + 1) * 8, <size_t>total * 2, <size_t>total * 8, <size_t>total * 8, <size_t>total * 8]
        cdef int j
        for j in range(5):
            if sizes[j]:
                memcpy(buffer_of(arrays[j], &view), sources[j], sizes[j])
                PyBuffer_Release(&view)
        return arrays


def pack_range(int64_t start, int64_t stop, int64_t seq_len,
               const uint16_t[::1] pattern, const int64_t[::1] pattern_rank, const int64_t[::1] period_counts,
               const uint64_t[::1] size_ptrs, const int32_t[::1] size_codes, const int64_t[::1] n_docs,
               const int64_t[::1] n_blocks, const int64_t[::1] block_groups, const int64_t[::1] tile_docs,
               const int64_t[::1] totals, const int64_t[::1] epochs,
               const int64_t[::1] prefix_base, const int64_t[::1] key_base,
               const int64_t[::1] prefix, const uint64_t[::1] block_keys, const uint64_t[::1] inner_keys,
               int64_t[::1] item_ptr, uint16_t[::1] p_dataset, int64_t[::1] p_sample, int64_t[::1] p_offset,
               int64_t[::1] p_length, int64_t[::1] info) -> int:
    """Pieces of the global items ``[start, stop)``, with every cursor placed from scratch (a fresh
    :class:`Packer`; a caller stepping through a plan keeps one instead).

    Item i is item ``k = (i // R) * period_counts[d] + pattern_rank[i % R]`` of dataset
    ``d = pattern[i % R]`` (R = len(pattern)); that dataset's item k is its token stream's range
    ``[k * seq_len, k * seq_len + seq_len + 1)``; dataset d's blocks are laid out by
    ``block_groups[d]`` and ``tile_docs[d]`` (see ``tiled_blocks``). Writes ``item_ptr`` (stop - start + 1 entries) and
    the first ``len(p_sample)`` pieces; returns the number of pieces (more than the arrays hold: call
    again with room for that many), or a negative error code with ``info`` = (dataset, epoch,
    block position, block id).
    """
    cdef int64_t capacity = p_sample.shape[0]
    if item_ptr.shape[0] != stop - start + 1 or start < 0 or stop < start:
        raise ValueError("pack_range: item_ptr must have stop - start + 1 entries")
    if p_dataset.shape[0] < capacity or p_offset.shape[0] < capacity or p_length.shape[0] < capacity:
        raise ValueError("pack_range: piece arrays of unequal capacity")
    if info.shape[0] < 4:
        raise ValueError("pack_range: info needs 4 entries")
    cdef Packer packer = Packer(seq_len, pattern, pattern_rank, period_counts, size_ptrs, size_codes, n_docs,
                                n_blocks, block_groups, tile_docs, totals, epochs, prefix_base, key_base, prefix,
                                block_keys, inner_keys)
    cdef Out out
    out.item_ptr = &item_ptr[0]
    out.dataset = &p_dataset[0] if capacity else NULL
    out.sample = &p_sample[0] if capacity else NULL
    out.offset = &p_offset[0] if capacity else NULL
    out.length = &p_length[0] if capacity else NULL
    out.capacity = capacity
    cdef int64_t total
    with nogil:
        total = packer.pack_into(start, stop, &out, &info[0])
    return total
