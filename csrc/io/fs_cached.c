/* The page-cache pass of the io_uring backend, on several threads.
 *
 * A buffered read whose pages are cached is a memcpy: preadv2(RWF_NOWAIT) does it without the ring's
 * overhead, but on one thread it is bound by one core's copy bandwidth, where the pread pool copies on
 * all of its threads. So before a batch's buffered reads go to the ring, the thread feeding the ring
 * and a few helpers probe them together (fork-join, the feeder taking part), large reads in 1 MiB
 * pieces so that one big transfer spreads over the threads too: a request whose pieces were all read
 * is finished, any other goes to the ring whole. The pass gives up (the rest go straight to the ring)
 * once most probes miss, so cold data costs a few syscalls.
 *
 * The pass is asynchronous: submit starts it and returns (the caller can collate the previous step
 * while the helpers copy this one); poll collects it once done; wait takes part in it, then collects it.
 * Helpers start on the first pass; an engine that only does O_DIRECT or writes never starts them.
 * Passes are started and collected under the engine lock, one at a time. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "fs_internal.h"

#define CHUNK (1ll << 20) /* a large read is probed in pieces of this size, so one request spreads over threads */

struct fs_cached {
    pthread_mutex_t mu;
    pthread_cond_t go;   /* a pass started, or stop */
    pthread_cond_t idle; /* a helper left the pass */
    pthread_t *tids;
    uint32_t want, started;
    int stop;
    uint64_t generation;
    uint32_t busy; /* helpers inside the current pass */
    /* the current pass (job == NULL: none). Request first + k owns units [unit_ptr[k], unit_ptr[k + 1]). */
    const struct fs_job *job;
    int64_t first, count, units, take;
    int64_t *unit_ptr;
    uint32_t *chunks_ok; /* per request: units read whole (atomic) */
    uint8_t *missed;     /* per request: a unit was not cached, or the request is not for the pass (atomic) */
    size_t cap;          /* requests the arrays above hold */
    int64_t next;         /* next unit to claim (atomic) */
    int64_t probes, hits; /* atomic */
    int off;              /* atomic: most probes missed, stop probing */
};

/* Read unit u (request k's piece) from the page cache only; 1 when it was read whole. Not cached, O_DIRECT, an
 * invalid request or the end of the file: 0, and the ring reads the whole request and reports. */
static int probe_unit(const struct fs_cached *c, int64_t k, int64_t u, struct fs_fd_cache *cache) {
    const struct fs_batch *b = &c->job->b;
    int64_t i = c->first + k;
    int direct = 0;
    if (fs_req_check(c->job, i, cache, &direct) < 0 || direct)
        return 0;
    int64_t from = (u - c->unit_ptr[k]) * CHUNK;
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

/* Claim units of the current pass, ``take`` at a time, and probe them until none are left or the pass gives up. */
static void work(struct fs_cached *c) {
    struct fs_fd_cache cache = {.job = NULL, .fd = -1};
    for (;;) {
        if (__atomic_load_n(&c->off, __ATOMIC_RELAXED))
            return;
        int64_t u = __atomic_fetch_add(&c->next, c->take, __ATOMIC_RELAXED);
        if (u >= c->units)
            return;
        int64_t end = u + c->take < c->units ? u + c->take : c->units;
        int64_t lo = 0, hi = c->count; /* the request owning unit u: last k with unit_ptr[k] <= u */
        while (hi - lo > 1) {
            int64_t mid = lo + (hi - lo) / 2;
            if (c->unit_ptr[mid] <= u)
                lo = mid;
            else
                hi = mid;
        }
        int64_t hits = 0, probed = end - u;
        for (int64_t k = lo; u < end; u++) {
            while (c->unit_ptr[k + 1] <= u)
                k++;
            if (probe_unit(c, k, u, &cache)) {
                __atomic_add_fetch(&c->chunks_ok[k], 1, __ATOMIC_RELAXED);
                hits++;
            } else {
                __atomic_store_n(&c->missed[k], 1, __ATOMIC_RELAXED);
            }
        }
        int64_t probes = __atomic_add_fetch(&c->probes, probed, __ATOMIC_RELAXED);
        hits = __atomic_add_fetch(&c->hits, hits, __ATOMIC_RELAXED);
        if (probes >= 32 && hits * 8 < probes)
            __atomic_store_n(&c->off, 1, __ATOMIC_RELAXED);
    }
}

static void *helper(void *arg) {
    struct fs_cached *c = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && (c->generation == seen || !c->job))
            pthread_cond_wait(&c->go, &c->mu);
        if (c->stop)
            break;
        seen = c->generation;
        c->busy++;
        pthread_mutex_unlock(&c->mu);
        work(c); /* the pass's fields stay put until busy drops to 0 */
        pthread_mutex_lock(&c->mu);
        if (--c->busy == 0)
            pthread_cond_signal(&c->idle);
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
    free(c->unit_ptr);
    free(c->chunks_ok);
    free(c->missed);
    free(c->tids);
    free(c);
}

