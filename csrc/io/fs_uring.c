/* io_uring backend: keeps up to queue_depth requests in flight across all submitted batches,
 * refilling from the oldest batch as completions are reaped (in poll/wait). Cached extents of
 * buffered reads are served first by preadv2(RWF_NOWAIT), which beats the ring on warm data, on
 * several threads for batches of FS_CACHED_MIN_BATCH requests or bytes (fs_cached.c: each batch's
 * pass is queued at submit, so the helpers copy batch after batch without waiting for the caller);
 * only the misses go to the ring. Short transfers are continued, EAGAIN/EINTR retried. */
#include <errno.h>

#include "fs_internal.h"

#ifndef FS_HAVE_LIBURING

int fs_uring_create(struct fs_engine *eng) {
    (void)eng;
    return -ENOSYS;
}

#else

#include <liburing.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

/* Batches smaller than this (in requests and bytes) probe the page cache on the feeding thread alone:
 * waking helpers costs more than it saves. */
#define FS_CACHED_MIN_BATCH 8
#define FS_CACHED_MIN_BYTES (2 << 20) /* two of the pass's 1 MiB pieces */

struct slot {
    struct fs_job *job;
    int64_t idx;
    uint32_t len; /* bytes asked for by the SQE in flight */
    uint32_t retries;
    int direct;
    int file_index; /* registered-file slot to use, or -1 for the plain fd */
};

struct fs_uring {
    struct io_uring ring;
    uint32_t qd;
    uint32_t inflight;
    uint64_t inflight_bytes;
    struct slot *slots;
    uint32_t *free_slots;
    uint32_t nfree;
    struct fs_fixed fixed; /* registered files and buffers */
    struct fs_fd_cache fdc;
    int draining;
    struct fs_cached *cached;  /* page-cache pass helpers, NULL: probe on the feeding thread */
};

/* fs_job.pass_state */
#define PASS_UNDECIDED 0 /* not looked at yet */
#define PASS_RUNNING 1   /* job->pass queued or being copied */
#define PASS_COLLECTED 2 /* job->pass's states are final */
#define PASS_NONE 3      /* no pass (not worth one, or released once all its requests started) */

static int queue_sqe(struct fs_engine *eng, struct fs_uring *u, uint32_t s) {
    struct slot *sl = &u->slots[s];
    const struct fs_batch *b = &sl->job->b;
    int64_t i = sl->idx, done = b->results[i];
    int64_t rest = b->lengths[i] - done;
    uint32_t len = (uint32_t)(rest < FS_MAX_CHUNK ? rest : FS_MAX_CHUNK);
    uint64_t addr = b->addrs[i] + (uint64_t)done;
    uint64_t off = (uint64_t)(b->offsets[i] + done);
    int fd = b->fds[i];

    struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
    if (!sqe) { /* SQ full of prepared entries: hand them to the kernel first */
        int ret = io_uring_submit(&u->ring);
        eng->info.syscalls++;
        if (ret < 0)
            return ret;
        sqe = io_uring_get_sqe(&u->ring);
        if (!sqe)
            return -EBUSY;
    }

    int buf_index = fs_fixed_buf_index(&u->fixed, addr, len);
    int fixed_file = sl->file_index >= 0;
    int target = fixed_file ? sl->file_index : fd;
    void *p = (void *)(uintptr_t)addr;

    if (b->op == FS_OP_READ) {
        if (buf_index >= 0)
            io_uring_prep_read_fixed(sqe, target, p, len, off, buf_index);
        else
            io_uring_prep_read(sqe, target, p, len, off);
    } else {
        if (buf_index >= 0)
            io_uring_prep_write_fixed(sqe, target, p, len, off, buf_index);
        else
            io_uring_prep_write(sqe, target, p, len, off);
    }
    if (fixed_file) {
        sqe->flags |= IOSQE_FIXED_FILE;
        eng->info.fixed_file_ops++;
    }
    if (buf_index >= 0)
        eng->info.fixed_buffer_ops++;
    io_uring_sqe_set_data64(sqe, s);
    sl->len = len;
    u->inflight_bytes += len;
    return 0;
}

