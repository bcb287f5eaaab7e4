# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
# distutils: extra_compile_args = -ffp-contract=off
"""Plan construction loops: mixture blending, permutation scatter, block expansion, token packing.

Every function here is a plain loop over typed memoryviews run with the GIL released; all the
randomness comes from numpy Generators in ``foresight.plan.shuffle``, so these loops are pure
functions of their inputs and give byte-identical results on any machine.
(``-ffp-contract=off`` keeps the blending arithmetic from being fused into FMAs on some CPUs.)

Example::

    import numpy as np
    from foresight import _plan_kernels
    choice = np.empty(6, np.uint16); counts = np.zeros(2, np.int64)
    _plan_kernels.blend(np.array([0.5, 0.5]), choice, counts)   # choice == [0, 1, 0, 1, 0, 1]
"""
from libc.stdint cimport int32_t, int64_t, uint16_t
from libc.string cimport memcpy

cdef extern from *:
    void __builtin_prefetch(const void* addr) nogil

# How far ahead (in documents) the packer prefetches token counts: the counts are read in a random
# order, so without prefetching every document costs a full cache miss.
DEF PREFETCH = 24

ctypedef fused index_t:
    int32_t
    int64_t


def blend(const double[::1] weights, uint16_t[::1] choice, int64_t[::1] counts) -> None:
    """Megatron-style greedy blending: item i goes to the dataset with the largest
    ``weights[d] * (i + 1) - counts[d]`` (lowest d on ties). Fills ``choice``; ``counts`` (zeros on
    entry) ends as the number of items given to each dataset."""
    cdef Py_ssize_t num_datasets = weights.shape[0]
    cdef Py_ssize_t n = choice.shape[0]
    cdef Py_ssize_t i, d, best
    cdef double x, err, best_err
    if counts.shape[0] != num_datasets:
        raise ValueError("counts must have one entry per dataset")
    if num_datasets < 1 or num_datasets > 65535:
        raise ValueError("between 1 and 65535 datasets")
    with nogil:
        for i in range(n):
            x = <double>(i + 1)
            best = 0
            best_err = weights[0] * x - <double>counts[0]
            for d in range(1, num_datasets):
                err = weights[d] * x - <double>counts[d]
                if err > best_err:
                    best = d
                    best_err = err
            choice[i] = <uint16_t>best
            counts[best] += 1


def bucket_scatter(const uint16_t[::1] keys, int64_t[::1] cursor, index_t[::1] out) -> None:
    """Counting-sort scatter: ``out[cursor[keys[i]]++] = i`` for i in order (a stable sort of the
    indices by key). ``cursor`` holds each bucket's start on entry and its end on exit."""
    cdef Py_ssize_t n = keys.shape[0]
    cdef Py_ssize_t i
    cdef int64_t slot
    cdef Py_ssize_t num_buckets = cursor.shape[0]
    if out.shape[0] != n:
        raise ValueError("out must have one entry per key")
    with nogil:
        for i in range(n):
            if keys[i] >= num_buckets:
                with gil:
                    raise ValueError(f"key {keys[i]} out of range at {i}")
            slot = cursor[keys[i]]
            out[slot] = <index_t>i
            cursor[keys[i]] = slot + 1


def block_expand(const int64_t[::1] block_order, const index_t[::1] src, index_t[::1] out,
                 int64_t block_size) -> None:
    """Copy the blocks ``src[b*block_size : (b+1)*block_size]`` for b in ``block_order`` one after
    another into ``out`` (the last block may be short)."""
    cdef Py_ssize_t n = src.shape[0]
    cdef Py_ssize_t num_blocks = block_order.shape[0]
    cdef Py_ssize_t k, pos = 0
    cdef int64_t start, stop, b
    if out.shape[0] != n or block_size < 1 or num_blocks != (n + block_size - 1) // block_size:
        raise ValueError("block_expand: inconsistent sizes")
    with nogil:
        for k in range(num_blocks):
            b = block_order[k]
            if b < 0 or b >= num_blocks:
                with gil:
                    raise ValueError(f"block {b} out of range")
            start = b * block_size
            stop = start + block_size
            if stop > n:
                stop = n
            if stop - start > n - pos:
                with gil:
                    raise ValueError("block_order repeats a block")
            memcpy(&out[pos], &src[start], (stop - start) * sizeof(index_t))
            pos += stop - start


def fill_samples(const uint16_t[::1] choice, const index_t[::1] order, const int64_t[::1] order_base,
                 const int64_t[::1] sizes, const int64_t[::1] sizes_base,
                 uint16_t[::1] piece_dataset, int64_t[::1] piece_sample, int64_t[::1] piece_length) -> None:
    """One piece per item: item i is the next sample of dataset ``choice[i]`` in that dataset's
    order (``order[order_base[d]:order_base[d+1]]``), with the sample's size as its length."""
    cdef Py_ssize_t n = piece_sample.shape[0]
    cdef Py_ssize_t num_datasets = sizes_base.shape[0]
    cdef Py_ssize_t i, d
    cdef int64_t k, sample
    cdef int64_t[::1] cursor = order_base[:num_datasets].copy()
    if choice.shape[0] != n or piece_dataset.shape[0] != n or piece_length.shape[0] != n:
        raise ValueError("fill_samples: output arrays must have one entry per item")
    if order_base.shape[0] != num_datasets + 1:
        raise ValueError("fill_samples: order_base must have num_datasets + 1 entries")
    with nogil:
        for i in range(n):
            d = choice[i]
            if d >= num_datasets or cursor[d] >= order_base[d + 1]:
                with gil:
                    raise ValueError(f"dataset {d} ran out of ordered samples at item {i}")
            k = cursor[d]
            cursor[d] = k + 1
            if k + PREFETCH < order_base[d + 1]:
                __builtin_prefetch(&sizes[sizes_base[d] + order[k + PREFETCH]])
            sample = order[k]
            piece_dataset[i] = <uint16_t>d
            piece_sample[i] = sample
            piece_length[i] = sizes[sizes_base[d] + sample]


