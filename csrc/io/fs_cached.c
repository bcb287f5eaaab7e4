/* The page-cache pass of the io_uring backend, on several threads.
 *
 * A buffered read whose pages are cached is a memcpy: preadv2(RWF_NOWAIT) does it without the ring's
 * overhead, but on one thread it is bound by one core's copy bandwidth, where the pread pool copies on
 * all of its threads. So before a batch's buffered reads go to the ring, the thread feeding the ring
 * and a few helpers probe them together, large reads in 1 MiB pieces so that one big transfer spreads
 * over the threads too: a request whose pieces were all read is finished, any other goes to the ring
 * whole. A pass gives up (the rest go straight to the ring) once most probes miss, so cold data costs
 * a few syscalls.
 *
 * Passes are queued, one per batch, in submission order, and the helpers work through them without
 * waiting for anyone: a batch submitted while the previous one is still being copied gets its pass at
 * once, and the helpers move on to it as soon as the previous pass has nothing left to claim. The
 * caller collects a pass (poll: when done; wait: taking part first). A thread that waits for a pass
 * whose last pieces a helper still holds (a helper the scheduler put aside, on a loaded machine) copies
 * pieces of later passes meanwhile instead of sleeping, so no thread idles while there is copying to do.
 * Helpers start on the first pass; an engine that only does O_DIRECT or writes never starts them.
 * Passes are started, collected and released under the engine lock.
 *
 * Each thread of a pass reads its claim (up to MAX_TAKE pieces) with one io_uring_enter on a small ring of its
 * own, RWF_NOWAIT reads that the kernel serves inline from the page cache or refuses with -EAGAIN: on the
 * engine's registered files and into its registered buffers (mirrored on these rings): no syscall, fdget, iovec
 * import and user-copy setup per piece (two threads reading random 16 KiB pieces of a cached file here: 2.5-2.7 us
 * of CPU per piece against 3.1-3.3 us with a preadv2 each). The
 * helpers own a ring each, the thread feeding the engine (under the engine lock) the first one. Where a ring
 * cannot be set up (no liburing, a kernel or seccomp that refuses it), that thread uses preadv2(RWF_NOWAIT). */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "fs_internal.h"

#ifdef FS_HAVE_LIBURING
#include <liburing.h>
#endif

#define CHUNK (1ll << 20) /* a large read is probed in pieces of this size, so one request spreads over threads */
#define MAX_TAKE 16       /* units per claim at most: few claims, yet a small tail for the last thread */

/* A pass thread's reader: its io_uring ring (the entries of one claim), or preadv2 where there is none. */
struct pass_ring {
    struct fs_cached *c;
#ifdef FS_HAVE_LIBURING
    struct io_uring ring;
#endif
    int inited;   /* the ring was set up (its fd is open until fs_cached_destroy) */
    int ok;       /* the ring is in use (it may turn itself off after a failure) */
    int files_ok; /* the engine's registered files are registered here too (same indices) */
    int bufs_ok;  /* and its registered buffers */
};

struct fs_cached_pass {
    struct fs_cached_pass *link; /* in the queue (started first, first), or in the spares */
    const struct fs_job *job;
    /* Request first + k owns units [unit_ptr[k], unit_ptr[k + 1]). */
    int64_t first, count, units;
    int64_t *unit_ptr;
    uint32_t *chunks_ok; /* per request: units read whole (atomic) */
    uint8_t *missed;     /* per request: a unit was not cached, or the request is not for the pass (atomic) */
    uint8_t *state;      /* per request, once collected: FS_PROBE_DONE or FS_PROBE_MISS */
    size_t cap;          /* requests the arrays above hold */
    int64_t next;         /* next unit to claim (atomic) */
    int64_t probes, hits; /* atomic */
    uint64_t ring_ops, fixed_buffer_ops, fixed_file_ops; /* atomic: reads issued on the pass rings */
    int off;              /* atomic: most probes missed, stop probing (claims are then skipped) */
    uint32_t busy;        /* helpers working on it (under mu) */
    int64_t threads;      /* threads that may claim its units, the feeder included (sizes the claims) */
};