/* Serve a cached buffered read with preadv2(RWF_NOWAIT). Returns 1 when the request is finished
 * (whole, or hit end of file), 0 when the rest must go to the ring. Turns itself off for the
 * batch when most probes miss (cold data), so a cold batch pays a few wasted syscalls at most. */
static int nowait_read(struct fs_engine *eng, struct fs_job *job, int64_t i) {
    const struct fs_batch *b = &job->b;
    int64_t len = b->lengths[i];
    int64_t done = 0;
    job->probes++;
    while (done < len) {
        int64_t rest = len - done;
        struct iovec iov = {(void *)(uintptr_t)(b->addrs[i] + (uint64_t)done),
                            (size_t)(rest < FS_MAX_CHUNK ? rest : FS_MAX_CHUNK)};
        ssize_t r = preadv2(b->fds[i], &iov, 1, b->offsets[i] + done, RWF_NOWAIT);
        if (r <= 0) {
            if (r == 0) { /* end of file: the ring would say the same */
                fs_job_finish(eng, job, i, (b->flags & FS_BATCH_ALLOW_EOF) ? done : -ENODATA);
                job->hits++;
                eng->info.nowait_hits++;
                return 1;
            }
            break; /* EAGAIN (not cached), or anything else: let the ring do it and report */
        }
        done += r;
    }
    if (done == len) {
        job->hits++;
        eng->info.nowait_hits++;
        fs_job_finish(eng, job, i, done);
        return 1;
    }
    b->results[i] = done;
    eng->info.nowait_misses++;
    if (job->probes >= 32 && job->hits * 8 < job->probes)
        job->nowait_off = 1;
    return 0;
}

/* What the page-cache pass found for request i of job (FS_PROBE_NONE when it was not probed). */
static uint8_t probed(const struct fs_job *job, int64_t i) {
    return job->pass_state == PASS_COLLECTED ? fs_cached_state(job->pass, i) : FS_PROBE_NONE;
}

/* Queue the page-cache pass over job's remaining buffered reads on the helpers, when it is worth it (decided
 * once per job). */
static void start_pass(struct fs_engine *eng, struct fs_uring *u, struct fs_job *job) {
    if (job->pass_state != PASS_UNDECIDED)
        return;
    job->pass_state = PASS_NONE;
    int64_t count = job->b.n - job->next;
    if (!u->cached || job->b.op != FS_OP_READ || eng->opts.disable_nowait || job->nowait_off || count < 1)
        return;
    if (count < FS_CACHED_MIN_BATCH) { /* a few requests: worth it only if they are large */
        int64_t bytes = 0;
        for (int64_t i = job->next; i < job->b.n; i++)
            bytes += job->b.lengths[i];
        if (bytes < FS_CACHED_MIN_BYTES)
            return;
    }
    int direct = 0;
    if (fs_req_check(job, job->next, &u->fdc, &direct) == 0 && direct)
        return; /* an O_DIRECT batch: nothing is served from the page cache */
    if (fs_cached_start(u->cached, job, job->next, count, &job->pass) < 0)
        return; /* no memory for the pass: the feeding thread probes alone */
    job->pass_state = PASS_RUNNING;
}

/* Collect job's running pass (block: take part and wait); 1 when collected, 0 while it runs. */
static int finish_pass(struct fs_engine *eng, struct fs_uring *u, struct fs_job *job, int block) {
    int gave_up = 0;
    if (!fs_cached_finish(u->cached, job->pass, block, &gave_up))
        return 0;
    job->pass_state = PASS_COLLECTED;
    if (gave_up)
        job->nowait_off = 1;
    uint64_t ring_ops, fixed_buffer_ops, fixed_file_ops;
    fs_cached_counts(job->pass, &ring_ops, &fixed_buffer_ops, &fixed_file_ops);
    eng->info.cached_ring_ops += ring_ops;
    eng->info.cached_fixed_buffer_ops += fixed_buffer_ops;
    eng->info.cached_fixed_file_ops += fixed_file_ops;
    return 1;
}

/* Collect every running pass, taking part: then no pass thread reads, and the registration may change. */
static void quiesce_passes(struct fs_engine *eng, struct fs_uring *u) {
    for (struct fs_job *job = eng->head; job; job = job->link)
        if (job->pass_state == PASS_RUNNING)
            finish_pass(eng, u, job, 1);
}

