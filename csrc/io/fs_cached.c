/* The page-cache pass of the io_uring backend, on several threads.
 *
 * A buffered read whose pages are cached is a memcpy: preadv2(RWF_NOWAIT) does it without the ring's
 * overhead, but on one thread it is bound by one core's copy bandwidth, where the pread pool copies on
 * all of its threads. So before a batch's buffered reads go to the ring, the thread feeding the ring
 * and a few helpers probe them together (fork-join, the feeder taking part): a request served whole
 * is finished, the rest go to the ring with the bytes already read. The pass gives up (the rest go
 * straight to the ring) once most probes miss, so cold data costs a few syscalls.
 *
 * Helpers start on the first pass; an engine that only does O_DIRECT or writes never starts them.
 * Passes are serialised by the engine lock (the feeder holds it), so one pass runs at a time. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <unistd.h>

#include "fs_internal.h"

struct fs_cached {
    pthread_mutex_t mu;
    pthread_cond_t go;   /* a pass started, or stop */
    pthread_cond_t idle; /* a helper left the pass */
    pthread_t *tids;
    uint32_t want, started;
    int stop;
    uint64_t generation;
    uint32_t busy; /* helpers inside the current pass */
    /* the current pass (job == NULL: none) */
    const struct fs_job *job;
    int64_t first, count, take;
    uint8_t *state;
    int64_t next;           /* next index to claim (atomic) */
    int64_t probes, hits;   /* atomic */
    int off;                /* atomic: most probes missed, stop probing */
};

/* Read request i from the page cache only. FS_PROBE_DONE: results[i] is final (all bytes, or the
 * end-of-file outcome); FS_PROBE_MISS: results[i] holds the bytes read so far, the ring does the rest
 * (not cached, O_DIRECT, empty, or invalid: the ring path reports those). */
static uint8_t probe(const struct fs_job *job, int64_t i, struct fs_fd_cache *cache) {
    const struct fs_batch *b = &job->b;
    int direct = 0;
    b->results[i] = 0;
    if (b->lengths[i] == 0 || fs_req_check(job, i, cache, &direct) < 0 || direct)
        return FS_PROBE_MISS;
    int64_t len = b->lengths[i], done = 0;
    while (done < len) {
        int64_t rest = len - done;
        struct iovec iov = {(void *)(uintptr_t)(b->addrs[i] + (uint64_t)done),
                            (size_t)(rest < FS_MAX_CHUNK ? rest : FS_MAX_CHUNK)};
        ssize_t r = preadv2(b->fds[i], &iov, 1, b->offsets[i] + done, RWF_NOWAIT);
        if (r == 0) { /* end of file: the ring would say the same */
            b->results[i] = (b->flags & FS_BATCH_ALLOW_EOF) ? done : -ENODATA;
            return FS_PROBE_DONE;
        }
        if (r < 0)
            break; /* EAGAIN (not cached) or anything else: the ring does it and reports */
        done += r;
    }
    b->results[i] = done;
    return done == len ? FS_PROBE_DONE : FS_PROBE_MISS;
}

/* Claim and probe requests of the current pass, ``take`` at a time, until none are left or the pass
 * gives up. */
static void work(struct fs_cached *c, const struct fs_job *job, int64_t first, int64_t count, uint8_t *state,
                 int64_t take) {
    struct fs_fd_cache cache = {.job = NULL, .fd = -1};
    for (;;) {
        if (__atomic_load_n(&c->off, __ATOMIC_RELAXED))
            return;
        int64_t k = __atomic_fetch_add(&c->next, take, __ATOMIC_RELAXED);
        if (k >= count)
            return;
        int64_t end = k + take < count ? k + take : count;
        int64_t hits = 0, probed = end - k;
        for (; k < end; k++) {
            state[k] = probe(job, first + k, &cache);
            hits += state[k] == FS_PROBE_DONE;
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
        const struct fs_job *job = c->job;
        int64_t first = c->first, count = c->count, take = c->take;
        uint8_t *state = c->state;
        c->busy++;
        pthread_mutex_unlock(&c->mu);
        work(c, job, first, count, state, take);
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
    free(c->tids);
    free(c);
}

int64_t fs_cached_run(struct fs_cached *c, const struct fs_job *job, int64_t first, int64_t count, uint8_t *state,
                      int *gave_up) {
    memset(state, FS_PROBE_NONE, (size_t)count);
    pthread_mutex_lock(&c->mu);
    while (c->started < c->want) { /* first pass: start the helpers (fewer if the system refuses) */
        if (pthread_create(&c->tids[c->started], NULL, helper, c) != 0) {
            c->want = c->started;
            break;
        }
        c->started++;
    }
    int64_t take = count / (4 * ((int64_t)c->started + 1)); /* a few claims per thread: cheap, balanced */
    take = take < 1 ? 1 : take > 16 ? 16 : take;
    c->job = job;
    c->first = first;
    c->count = count;
    c->take = take;
    c->state = state;
    __atomic_store_n(&c->next, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->probes, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->hits, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&c->off, 0, __ATOMIC_RELAXED);
    c->generation++;
    if (c->started)
        pthread_cond_broadcast(&c->go);
    pthread_mutex_unlock(&c->mu);

    work(c, job, first, count, state, take);

    pthread_mutex_lock(&c->mu);
    while (c->busy)
        pthread_cond_wait(&c->idle, &c->mu);
    c->job = NULL; /* helpers waking late find no pass */
    *gave_up = __atomic_load_n(&c->off, __ATOMIC_RELAXED);
    int64_t hits = __atomic_load_n(&c->hits, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&c->mu);
    return hits;
}

uint32_t fs_cached_threads(const struct fs_cached *c) {
    return c ? c->want + 1 : 1;
}