cdef int64_t _walk_tokens(const uint16_t[::1] choice, const index_t[::1] order,
                          const int64_t[::1] order_base, const int64_t[::1] counts,
                          const int64_t[::1] counts_base, int64_t seq_len, int64_t[::1] item_ptr,
                          uint16_t* p_dataset, int64_t* p_sample, int64_t* p_offset, int64_t* p_length,
                          int64_t capacity, int64_t* pos, int64_t* off) noexcept nogil:
    """Cut each dataset's stream of documents (in its order) into sequences of seq_len + 1 tokens,
    consecutive ones overlapping by one token; item i takes the next sequence of dataset choice[i].
    Writes item_ptr and at most ``capacity`` pieces. Returns the number of pieces, or -1 - i when
    item i's dataset ran out of documents (or the pieces would overflow ``capacity``)."""
    cdef Py_ssize_t n = choice.shape[0]
    cdef Py_ssize_t i
    cdef int64_t d, p, o, avail, take, need, k = 0, doc, end
    item_ptr[0] = 0
    for i in range(n):
        d = choice[i]
        p = pos[d]
        o = off[d]
        end = order_base[d + 1]
        need = seq_len + 1
        while True:
            if p >= end or k >= capacity:
                return -1 - i
            doc = order[p]
            if p + PREFETCH < end:
                __builtin_prefetch(&counts[counts_base[d] + order[p + PREFETCH]])
            avail = counts[counts_base[d] + doc] - o
            if avail <= 0:          # empty document, or this one is used up
                p += 1
                o = 0
                continue
            take = need if need < avail else avail
            p_dataset[k] = <uint16_t>d
            p_sample[k] = doc
            p_offset[k] = o
            p_length[k] = take
            k += 1
            need -= take
            if need == 0:
                # The next sequence starts at this one's last token (the Megatron overlap).
                o += take - 1
                break
            p += 1
            o = 0
        pos[d] = p
        off[d] = o
        item_ptr[i + 1] = k
    return k


def pack_tokens(const uint16_t[::1] choice, const index_t[::1] order, const int64_t[::1] order_base,
                const int64_t[::1] counts, const int64_t[::1] counts_base, int64_t seq_len):
    """Pack token documents into items of ``seq_len + 1`` tokens, in one pass.

    ``order[order_base[d]:order_base[d+1]]`` is dataset d's document order (all its epochs, one
    after another) and ``counts[counts_base[d] + s]`` the token count of its sample s.
    Returns ``(item_ptr, piece_dataset, piece_sample, piece_offset, piece_length)``.

    An item has one piece more than the document boundaries it crosses, and the stream moves
    through each document position at most once, so ``len(choice) + len(order)`` pieces always
    suffice: the piece arrays are allocated that large and returned as views of their used prefix
    (the unused tail is never touched, so it takes address space, not memory).
    """
    import numpy as np
    cdef Py_ssize_t n = choice.shape[0]
    cdef Py_ssize_t num_datasets = counts_base.shape[0]
    cdef Py_ssize_t d
    cdef int64_t total
    cdef int64_t capacity = n + order.shape[0]
    if order_base.shape[0] != num_datasets + 1:
        raise ValueError("pack_tokens: order_base must have num_datasets + 1 entries")
    if seq_len < 1:
        raise ValueError("pack_tokens: seq_len must be >= 1")
    for d in range(num_datasets):
        if order_base[d] < 0 or order_base[d] > order_base[d + 1] or order_base[d + 1] > order.shape[0]:
            raise ValueError("pack_tokens: order_base out of range")
    for d in range(n):
        if choice[d] >= num_datasets:
            raise ValueError(f"pack_tokens: item {d} names dataset {choice[d]} of {num_datasets}")
    item_ptr_arr = np.empty(n + 1, dtype=np.int64)
    dataset_arr = np.empty(max(capacity, 1), dtype=np.uint16)
    sample_arr = np.empty(max(capacity, 1), dtype=np.int64)
    offset_arr = np.empty(max(capacity, 1), dtype=np.int64)
    length_arr = np.empty(max(capacity, 1), dtype=np.int64)
    cdef int64_t[::1] item_ptr = item_ptr_arr
    cdef uint16_t[::1] p_dataset = dataset_arr
    cdef int64_t[::1] p_sample = sample_arr
    cdef int64_t[::1] p_offset = offset_arr
    cdef int64_t[::1] p_length = length_arr
    cdef int64_t[::1] pos = np.array(order_base[:num_datasets], dtype=np.int64)
    cdef int64_t[::1] off = np.zeros(num_datasets, dtype=np.int64)
    with nogil:
        total = _walk_tokens(choice, order, order_base, counts, counts_base, seq_len, item_ptr,
                             &p_dataset[0], &p_sample[0], &p_offset[0], &p_length[0], capacity,
                             &pos[0], &off[0])
    if total < 0:
        raise ValueError(f"pack_tokens: dataset {choice[-1 - total]} ran out of documents at item {-1 - total}")
    return item_ptr_arr, dataset_arr[:total], sample_arr[:total], offset_arr[:total], length_arr[:total]