int fs_cached_start(struct fs_cached *c, const struct fs_job *job, int64_t first, int64_t count) {
    const struct fs_batch *b = &job->b;
    if ((size_t)count > c->cap) {
        int64_t *unit_ptr = realloc(c->unit_ptr, sizeof(*unit_ptr) * (size_t)(count + 1));
        if (unit_ptr)
            c->unit_ptr = unit_ptr;
        uint32_t *chunks_ok = realloc(c->chunks_ok, sizeof(*chunks_ok) * (size_t)count);
        if (chunks_ok)
            c->chunks_ok = chunks_ok;
        uint8_t *missed = realloc(c->missed, (size_t)count);
        if (missed)
            c->missed = missed;
        if (!unit_ptr || !chunks_ok || !missed)
            return -ENOMEM;
        c->cap = (size_t)count;
    }
    c->unit_ptr[0] = 0;
    for (int64_t k = 0; k < count; k++) {
        int64_t len = b->lengths[first + k];
        c->unit_ptr[k + 1] = c->unit_ptr[k] + (len > 0 ? (len + CHUNK - 1) / CHUNK : 0);
    }
    memset(c->chunks_ok, 0, sizeof(*c->chunks_ok) * (size_t)count);
    memset(c->missed, 0, (size_t)count);
    int64_t units = c->unit_ptr[count];

    pthread_mutex_lock(&c->mu);
    while (c->started < c->want) { /* first pass: start the helpers (fewer if the system refuses) */
        if (pthread_create(&c->tids[c->started], NULL, helper, c) != 0) {
            c->want = c->started;
            break;
        }
        c->started++;
    }
    int64_t take = units / (4 * ((int64_t)c->started + 1)); /* a few claims per thread: cheap, balanced */
    c->job = job;
    c->first = first;
    c->count = count;
    c->units = units;
    c->take = take < 1 ? 1 : take > 16 ? 16 : take;
    __atomic_store_n(&c->next, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->probes, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->hits, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->off, 0, __ATOMIC_RELAXED);
    c->generation++;
    if (c->started)
        pthread_cond_broadcast(&c->go);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

int fs_cached_finish(struct fs_cached *c, int block, uint8_t *state, int *gave_up) {
    if (block || !c->started) /* take part: the pass's work is this thread's best use now */
        work(c);
    pthread_mutex_lock(&c->mu);
    if (!block) {
        int claimed = __atomic_load_n(&c->next, __ATOMIC_RELAXED) >= c->units || __atomic_load_n(&c->off, __ATOMIC_RELAXED);
        if (c->busy || !claimed) {
            pthread_mutex_unlock(&c->mu);
            return 0;
        }
    }
    while (c->busy)
        pthread_cond_wait(&c->idle, &c->mu);
    const struct fs_job *job = c->job;
    c->job = NULL; /* helpers waking late find no pass */
    *gave_up = __atomic_load_n(&c->off, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&c->mu);

    /* A request is served when every one of its units was read whole; the ring reads the rest from the start. */
    const struct fs_batch *b = &job->b;
    for (int64_t k = 0; k < c->count; k++) {
        int64_t units_k = c->unit_ptr[k + 1] - c->unit_ptr[k];
        int whole = units_k > 0 && !c->missed[k] && c->chunks_ok[k] == (uint32_t)units_k;
        state[k] = whole ? FS_PROBE_DONE : FS_PROBE_MISS;
        b->results[c->first + k] = whole ? b->lengths[c->first + k] : 0;
    }
    return 1;
}

uint32_t fs_cached_threads(const struct fs_cached *c) {
    return c ? c->want + 1 : 1;
}