struct fs_cached {
    pthread_mutex_t mu;
    pthread_cond_t go;   /* a pass has units to claim, or stop */
    pthread_cond_t idle; /* a helper left a pass */
    pthread_t *tids;
    uint32_t want, started;
    int stop;
    struct fs_cached_pass *head, *tail; /* started, not yet released (under mu) */
    struct fs_cached_pass *spares;      /* released, reused by the next start */
    const struct fs_fixed *fixed;       /* the engine's registration (NULL: none) */
    struct pass_ring *rings;            /* [0] the engine-lock holder's, [1 + t] helper t's */
    uint32_t nrings;                    /* helpers asked for + 1 */
};

/* Where unit u (request k's piece) reads: file offset, length, address; 0, or -1 when it is not for the pass (an
 * invalid request, or O_DIRECT: the ring reads the whole request and reports). */
static int unit_span(const struct fs_cached_pass *p, int64_t k, int64_t u, struct fs_fd_cache *cache, int64_t *off,
                     int64_t *len, uint64_t *addr) {
    const struct fs_batch *b = &p->job->b;
    int64_t i = p->first + k;
    int direct = 0;
    if (fs_req_check(p->job, i, cache, &direct) < 0 || direct)
        return -1;
    int64_t from = (u - p->unit_ptr[k]) * CHUNK;
    *len = b->lengths[i] - from < CHUNK ? b->lengths[i] - from : CHUNK;
    *off = b->offsets[i] + from;
    *addr = b->addrs[i] + (uint64_t)from;
    return 0;
}

/* Read a unit from the page cache only with preadv2; 1 when it was read whole. Not cached, the end of the file or
 * an error: 0. */
static int pread_unit(int fd, int64_t off, int64_t len, uint64_t addr) {
    int64_t done = 0;
    while (done < len) {
        struct iovec iov = {(void *)(uintptr_t)(addr + (uint64_t)done), (size_t)(len - done)};
        ssize_t r = preadv2(fd, &iov, 1, off + done, RWF_NOWAIT);
        if (r <= 0)
            return 0; /* EAGAIN (not cached), end of file, or an error */
        done += r;
    }
    return 1;
}

#ifdef FS_HAVE_LIBURING
static int transient(int ret) {
    return ret == -EINTR || ret == -EAGAIN || ret == -EBUSY || ret == -ETIME;
}

/* Read n units (fds or registered files, offsets, lengths, addresses; length 0: skip) with one io_uring_enter
 * on r; ok[j] = 1 for each read whole, issued[j] = 1 for each the kernel took. Counts the ring's reads in p. When
 * the ring itself fails, it is turned off and the units it never took are left to the caller. */
static void ring_units(struct fs_cached_pass *p, struct pass_ring *r, const int *fds, const int *files,
                       const int64_t *off, const int64_t *len, const uint64_t *addr, int n, uint8_t *ok,
                       uint8_t *issued) {
    uint64_t fixed_buffer_ops = 0, fixed_file_ops = 0;
    int queued = 0;
    for (int j = 0; j < n; j++) {
        issued[j] = 0;
        if (!len[j])
            continue;
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        if (!sqe)
            break; /* cannot happen: the ring holds MAX_TAKE entries, and every claim is reaped whole */
        void *dst = (void *)(uintptr_t)addr[j];
        int file = r->files_ok ? files[j] : -1;
        int buf = r->bufs_ok ? fs_fixed_buf_index(r->c->fixed, addr[j], (uint64_t)len[j]) : -1;
        int target = file >= 0 ? file : fds[j];
        if (buf >= 0)
            io_uring_prep_read_fixed(sqe, target, dst, (unsigned)len[j], (uint64_t)off[j], buf);
        else
            io_uring_prep_read(sqe, target, dst, (unsigned)len[j], (uint64_t)off[j]);
        sqe->rw_flags = RWF_NOWAIT; /* page cache only: -EAGAIN rather than a wait for the device */
        if (file >= 0) {
            sqe->flags |= IOSQE_FIXED_FILE;
            fixed_file_ops++;
        }
        fixed_buffer_ops += buf >= 0;
        io_uring_sqe_set_data64(sqe, (uint64_t)j);
        issued[j] = 1;
        queued++;
    }
    int reaped = 0;
    while (reaped < queued) {
        struct io_uring_cqe *first;
        int ret = r->ok ? io_uring_submit_and_wait(&r->ring, 1) : io_uring_wait_cqe_nr(&r->ring, &first, 1);
        if (ret < 0 && !transient(ret)) {
            if (!r->ok)
                break; /* nothing more can be learnt from this ring (a kernel fault: its reads count as misses) */
            /* The ring itself failed (not a read: those fail in their CQEs). What it took in still completes, and
             * must before the units go to the engine's ring: wait for those only; what it never took is unread
             * (the last SQEs: the kernel takes them in order) and is read by the caller. */
            unsigned left = io_uring_sq_ready(&r->ring);
            for (int j = n - 1; j >= 0 && left; j--)
                if (issued[j]) {
                    issued[j] = 0;
                    left--;
                    queued--;
                }
            r->ok = 0;
            continue;
        }
        struct io_uring_cqe *cqe;
        unsigned head, count = 0;
        io_uring_for_each_cqe(&r->ring, head, cqe) {
            int j = (int)io_uring_cqe_get_data64(cqe);
            ok[j] = cqe->res == len[j];
            count++;
        }
        io_uring_cq_advance(&r->ring, count);
        reaped += (int)count;
    }
    __atomic_add_fetch(&p->ring_ops, (uint64_t)queued, __ATOMIC_RELAXED);
    __atomic_add_fetch(&p->fixed_buffer_ops, fixed_buffer_ops, __ATOMIC_RELAXED);
    __atomic_add_fetch(&p->fixed_file_ops, fixed_file_ops, __ATOMIC_RELAXED);
}
#endif