/* Give the pass's memory back once all of job's requests are started. */
static void release_pass(struct fs_uring *u, struct fs_job *job) {
    if (job->pass_state == PASS_COLLECTED) {
        fs_cached_release(u->cached, job->pass);
        job->pass = NULL;
        job->pass_state = PASS_NONE;
    }
}

/* Start requests, oldest batch first, while slots and the in-flight byte budget allow. Every batch not yet
 * looked at gets its page-cache pass queued first, so the helpers go from one batch's copies to the next
 * without waiting for this thread. A batch whose pass runs stops the feeding until it is collected; up to and
 * including target (the batch a caller waits for, NULL: none) this thread takes part and waits. */
static int feed(struct fs_engine *eng, struct fs_uring *u, struct fs_job *target) {
    struct fs_job *job = fs_jobs_feedable(eng);
    for (struct fs_job *j = job; j; j = j->link)
        start_pass(eng, u, j);
    int block = target != NULL;
    while (job) {
        if (job->pass_state == PASS_RUNNING && !finish_pass(eng, u, job, block))
            return 0; /* its requests are the pass's until collected */
        int ret;
        while (job->next < job->b.n) {
            int64_t i = job->next;
            uint8_t found = probed(job, i);
            if (found == FS_PROBE_DONE) { /* served from the page cache: needs no slot */
                job->next++;
                eng->info.nowait_hits++;
                fs_job_finish(eng, job, i, job->b.results[i]);
                continue;
            }
            if (u->nfree == 0 || (u->inflight && u->inflight_bytes >= eng->opts.max_inflight_bytes))
                return 0;
            job->next++;
            int direct = 0;
            ret = fs_req_check(job, i, &u->fdc, &direct);
            if (ret < 0) {
                fs_job_finish(eng, job, i, ret);
                continue;
            }
            if (job->b.lengths[i] == 0) {
                fs_job_finish(eng, job, i, 0);
                continue;
            }
            if (found == FS_PROBE_NONE && job->b.op == FS_OP_READ && !direct && !eng->opts.disable_nowait &&
                !job->nowait_off && nowait_read(eng, job, i))
                continue;
            uint32_t s = u->free_slots[--u->nfree];
            u->slots[s] = (struct slot){.job = job, .idx = i, .direct = direct, .file_index = fs_fixed_file_index(&u->fixed, &u->fdc)};
            ret = queue_sqe(eng, u, s);
            if (ret < 0) { /* no SQE (a backstop: SQ entries >= slots): retry it next round */
                u->free_slots[u->nfree++] = s;
                job->next--;
                return ret;
            }
            u->inflight++;
            if (found == FS_PROBE_MISS && !direct)
                eng->info.nowait_misses++;
        }
        release_pass(u, job); /* all started: the job may be freed once done */
        if (job == target)
            block = 0; /* later batches: their passes go on on the helpers */
        job = job->link;
    }
    return 0;
}

static void release(struct fs_uring *u, uint32_t s) {
    u->slots[s].job = NULL;
    u->free_slots[u->nfree++] = s;
    u->inflight--;
}

static void complete(struct fs_engine *eng, struct fs_uring *u, uint32_t s, int res) {
    struct slot *sl = &u->slots[s];
    struct fs_job *job = sl->job;
    const struct fs_batch *b = &job->b;
    int64_t i = sl->idx;
    u->inflight_bytes -= sl->len;

    if (res < 0) {
        if ((res == -EAGAIN || res == -EINTR) && sl->retries < FS_MAX_RETRIES && !u->draining) {
            sl->retries++;
            eng->info.retries++;
            if (queue_sqe(eng, u, s) == 0)
                return;
        }
        fs_job_finish(eng, job, i, u->draining && res == -EINTR ? -ECANCELED : res);
        release(u, s);
        return;
    }
    int64_t done = b->results[i] + res;
    int at_eof = res == 0 || (sl->direct && res % FS_DIRECT_ALIGN); /* O_DIRECT reads stop short only at EOF */
    if (done < b->lengths[i] && at_eof) {
        if (b->op == FS_OP_WRITE)
            fs_job_finish(eng, job, i, -EIO);
        else
            fs_job_finish(eng, job, i, (b->flags & FS_BATCH_ALLOW_EOF) ? done : -ENODATA);
        release(u, s);
        return;
    }
    b->results[i] = done;
    if (done < b->lengths[i]) { /* short transfer or a >1 GiB request: continue */
        if (!u->draining) {
            eng->info.requeues++;
            int ret = queue_sqe(eng, u, s);
            if (ret == 0)
                return;
            fs_job_finish(eng, job, i, ret);
        } else {
            fs_job_finish(eng, job, i, -ECANCELED);
        }
        release(u, s);
        return;
    }
    fs_job_finish(eng, job, i, done);
    release(u, s);
}

