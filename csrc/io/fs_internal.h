/* Internals shared by the engine core (fs_io.c) and its two backends (fs_uring.c, fs_pool.c).
 * Not part of the API: nothing here is declared to cffi. */
#ifndef FS_INTERNAL_H
#define FS_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "fs_io.h"

#define FS_MAX_RETRIES 1000       /* EAGAIN/EINTR retries of one request before giving up */
#define FS_MAX_CHUNK (1ll << 30)  /* bytes per syscall / SQE (io_uring lengths are 32-bit) */

/* A submitted batch. results[i] doubles as the byte count done so far while request i runs. */
struct fs_job {
    struct fs_batch b;
    uint64_t ticket;
    int64_t next;   /* next request to start */
    int64_t done;   /* requests finished */
    int64_t failed; /* requests finished with an error */
    uint32_t probes, hits; /* RWF_NOWAIT pass, adaptive per batch */
    int nowait_off;
    struct fs_cached_pass *pass; /* io_uring: its page-cache pass, until all its requests are started */
    int pass_state; /* io_uring: 0 no pass considered yet, 1 running, 2 collected, 3 none (or released) */
    int waiting; /* a thread is in fs_engine_wait for it */
    struct fs_job *link;
};

/* Per-caller cache of the last fd's status (one fcntl per run of equal fds in a batch; reset
 * between batches, since an fd number may be closed and reused in between). */
struct fs_fd_cache {
    const struct fs_job *job;
    int fd;
    int flags;    /* F_GETFL result, or -errno */
    int have_id;  /* dev/ino filled (fs_fd_identity) */
    uint64_t dev, ino;
};

/* Device and inode of cache->fd (fstat once per cached fd); 0 or -errno. */
int fs_fd_identity(struct fs_fd_cache *cache, uint64_t *dev, uint64_t *ino);

/* The io_uring backend's registered files and buffers, by registration index: what a request's fd and buffer
 * map to on the engine's ring and, mirrored, on the page-cache pass's rings (the same indices). Changed only
 * under the engine lock with no page-cache pass running, so the pass threads read it without a lock. */
struct fs_fixed_file {
    uint64_t dev, ino; /* what the fd named when registered */
};
struct fs_fixed_buf {
    uint64_t addr, len;
};
struct fs_fixed {
    int32_t *file_slot; /* fd -> registered index, -1 when not registered */
    uint32_t file_slot_len;
    struct fs_fixed_file *files; /* by registered index */
    struct fs_fixed_buf *bufs;   /* sorted by addr; index = registration index */
    uint32_t nbufs;
};
/* The registered slot of cache->fd (fs_req_check filled the cache), if it still names the file it named at
 * registration (an fd closed and reused for another file must not read the old one); else -1. */
int fs_fixed_file_index(const struct fs_fixed *f, struct fs_fd_cache *cache);
/* The registered buffer holding [addr, addr + len), or -1. */
int fs_fixed_buf_index(const struct fs_fixed *f, uint64_t addr, uint64_t len);

struct fs_engine;

struct fs_backend_ops {
    /* All but destroy run with eng->lock held. */
    int (*submit)(struct fs_engine *eng, struct fs_job *job); /* job already queued */
    int (*poll)(struct fs_engine *eng, struct fs_job *job);   /* 1 when complete */
    int (*wait)(struct fs_engine *eng, struct fs_job *job);   /* 0 when complete, or -errno */
    int (*register_files)(struct fs_engine *eng, const int32_t *fds, uint32_t n);
    int (*register_buffers)(struct fs_engine *eng, const uint64_t *addrs, const uint64_t *lens, uint32_t n);
    void (*destroy)(struct fs_engine *eng); /* cancels, drains and frees the backend */
};

struct fs_engine {
    pthread_mutex_t lock;
    const struct fs_backend_ops *ops;
    void *impl;
    struct fs_engine_opts opts; /* defaults filled in */
    struct fs_engine_info info; /* counters, guarded by lock */
    struct fs_job *head, *tail; /* submitted, not yet waited for, in order */
    uint64_t next_ticket;
    int error; /* a ring-level failure poisons the engine (-errno) */
};

/* Validate request i of job: returns 0 and sets *direct, or -errno (the request's result). */
int fs_req_check(const struct fs_job *job, int64_t i, struct fs_fd_cache *cache, int *direct);
/* Record the final result of request i (lock held). */
void fs_job_finish(struct fs_engine *eng, struct fs_job *job, int64_t i, int64_t res);
/* Finish every request not yet started with -ECANCELED (lock held). */
void fs_jobs_cancel_unstarted(struct fs_engine *eng);
/* First job that still has requests to start, or NULL. */
struct fs_job *fs_jobs_feedable(struct fs_engine *eng);

/* The io_uring backend's page-cache pass on several threads (fs_cached.c). */
#define FS_PROBE_NONE 0 /* not in a pass: the feeding thread may probe it alone */
#define FS_PROBE_MISS 1 /* probed, not (all) cached, or not for the page cache: the ring does it (results[i] = 0) */
#define FS_PROBE_DONE 2 /* results[i] is the final result */
struct fs_cached;
struct fs_cached_pass;
/* helpers start on the first pass. fixed: the engine's registration table (NULL: none), which the pass's rings
 * mirror through fs_cached_register_files/_buffers. */
int fs_cached_create(uint32_t helpers, const struct fs_fixed *fixed, struct fs_cached **out);
void fs_cached_destroy(struct fs_cached *c); /* every pass collected */
/* Queue a pass probing requests [first, first + count) of job: 0 and *out, or -ENOMEM (no pass). The requests
 * belong to the pass until fs_cached_finish returns 1. */
int fs_cached_start(struct fs_cached *c, const struct fs_job *job, int64_t first, int64_t count,
                    struct fs_cached_pass **out);
/* Collect pass p: 1 when its states are final (fs_cached_state; results[i] = length when DONE, 0 when MISS) and
 * *gave_up (most probes missed, the pass stopped early); 0 when it is not done yet and !block. block: take part
 * in the work, then wait for the helpers (copying for later passes meanwhile). */
int fs_cached_finish(struct fs_cached *c, struct fs_cached_pass *p, int block, int *gave_up);
uint8_t fs_cached_state(const struct fs_cached_pass *p, int64_t i); /* FS_PROBE_* of request i, once collected */
void fs_cached_release(struct fs_cached *c, struct fs_cached_pass *p); /* collected, all its requests started */
uint32_t fs_cached_threads(const struct fs_cached *c); /* threads a pass runs on, the feeder included */
/* Reads of a collected pass p: through a pass ring, of which into registered buffers and on registered files. */
void fs_cached_counts(const struct fs_cached_pass *p, uint64_t *ring_ops, uint64_t *fixed_buffer_ops,
                      uint64_t *fixed_file_ops);
uint32_t fs_cached_rings(const struct fs_cached *c); /* pass threads reading through their own io_uring ring */
/* Mirror the engine ring's registration on the pass's rings (n == 0: unregister), with no pass running; a ring
 * that refuses it reads with plain fds/buffers (fs_cached_counts tells). */
void fs_cached_register_files(struct fs_cached *c, const int32_t *fds, uint32_t n);
void fs_cached_register_buffers(struct fs_cached *c, const struct fs_fixed_buf *bufs, uint32_t n);

int fs_uring_create(struct fs_engine *eng); /* 0 or -errno (ENOSYS without liburing) */
int fs_pool_create(struct fs_engine *eng);

#endif
