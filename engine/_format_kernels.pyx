# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Shard-writer loops: copy samples into a padded (aligned) staging buffer, GIL released.

Example::

    import numpy as np
    from foresight import _format_kernels
    dst = np.zeros(8192, np.uint8)
    src = np.frombuffer(b"abcde", np.uint8)
    _format_kernels.scatter(src, np.array([0, 2]), np.array([2, 3]), dst, np.array([0, 4096]))
"""
from libc.stdint cimport int64_t, uint8_t
from libc.string cimport memcpy


def scatter(const uint8_t[::1] src, const int64_t[::1] src_offsets, const int64_t[::1] lengths,
            uint8_t[::1] dst, const int64_t[::1] dst_offsets):
    """``dst[dst_offsets[k]:][:lengths[k]] = src[src_offsets[k]:][:lengths[k]]`` for every k.

    Every range is bounds-checked first; raises ValueError (naming k) instead of writing out of bounds.
    """
    cdef Py_ssize_t n = lengths.shape[0], k
    cdef int64_t ns = src.shape[0], nd = dst.shape[0]
    if src_offsets.shape[0] != n or dst_offsets.shape[0] != n:
        raise ValueError("scatter: src_offsets, lengths and dst_offsets differ in length")
    for k in range(n):
        if (lengths[k] < 0 or src_offsets[k] < 0 or dst_offsets[k] < 0
                or src_offsets[k] > ns - lengths[k] or dst_offsets[k] > nd - lengths[k]):
            raise ValueError(f"scatter: range {k} out of bounds")
    with nogil:
        for k in range(n):
            if lengths[k]:
                memcpy(&dst[dst_offsets[k]], &src[src_offsets[k]], lengths[k])
