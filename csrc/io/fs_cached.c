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
 * Passes are started, collected and released under the engine lock. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "fs_internal.h"

#define CHUNK (1ll << 20) /* a large read is probed in pieces of this size, so one request spreads over threads */
#define MAX_TAKE 16       /* units per claim at most: few claims, yet a small tail for the last thread */

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
};

/* Read unit u (request k's piece) from the page cache only; 1 when it was read whole. Not cached, O_DIRECT, an
 * invalid request or the end of the file: 0, and the ring reads the whole request and reports. */
static int probe_unit(const struct fs_cached_pass *p, int64_t k, int64_t u, struct fs_fd_cache *cache) {
    const struct fs_batch *b = &p->job->b;
    int64_t i = p->first + k;
    int direct = 0;
    if (fs_req_check(p->job, i, cache, &direct) < 0 || direct)
        return 0;
    int64_t from = (u - p->unit_ptr[k]) * CHUNK;
    int64_t len = b->lengths[i] - from < CHUNK ? b->lengths[i] - from : CHUNK;
    int64_t done = 0;
    while (done < len) {
        struct iovec iov = {(void *)(uintptr_t)(b->addrs[i] + (uint64_t)(from + done)), (size_t)(len - done)};
        ssize_t r = preadv2(b->fds[i], &iov, 1, b->offsets[i] + from + done, RWF_NOWAIT);
        if (r <= 0)
            return 0; /* EAGAIN (not cached), end of file, or an error */
        done += r;
    }
    return 1;
}

/* Claim a few units of p and probe them (or, once the pass gave up, mark them missed); 0 when p has none left.
 * The claim shrinks with what is left, so the last threads finish together. */
static int claim(struct fs_cached_pass *p, struct fs_fd_cache *cache) {
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
    int64_t hits = 0, probed = end - u;
    for (int64_t k = lo; u < end; u++) {
        while (p->unit_ptr[k + 1] <= u)
            k++;
        if (!off && probe_unit(p, k, u, cache)) {
            __atomic_add_fetch(&p->chunks_ok[k], 1, __ATOMIC_RELAXED);
            hits++;
        } else {
            __atomic_store_n(&p->missed[k], 1, __ATOMIC_RELAXED);
        }
    }
    if (!off) {
        int64_t probes = __atomic_add_fetch(&p->probes, probed, __ATOMIC_RELAXED);
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

/* Claim units of p while it has any (the caller holds p->busy, or owns p). */
static void drain(struct fs_cached_pass *p) {
    struct fs_fd_cache cache = {.job = NULL, .fd = -1};
    while (claim(p, &cache))
        ;
}

static void *helper(void *arg) {
    struct fs_cached *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        struct fs_cached_pass *p = NULL;
        while (!c->stop && !(p = claimable(c)))
            pthread_cond_wait(&c->go, &c->mu);
        if (c->stop)
            break;
        p->busy++; /* the pass is not collected while a helper is in it */
        pthread_mutex_unlock(&c->mu);
        drain(p);
        pthread_mutex_lock(&c->mu);
        if (--p->busy == 0)
            pthread_cond_broadcast(&c->idle);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

int fs_cached_create(uint32_t helpers, struct fs_cached **out) {
    struct fs_cached *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    c->want = helpers;
    if (helpers && !(c->tids = calloc(helpers, sizeof(*c->tids)))) {
        free(c);
        return -ENOMEM;
    }
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
    p->off = 0;
    p->busy = 0;

    pthread_mutex_lock(&c->mu);
    while (c->started < c->want) { /* first pass: start the helpers (fewer if the system refuses) */
        if (pthread_create(&c->tids[c->started], NULL, helper, c) != 0) {
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
        drain(p);
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
        claim(q, &cache);
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