static void reap(struct fs_engine *eng, struct fs_uring *u) {
    struct io_uring_cqe *cqe;
    unsigned head, count = 0;
    io_uring_for_each_cqe(&u->ring, head, cqe) {
        complete(eng, u, (uint32_t)io_uring_cqe_get_data64(cqe), cqe->res);
        count++;
    }
    io_uring_cq_advance(&u->ring, count);
}

static int transient(int ret) {
    return ret == -EINTR || ret == -EAGAIN || ret == -EBUSY || ret == -ETIME;
}

/* One round: start what fits, submit, wait for one completion while target (NULL: none) is not done, reap. */
static int pump(struct fs_engine *eng, struct fs_uring *u, struct fs_job *target) {
    int ret = feed(eng, u, target);
    if (ret < 0 && !transient(ret))
        return ret;
    unsigned wait_nr = target && target->done < target->b.n && u->inflight ? 1 : 0;
    ret = wait_nr ? io_uring_submit_and_wait(&u->ring, wait_nr) : io_uring_submit(&u->ring);
    eng->info.syscalls++;
    if (ret < 0 && !transient(ret))
        return ret;
    if (!wait_nr) { /* let the kernel run pending completion work (COOP_TASKRUN) */
        struct io_uring_cqe *cqe;
        io_uring_peek_cqe(&u->ring, &cqe);
    }
    reap(eng, u);
    return 0;
}

static int u_submit(struct fs_engine *eng, struct fs_job *job) {
    int ret = pump(eng, eng->impl, NULL);
    if (ret < 0)
        eng->error = ret;
    return ret;
}

static int u_poll(struct fs_engine *eng, struct fs_job *job) {
    if (eng->error)
        return eng->error;
    int ret = pump(eng, eng->impl, NULL);
    if (ret < 0)
        return eng->error = ret;
    return job->done == job->b.n;
}

static int u_wait(struct fs_engine *eng, struct fs_job *job) {
    struct fs_uring *u = eng->impl;
    while (job->done < job->b.n) {
        if (eng->error)
            return eng->error;
        int ret = pump(eng, u, job);
        if (ret < 0)
            return eng->error = ret;
    }
    return 0;
}

static int u_register_files(struct fs_engine *eng, const int32_t *fds, uint32_t n) {
    struct fs_uring *u = eng->impl;
    int32_t maxfd = -1;
    for (uint32_t i = 0; i < n; i++)
        if (fds[i] > maxfd)
            maxfd = fds[i];
    int32_t *table = NULL;
    struct fs_fixed_file *files = NULL;
    if (maxfd >= 0) {
        table = malloc(sizeof(int32_t) * (size_t)(maxfd + 1));
        files = calloc(n, sizeof(*files));
        if (!table || !files) {
            free(table);
            free(files);
            return -ENOMEM;
        }
        memset(table, 0xff, sizeof(int32_t) * (size_t)(maxfd + 1));
        for (uint32_t i = 0; i < n; i++) {
            struct stat st;
            if (fds[i] < 0)
                continue;
            if (fstat(fds[i], &st) < 0) {
                int err = -errno;
                free(table);
                free(files);
                return err;
            }
            files[i] = (struct fs_fixed_file){(uint64_t)st.st_dev, (uint64_t)st.st_ino};
        }
    }
    quiesce_passes(eng, u); /* the pass threads look fds up in the table replaced here */
    if (u->cached)
        fs_cached_register_files(u->cached, NULL, 0);
    if (eng->info.registered_files) {
        int ret = io_uring_unregister_files(&u->ring);
        if (ret < 0) {
            free(table);
            free(files);
            return ret;
        }
        eng->info.registered_files = 0;
    }
    free(u->fixed.file_slot);
    free(u->fixed.files);
    u->fixed.file_slot = NULL;
    u->fixed.files = NULL;
    u->fixed.file_slot_len = 0;
    if (n == 0) {
        free(table);
        free(files);
        return 0;
    }
    int ret = io_uring_register_files(&u->ring, (const int *)fds, n);
    if (ret < 0) {
        free(table);
        free(files);
        return ret;
    }
    for (uint32_t i = 0; i < n; i++)
        if (fds[i] >= 0)
            table[fds[i]] = (int32_t)i;
    u->fixed.file_slot = table;
    u->fixed.files = files;
    u->fixed.file_slot_len = (uint32_t)(maxfd + 1);
    eng->info.registered_files = n;
    if (u->cached)
        fs_cached_register_files(u->cached, fds, n);
    return 0;
}