/* Claim a few units of p and read them (or, once the pass gave up, mark them missed); 0 when p has none left.
 * The claim shrinks with what is left, so the last threads finish together. */
static int claim(struct fs_cached_pass *p, struct pass_ring *r, struct fs_fd_cache *cache) {
    int64_t seen = __atomic_load_n(&p->next, __ATOMIC_RELAXED);
    if (seen >= p->units)
        return 0;
    int64_t take = (p->units - seen) / (2 * p->threads);
    take = take < 1 ? 1 : take > MAX_TAKE ? MAX_TAKE : take;
    int64_t u = __atomic_fetch_add(&p->next, take, __ATOMIC_RELAXED);
    if (u >= p->units)
        return 0;
    int64_t end = u + take < p->units ? u + take : p->units;
    int64_t lo = 0, hi = p->count; /* the request owning unit u: last k with unit_ptr[k] <= u */
    while (hi - lo > 1) {
        int64_t mid = lo + (hi - lo) / 2;
        if (p->unit_ptr[mid] <= u)
            lo = mid;
        else
            hi = mid;
    }
    int off = __atomic_load_n(&p->off, __ATOMIC_RELAXED);
    int n = (int)(end - u);
    int64_t req[MAX_TAKE], offs[MAX_TAKE], lens[MAX_TAKE];
    uint64_t addrs[MAX_TAKE];
    uint8_t ok[MAX_TAKE], issued[MAX_TAKE];
    int fds[MAX_TAKE], files[MAX_TAKE]; /* files: registered slot, or -1 */
    int use_ring = r && r->ok;
    for (int64_t k = lo, j = 0; j < n; j++) {
        while (p->unit_ptr[k + 1] <= u + j)
            k++;
        req[j] = k;
        ok[j] = issued[j] = 0;
        lens[j] = 0; /* 0: not read (the pass gave up, or not for the pass) */
        if (!off && unit_span(p, k, u + j, cache, &offs[j], &lens[j], &addrs[j]) < 0)
            lens[j] = 0;
        fds[j] = cache->fd;
        files[j] = use_ring && r->files_ok && lens[j] ? fs_fixed_file_index(r->c->fixed, cache) : -1;
    }
    if (!off) {
#ifdef FS_HAVE_LIBURING
        if (use_ring)
            ring_units(p, r, fds, files, offs, lens, addrs, n, ok, issued);
#endif
        for (int j = 0; j < n; j++) /* no ring, or it failed before taking these */
            if (lens[j] && !issued[j])
                ok[j] = (uint8_t)pread_unit(fds[j], offs[j], lens[j], addrs[j]);
    }
    int64_t hits = 0;
    for (int j = 0; j < n; j++) {
        if (ok[j]) {
            __atomic_add_fetch(&p->chunks_ok[req[j]], 1, __ATOMIC_RELAXED);
            hits++;
        } else {
            __atomic_store_n(&p->missed[req[j]], 1, __ATOMIC_RELAXED);
        }
    }
    if (!off) {
        int64_t probes = __atomic_add_fetch(&p->probes, n, __ATOMIC_RELAXED);
        hits = __atomic_add_fetch(&p->hits, hits, __ATOMIC_RELAXED);
        if (probes >= 32 && hits * 8 < probes)
            __atomic_store_n(&p->off, 1, __ATOMIC_RELAXED);
    }
    return 1;
}

