/* foresight C I/O engine: batched reads and writes over io_uring, with a pread thread-pool fallback.
 *
 * The one C API of csrc/io (mirrored for cffi in csrc/cdef/_uring.h). Conventions:
 *   - functions return 0 or a count on success and -errno on failure; they never print and never
 *     touch the Python API (cffi calls them with the GIL released);
 *   - a batch is struct-of-arrays (fds, offsets, lengths, buffer addresses) and gets one result per
 *     request: the bytes transferred, or -errno; a read that hits end of file before `length` bytes
 *     fails with -ENODATA (unless FS_BATCH_ALLOW_EOF);
 *   - requests always name plain fds; when an fd is registered (fs_engine_register_files) the
 *     io_uring backend uses its fixed-file slot, and when a request's buffer lies inside a
 *     registered buffer it uses READ_FIXED/WRITE_FIXED (the page-cache pass's rings too, which
 *     mirror the registration: fs_cached.c);
 *   - O_DIRECT fds (detected with fcntl) need offset, length and buffer address to be multiples of
 *     FS_DIRECT_ALIGN (and of the device's logical block size); a misaligned request is rejected
 *     with -EINVAL before any I/O is issued, nothing falls back silently to buffered I/O.
 *
 * Thread safety: every call on an engine takes the engine's mutex, so an engine may be shared,
 * but a thread blocked in fs_engine_wait on the io_uring backend holds the ring (it is the one
 * reaping completions) and other callers queue behind it. For parallel I/O from several threads
 * use one engine per thread. An engine must not be used in a child after fork().
 *
 * Lifetime: the arrays of a submitted batch (including results) and the buffers they point to
 * must stay valid until fs_engine_wait returns for its ticket, or fs_engine_destroy returns.
 * fs_engine_destroy cancels requests not yet started (-ECANCELED) and waits for those in flight,
 * so no I/O lands in memory after it returns. Registered fds must stay open while registered.
 */
#ifndef FS_IO_H
#define FS_IO_H

#include <stdint.h>

#define FS_BACKEND_AUTO 0  /* io_uring when it works here, else the pread pool */
#define FS_BACKEND_URING 1
#define FS_BACKEND_PREAD 2

#define FS_OP_READ 0
#define FS_OP_WRITE 1

/* A read reaching end of file early succeeds with the bytes it got (for O_DIRECT transfers
 * rounded up past the end of a file); without it such a read fails with -ENODATA. */
#define FS_BATCH_ALLOW_EOF 1u

#define FS_DIRECT_ALIGN 512 /* checked up front for O_DIRECT fds; the device may need 4096 */
#define FS_MAX_REGISTERED_BUFFER (1ull << 30) /* larger buffers are registered in 1 GiB pieces */

struct fs_engine;

/* Options; an all-zero struct means the defaults. */
struct fs_engine_opts {
    int32_t backend;             /* FS_BACKEND_*; default AUTO */
    uint32_t queue_depth;        /* io_uring requests in flight; default 64, at most 4096 */
    uint32_t threads;            /* pread pool workers (its queue depth); default 4, at most 256. On
                                    io_uring: threads of the page-cache pass (at most one per CPU) */
    uint32_t sqpoll;             /* 1: kernel submission-polling thread (io_uring) */
    uint32_t sqpoll_idle_ms;     /* SQPOLL thread idle timeout; default 1000 */
    uint32_t disable_nowait;     /* 1: no preadv2(RWF_NOWAIT) page-cache pass before the ring */
    uint64_t max_inflight_bytes; /* cap on bytes in flight (large extents need less depth);
                                    default 64 MiB; one request is always allowed */
};

/* One batch, struct-of-arrays; every request has the same op. */
struct fs_batch {
    uint32_t op;             /* FS_OP_READ or FS_OP_WRITE */
    uint32_t flags;          /* FS_BATCH_* */
    int64_t n;               /* number of requests */
    const int32_t *fds;      /* file descriptors */
    const int64_t *offsets;  /* file offsets (>= 0) */
    const int64_t *lengths;  /* bytes (>= 0) */
    const uint64_t *addrs;   /* buffer addresses */
    int64_t *results;        /* out: bytes transferred, or -errno */
};

struct fs_engine_info {
    int32_t backend;             /* FS_BACKEND_URING or FS_BACKEND_PREAD */
    int32_t uring_errno;         /* AUTO fell back: why io_uring failed (positive errno), else 0 */
    uint32_t queue_depth;        /* requests in flight at most (the thread count on the pool) */
    uint32_t threads;            /* pread pool workers; on io_uring the page-cache pass's threads
                                    (the caller's included; 0 when the pass is off) */
    uint32_t sqpoll;             /* SQPOLL actually active */
    uint32_t nowait;             /* RWF_NOWAIT pass enabled */
    uint32_t registered_files;
    uint32_t registered_buffers; /* after splitting into <= 1 GiB pieces */
    uint64_t requests;           /* requests completed */
    uint64_t bytes;              /* bytes transferred */
    uint64_t failed;             /* requests that failed */
    uint64_t nowait_hits;        /* reads served whole by the RWF_NOWAIT pass */
    uint64_t nowait_misses;      /* RWF_NOWAIT probes that went on to the ring */
    uint64_t fixed_buffer_ops;   /* ring ops issued as READ_FIXED/WRITE_FIXED */
    uint64_t fixed_file_ops;     /* ring ops issued on registered files */
    uint64_t requeues;           /* short transfers continued */
    uint64_t retries;            /* EAGAIN/EINTR retried */
    uint64_t syscalls;           /* io_uring_enter calls (approximate with SQPOLL) */
    uint32_t cached_rings;       /* page-cache pass threads reading through their own io_uring ring (else preadv2) */
    uint64_t cached_ring_ops;    /* page-cache pass reads (RWF_NOWAIT) issued on those rings */
    uint64_t cached_fixed_buffer_ops; /* of which READ_FIXED into a registered buffer */
    uint64_t cached_fixed_file_ops;   /* of which on a registered file */
};

int fs_io_have_liburing(void);

int fs_engine_create(const struct fs_engine_opts *opts, struct fs_engine **out);
void fs_engine_destroy(struct fs_engine *eng);
int fs_engine_info(struct fs_engine *eng, struct fs_engine_info *info);

/* Replace the registered set (n == 0 unregisters). No-ops that succeed on the pread backend. */
int fs_engine_register_files(struct fs_engine *eng, const int32_t *fds, uint32_t n);
int fs_engine_register_buffers(struct fs_engine *eng, const uint64_t *addrs, const uint64_t *lens, uint32_t n);

/* Submit and complete a batch; returns the number of failed requests, or -errno. */
int64_t fs_engine_run(struct fs_engine *eng, const struct fs_batch *batch);
/* Start a batch; *ticket names it for poll/wait. The batch struct itself is copied. */
int fs_engine_submit(struct fs_engine *eng, const struct fs_batch *batch, uint64_t *ticket);
/* Make progress without blocking: 1 if the batch is complete, 0 if not, -ENOENT if unknown. */
int fs_engine_poll(struct fs_engine *eng, uint64_t ticket);
/* Block until the batch is complete, forget the ticket; returns its number of failed requests. */
int64_t fs_engine_wait(struct fs_engine *eng, uint64_t ticket);

/* fsync (datasync == 0) or fdatasync (datasync != 0); 0 or -errno, EINTR retried. */
int fs_fsync(int fd, int datasync);

#endif