static int cmp_buf(const void *a, const void *b) {
    const struct fs_fixed_buf *x = a, *y = b;
    return x->addr < y->addr ? -1 : x->addr > y->addr;
}

static int u_register_buffers(struct fs_engine *eng, const uint64_t *addrs, const uint64_t *lens, uint32_t n) {
    struct fs_uring *u = eng->impl;
    uint64_t pieces = 0;
    for (uint32_t i = 0; i < n; i++)
        pieces += (lens[i] + FS_MAX_REGISTERED_BUFFER - 1) / FS_MAX_REGISTERED_BUFFER;
    if (pieces > 16384) /* IORING_MAX_REG_BUFFERS */
        return -E2BIG;
    struct fs_fixed_buf *bufs = NULL;
    struct iovec *iov = NULL;
    if (pieces) {
        bufs = malloc(sizeof(*bufs) * pieces);
        iov = malloc(sizeof(*iov) * pieces);
        if (!bufs || !iov) {
            free(bufs);
            free(iov);
            return -ENOMEM;
        }
    }
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++)
        for (uint64_t off = 0; off < lens[i]; off += FS_MAX_REGISTERED_BUFFER) {
            uint64_t rest = lens[i] - off;
            bufs[k++] = (struct fs_fixed_buf){addrs[i] + off, rest < FS_MAX_REGISTERED_BUFFER ? rest : FS_MAX_REGISTERED_BUFFER};
        }
    if (k)
        qsort(bufs, k, sizeof(*bufs), cmp_buf);
    for (uint32_t j = 0; j < k; j++)
        iov[j] = (struct iovec){(void *)(uintptr_t)bufs[j].addr, (size_t)bufs[j].len};

    quiesce_passes(eng, u); /* the pass threads look buffers up in the table replaced here */
    if (u->cached)
        fs_cached_register_buffers(u->cached, NULL, 0);
    if (u->fixed.nbufs) {
        int ret = io_uring_unregister_buffers(&u->ring);
        if (ret < 0) {
            free(bufs);
            free(iov);
            return ret;
        }
    }
    free(u->fixed.bufs);
    u->fixed.bufs = NULL;
    u->fixed.nbufs = 0;
    eng->info.registered_buffers = 0;
    int ret = 0;
    if (k) {
        ret = io_uring_register_buffers(&u->ring, iov, k);
        if (ret == 0) {
            u->fixed.bufs = bufs;
            u->fixed.nbufs = k;
            eng->info.registered_buffers = k;
            bufs = NULL;
            if (u->cached)
                fs_cached_register_buffers(u->cached, u->fixed.bufs, k);
        }
    }
    free(bufs);
    free(iov);
    return ret;
}