/* The oldest pass with units left to claim, or NULL (mu held). */
static struct fs_cached_pass *claimable(const struct fs_cached *c) {
    for (struct fs_cached_pass *p = c->head; p; p = p->link)
        if (__atomic_load_n(&p->next, __ATOMIC_RELAXED) < p->units)
            return p;
    return NULL;
}

/* Claim units of p while it has any (the caller holds p->busy, or owns p), reading with r. */
static void drain(struct fs_cached_pass *p, struct pass_ring *r) {
    struct fs_fd_cache cache = {.job = NULL, .fd = -1};
    while (claim(p, r, &cache))
        ;
}

static void *helper(void *arg) {
    struct pass_ring *r = arg;
    struct fs_cached *c = r->c;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        struct fs_cached_pass *p = NULL;
        while (!c->stop && !(p = claimable(c)))
            pthread_cond_wait(&c->go, &c->mu);
        if (c->stop)
            break;
        p->busy++; /* the pass is not collected while a helper is in it */
        pthread_mutex_unlock(&c->mu);
        drain(p, r);
        pthread_mutex_lock(&c->mu);
        if (--p->busy == 0)
            pthread_cond_broadcast(&c->idle);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Set up r's ring (r->ok stays 0 where that fails: its thread then reads with preadv2). */
static void ring_init(struct pass_ring *r, struct fs_cached *c) {
    r->c = c;
#ifdef FS_HAVE_LIBURING
    struct io_uring_params p;
    memset(&p, 0, sizeof(p));
#ifdef IORING_SETUP_COOP_TASKRUN
    p.flags |= IORING_SETUP_COOP_TASKRUN; /* its reads complete inline, or are refused: no IPIs wanted */
#endif
    int ret = io_uring_queue_init_params(MAX_TAKE, &r->ring, &p);
    if (ret == -EINVAL && p.flags) { /* an older kernel: a plain ring */
        memset(&p, 0, sizeof(p));
        ret = io_uring_queue_init_params(MAX_TAKE, &r->ring, &p);
    }
    r->inited = r->ok = ret == 0;
#endif
}

static void ring_exit(struct pass_ring *r) {
#ifdef FS_HAVE_LIBURING
    if (r->inited)
        io_uring_queue_exit(&r->ring); /* also drops what was registered on it */
#endif
    r->inited = r->ok = 0;
}

int fs_cached_create(uint32_t helpers, const struct fs_fixed *fixed, struct fs_cached **out) {
    struct fs_cached *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->want = helpers;
    c->fixed = fixed;
    if ((helpers && !(c->tids = calloc(helpers, sizeof(*c->tids)))) ||
        !(c->rings = calloc((size_t)helpers + 1, sizeof(*c->rings)))) {
        free(c->tids);
        free(c);
        return -ENOMEM;
    }
    c->nrings = helpers + 1;
    for (uint32_t t = 0; t < c->nrings; t++)
        ring_init(&c->rings[t], c);
    int ret = pthread_mutex_init(&c->mu, NULL);
    if (ret)
        goto fail;
    if ((ret = pthread_cond_init(&c->go, NULL)))
        goto fail_mu;
    if ((ret = pthread_cond_init(&c->idle, NULL)))
        goto fail_go;
    *out = c;
    return 0;
fail_go:
    pthread_cond_destroy(&c->go);
fail_mu:
    pthread_mutex_destroy(&c->mu);
fail:
    for (uint32_t t = 0; t < c->nrings; t++)
        ring_exit(&c->rings[t]);
    free(c->rings);
    free(c->tids);
    free(c);
    return -ret;
}

static void free_pass(struct fs_cached_pass *p) {
    free(p->unit_ptr);
    free(p->chunks_ok);
    free(p->missed);
    free(p->state);
    free(p);
}

void fs_cached_destroy(struct fs_cached *c) {
    if (!c)
        return;
    pthread_mutex_lock(&c->mu);
    c->stop = 1;
    pthread_cond_broadcast(&c->go);
    pthread_mutex_unlock(&c->mu);
    for (uint32_t t = 0; t < c->started; t++)
        pthread_join(c->tids[t], NULL);
    pthread_cond_destroy(&c->idle);
    pthread_cond_destroy(&c->go);
    pthread_mutex_destroy(&c->mu);
    for (struct fs_cached_pass *lists[2] = {c->head, c->spares}, **l = lists; l < lists + 2; l++)
        for (struct fs_cached_pass *p = *l, *next; p; p = next) {
            next = p->link;
            free_pass(p);
        }
    for (uint32_t t = 0; t < c->nrings; t++)
        ring_exit(&c->rings[t]);
    free(c->rings);
    free(c->tids);
    free(c);
}

/* A pass with room for count requests: a spare, or a new one; NULL without memory. */
static struct fs_cached_pass *new_pass(struct fs_cached *c, int64_t count) {
    pthread_mutex_lock(&c->mu);
    struct fs_cached_pass *p = c->spares;
    if (p)
        c->spares = p->link;
    pthread_mutex_unlock(&c->mu);
    if (!p && !(p = calloc(1, sizeof(*p))))
        return NULL;
    if ((size_t)count > p->cap) {
        int64_t *unit_ptr = realloc(p->unit_ptr, sizeof(*unit_ptr) * (size_t)(count + 1));
        if (unit_ptr)
            p->unit_ptr = unit_ptr;
        uint32_t *chunks_ok = realloc(p->chunks_ok, sizeof(*chunks_ok) * (size_t)count);
        if (chunks_ok)
            p->chunks_ok = chunks_ok;
        uint8_t *missed = realloc(p->missed, (size_t)count);
        if (missed)
            p->missed = missed;
        uint8_t *state = realloc(p->state, (size_t)count);
        if (state)
            p->state = state;
        if (!unit_ptr || !chunks_ok || !missed || !state) {
            free_pass(p);
            return NULL;
        }
        p->cap = (size_t)count;
    }
    p->link = NULL;
    return p;
}

int fs_cached_start(struct fs_cached *c, const struct fs_job *job, int64_t first, int64_t count,
                    struct fs_cached_pass **out) {
    const struct fs_batch *b = &job->b;
    struct fs_cached_pass *p = new_pass(c, count);
    if (!p)
        return -ENOMEM;
    p->job = job;
    p->first = first;
    p->count = count;
    p->unit_ptr[0] = 0;
    for (int64_t k = 0; k < count; k++) {
        int64_t len = b->lengths[first + k];
        p->unit_ptr[k + 1] = p->unit_ptr[k] + (len > 0 ? (len + CHUNK - 1) / CHUNK : 0);
    }
    memset(p->chunks_ok, 0, sizeof(*p->chunks_ok) * (size_t)count);
    memset(p->missed, 0, (size_t)count);
    p->units = p->unit_ptr[count];
    p->next = p->probes = p->hits = 0;
    p->ring_ops = p->fixed_buffer_ops = p->fixed_file_ops = 0;
    p->off = 0;
    p->busy = 0;

    pthread_mutex_lock(&c->mu);
    while (c->started < c->want) { /* first pass: start the helpers (fewer if the system refuses) */
        if (pthread_create(&c->tids[c->started], NULL, helper, &c->rings[1 + c->started]) != 0) {
            c->want = c->started;
            break;
        }
        c->started++;
    }
    p->threads = (int64_t)c->started + 1;
    if (c->tail)
        c->tail->link = p;
    else
        c->head = p;
    c->tail = p;
    if (c->started)
        pthread_cond_broadcast(&c->go);
    pthread_mutex_unlock(&c->mu);
    *out = p;
    return 0;
}

int fs_cached_finish(struct fs_cached *c, struct fs_cached_pass *p, int block, int *gave_up) {
    if (block || !c->started) /* take part: the pass's work is this thread's best use now */
        drain(p, &c->rings[0]);
    pthread_mutex_lock(&c->mu);
    if (!block && (p->busy || __atomic_load_n(&p->next, __ATOMIC_RELAXED) < p->units)) {
        pthread_mutex_unlock(&c->mu);
        return 0;
    }
    while (p->busy) { /* helpers hold its last units: copy for later passes meanwhile, a claim at a time */
        struct fs_cached_pass *q = claimable(c);
        if (!q) {
            pthread_cond_wait(&c->idle, &c->mu);
            continue;
        }
        q->busy++;
        pthread_mutex_unlock(&c->mu);
        struct fs_fd_cache cache = {.job = NULL, .fd = -1};
        claim(q, &c->rings[0], &cache);
        pthread_mutex_lock(&c->mu);
        if (--q->busy == 0)
            pthread_cond_broadcast(&c->idle);
    }
    *gave_up = __atomic_load_n(&p->off, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&c->mu);

    /* A request is served when every one of its units was read whole; the ring reads the rest from the start. */
    const struct fs_batch *b = &p->job->b;
    for (int64_t k = 0; k < p->count; k++) {
        int64_t units_k = p->unit_ptr[k + 1] - p->unit_ptr[k];
        int whole = units_k > 0 && !p->missed[k] && p->chunks_ok[k] == (uint32_t)units_k;
        p->state[k] = whole ? FS_PROBE_DONE : FS_PROBE_MISS;
        b->results[p->first + k] = whole ? b->lengths[p->first + k] : 0;
    }
    return 1;
}

uint8_t fs_cached_state(const struct fs_cached_pass *p, int64_t i) {
    if (i < p->first || i >= p->first + p->count)
        return FS_PROBE_NONE;
    return p->state[i - p->first];
}

void fs_cached_release(struct fs_cached *c, struct fs_cached_pass *p) {
    pthread_mutex_lock(&c->mu);
    struct fs_cached_pass **at = &c->head, *prev = NULL;
    while (*at && *at != p) {
        prev = *at;
        at = &(*at)->link;
    }
    if (*at) {
        *at = p->link;
        if (c->tail == p)
            c->tail = prev;
    }
    p->job = NULL;
    p->link = c->spares;
    c->spares = p;
    pthread_mutex_unlock(&c->mu);
}

uint32_t fs_cached_threads(const struct fs_cached *c) {
    return c ? c->want + 1 : 1;
}

void fs_cached_counts(const struct fs_cached_pass *p, uint64_t *ring_ops, uint64_t *fixed_buffer_ops,
                      uint64_t *fixed_file_ops) {
    *ring_ops = __atomic_load_n(&p->ring_ops, __ATOMIC_RELAXED);
    *fixed_buffer_ops = __atomic_load_n(&p->fixed_buffer_ops, __ATOMIC_RELAXED);
    *fixed_file_ops = __atomic_load_n(&p->fixed_file_ops, __ATOMIC_RELAXED);
}

uint32_t fs_cached_rings(const struct fs_cached *c) {
    uint32_t n = 0;
    for (uint32_t t = 0; t < c->nrings && t <= c->want; t++) /* the helpers that run, and the feeding thread */
        n += c->rings[t].ok != 0;
    return n;
}

void fs_cached_register_files(struct fs_cached *c, const int32_t *fds, uint32_t n) {
    for (uint32_t t = 0; t < c->nrings; t++) {
        struct pass_ring *r = &c->rings[t];
#ifdef FS_HAVE_LIBURING
        if (r->files_ok)
            io_uring_unregister_files(&r->ring);
        r->files_ok = r->ok && n && io_uring_register_files(&r->ring, (const int *)fds, n) == 0;
#else
        (void)fds;
        (void)n;
        r->files_ok = 0;
#endif
    }
}

void fs_cached_register_buffers(struct fs_cached *c, const struct fs_fixed_buf *bufs, uint32_t n) {
    struct iovec *iov = n ? malloc(sizeof(*iov) * n) : NULL;
    for (uint32_t j = 0; iov && j < n; j++)
        iov[j] = (struct iovec){(void *)(uintptr_t)bufs[j].addr, (size_t)bufs[j].len};
    for (uint32_t t = 0; t < c->nrings; t++) {
        struct pass_ring *r = &c->rings[t];
#ifdef FS_HAVE_LIBURING
        if (r->bufs_ok)
            io_uring_unregister_buffers(&r->ring);
        /* pins the pages once more per ring (counted against RLIMIT_MEMLOCK unless CAP_IPC_LOCK); refused, this
         * ring reads into plain buffers */
        r->bufs_ok = r->ok && iov && io_uring_register_buffers(&r->ring, iov, n) == 0;
#else
        r->bufs_ok = 0;
#endif
    }
    free(iov);
}