static void u_destroy(struct fs_engine *eng) {
    struct fs_uring *u = eng->impl;
    pthread_mutex_lock(&eng->lock);
    for (struct fs_job *job = eng->head; job; job = job->link) { /* helpers write into caller memory */
        if (job->pass_state == PASS_RUNNING)
            finish_pass(eng, u, job, 1);
        release_pass(u, job);
    }
    fs_jobs_cancel_unstarted(eng);
    u->draining = 1;
    /* No I/O may land in caller memory after destroy returns: wait for everything in flight. */
    while (u->inflight) {
        int ret = io_uring_submit_and_wait(&u->ring, 1);
        if (ret < 0 && !transient(ret))
            break;
        reap(eng, u);
    }
    pthread_mutex_unlock(&eng->lock);
    fs_cached_destroy(u->cached); /* its helpers are idle: every pass was collected above */
    io_uring_queue_exit(&u->ring); /* also drops registered files and buffers */
    free(u->fixed.bufs);
    free(u->fixed.files);
    free(u->fixed.file_slot);
    free(u->free_slots);
    free(u->slots);
    free(u);
    eng->impl = NULL;
}

static const struct fs_backend_ops uring_ops = {
    .submit = u_submit,
    .poll = u_poll,
    .wait = u_wait,
    .register_files = u_register_files,
    .register_buffers = u_register_buffers,
    .destroy = u_destroy,
};

static int ring_init(struct fs_uring *u, const struct fs_engine_opts *o, uint32_t *sqpoll_on) {
    struct io_uring_params p;
    unsigned extra = 0;
#ifdef IORING_SETUP_SUBMIT_ALL
    extra |= IORING_SETUP_SUBMIT_ALL; /* a bad SQE fails alone, through its CQE */
#endif
    if (o->sqpoll) {
        memset(&p, 0, sizeof(p));
        p.flags = IORING_SETUP_SQPOLL | extra;
        p.sq_thread_idle = o->sqpoll_idle_ms;
        if (io_uring_queue_init_params(u->qd, &u->ring, &p) == 0) {
            *sqpoll_on = 1;
            return 0;
        }
    }
#ifdef IORING_SETUP_COOP_TASKRUN
    extra |= IORING_SETUP_COOP_TASKRUN; /* no IPIs: we reap in our own calls anyway */
#endif
    memset(&p, 0, sizeof(p));
    p.flags = extra;
    int ret = io_uring_queue_init_params(u->qd, &u->ring, &p);
    if (ret == -EINVAL && extra) { /* older kernel: plain ring */
        memset(&p, 0, sizeof(p));
        ret = io_uring_queue_init_params(u->qd, &u->ring, &p);
    }
    return ret;
}

int fs_uring_create(struct fs_engine *eng) {
    struct fs_uring *u = calloc(1, sizeof(*u));
    if (!u)
        return -ENOMEM;
    u->qd = eng->opts.queue_depth;
    u->fdc.fd = -1;
    u->fdc.job = NULL;
    u->slots = calloc(u->qd, sizeof(*u->slots));
    u->free_slots = calloc(u->qd, sizeof(*u->free_slots));
    int ret = -ENOMEM;
    if (!u->slots || !u->free_slots)
        goto fail;
    for (uint32_t s = 0; s < u->qd; s++)
        u->free_slots[s] = u->qd - 1 - s;
    u->nfree = u->qd;
    uint32_t sqpoll_on = 0;
    ret = ring_init(u, &eng->opts, &sqpoll_on);
    if (ret < 0)
        goto fail;
    eng->impl = u;
    eng->ops = &uring_ops;
    eng->info.backend = FS_BACKEND_URING;
    eng->info.queue_depth = u->qd;
    eng->info.sqpoll = sqpoll_on;
    eng->info.nowait = !eng->opts.disable_nowait;
    if (!eng->opts.disable_nowait) {
        /* Page-cache pass threads: as many as the pool would use, at most one per CPU, the feeder included. */
        long cpus = sysconf(_SC_NPROCESSORS_ONLN);
        uint32_t threads = eng->opts.threads;
        if (cpus > 0 && (uint32_t)cpus < threads)
            threads = (uint32_t)cpus;
        if (threads > 1 && fs_cached_create(threads - 1, &u->fixed, &u->cached) < 0)
            u->cached = NULL; /* no helpers: the feeding thread probes alone */
        eng->info.threads = fs_cached_threads(u->cached);
        eng->info.cached_rings = u->cached ? fs_cached_rings(u->cached) : 0;
    }
    return 0;
fail:
    free(u->free_slots);
    free(u->slots);
    free(u);
    return ret;
}

#endif
