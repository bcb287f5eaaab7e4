/* Fallback backend: a pool of pthreads doing pread/pwrite, for kernels or sandboxes without
 * io_uring. Same semantics as the ring: batches run in submission order, every request gets its
 * own result, short transfers are continued, EAGAIN/EINTR retried. Work proceeds in the
 * background between submit and wait; a thread in wait also works on its own batch. */
#include <errno.h>
#include <stdlib.h>
#include <unistd.h>

#include "fs_internal.h"

struct fs_pool {
    pthread_t *tids;
    uint32_t nthreads;
    pthread_cond_t work; /* a batch has requests to start, or stop */
    pthread_cond_t done; /* a batch completed */
    int stop;
};

/* Run request i to completion; returns bytes or -errno. */
static int64_t do_request(const struct fs_job *job, int64_t i, struct fs_fd_cache *cache) {
    const struct fs_batch *b = &job->b;
    int direct = 0;
    int ret = fs_req_check(job, i, cache, &direct);
    if (ret < 0)
        return ret;
    int fd = b->fds[i];
    int64_t len = b->lengths[i], done = 0;
    uint32_t retries = 0;
    while (done < len) {
        int64_t rest = len - done;
        size_t chunk = (size_t)(rest < FS_MAX_CHUNK ? rest : FS_MAX_CHUNK);
        char *p = (char *)(uintptr_t)(b->addrs[i] + (uint64_t)done);
        off_t off = (off_t)(b->offsets[i] + done);
        ssize_t r = b->op == FS_OP_READ ? pread(fd, p, chunk, off) : pwrite(fd, p, chunk, off);
        if (r < 0) {
            if ((errno == EINTR || errno == EAGAIN) && retries++ < FS_MAX_RETRIES)
                continue;
            return -errno;
        }
        done += r;
        int at_eof = r == 0 || (direct && r % FS_DIRECT_ALIGN); /* O_DIRECT stops short only at EOF */
        if (done < len && at_eof) {
            if (b->op == FS_OP_WRITE)
                return -EIO;
            return (b->flags & FS_BATCH_ALLOW_EOF) ? done : -ENODATA;
        }
    }
    return done;
}

/* Start and run a few of job's requests (lock held on entry and exit, dropped for the I/O).
 * Taking several at once when there are plenty keeps the lock cold. */
static void run_chunk(struct fs_engine *eng, struct fs_pool *p, struct fs_job *job, struct fs_fd_cache *cache) {
    int64_t left = job->b.n - job->next;
    int64_t take = left / (4 * ((int64_t)p->nthreads + 1));
    take = take < 1 ? 1 : take > 16 ? 16 : take;
    int64_t first = job->next;
    job->next += take;
    pthread_mutex_unlock(&eng->lock);

    for (int64_t i = first; i < first + take; i++)
        job->b.results[i] = do_request(job, i, cache);

    pthread_mutex_lock(&eng->lock);
    for (int64_t i = first; i < first + take; i++)
        fs_job_finish(eng, job, i, job->b.results[i]);
    if (job->done == job->b.n)
        pthread_cond_broadcast(&p->done);
}

static void *worker(void *arg) {
    struct fs_engine *eng = arg;
    struct fs_pool *p = eng->impl;
    struct fs_fd_cache cache = {.job = NULL, .fd = -1};
    pthread_mutex_lock(&eng->lock);
    for (;;) {
        struct fs_job *job = NULL;
        while (!p->stop && !(job = fs_jobs_feedable(eng)))
            pthread_cond_wait(&p->work, &eng->lock);
        if (p->stop)
            break;
        run_chunk(eng, p, job, &cache);
    }
    pthread_mutex_unlock(&eng->lock);
    return NULL;
}

static int p_submit(struct fs_engine *eng, struct fs_job *job) {
    struct fs_pool *p = eng->impl;
    if (job->b.n)
        pthread_cond_broadcast(&p->work);
    return 0;
}

static int p_poll(struct fs_engine *eng, struct fs_job *job) {
    return job->done == job->b.n;
}

static int p_wait(struct fs_engine *eng, struct fs_job *job) {
    struct fs_pool *p = eng->impl;
    /* The waiting thread works on its own batch too: small batches skip two thread handoffs. */
    struct fs_fd_cache cache = {.job = NULL, .fd = -1};
    while (job->next < job->b.n && !p->stop)
        run_chunk(eng, p, job, &cache);
    while (job->done < job->b.n)
        pthread_cond_wait(&p->done, &eng->lock);
    return 0;
}

static int p_register_files(struct fs_engine *eng, const int32_t *fds, uint32_t n) {
    eng->info.registered_files = n; /* nothing to gain without a ring; accepted for symmetry */
    return 0;
}

static int p_register_buffers(struct fs_engine *eng, const uint64_t *addrs, const uint64_t *lens, uint32_t n) {
    eng->info.registered_buffers = n;
    return 0;
}

static void stop_threads(struct fs_engine *eng, struct fs_pool *p, uint32_t started) {
    pthread_mutex_lock(&eng->lock);
    fs_jobs_cancel_unstarted(eng);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&eng->lock);
    for (uint32_t t = 0; t < started; t++) /* each finishes the requests it holds first */
        pthread_join(p->tids[t], NULL);
}

static void p_destroy(struct fs_engine *eng) {
    struct fs_pool *p = eng->impl;
    stop_threads(eng, p, p->nthreads);
    pthread_cond_destroy(&p->done);
    pthread_cond_destroy(&p->work);
    free(p->tids);
    free(p);
    eng->impl = NULL;
}

static const struct fs_backend_ops pool_ops = {
    .submit = p_submit,
    .poll = p_poll,
    .wait = p_wait,
    .register_files = p_register_files,
    .register_buffers = p_register_buffers,
    .destroy = p_destroy,
};

int fs_pool_create(struct fs_engine *eng) {
    struct fs_pool *p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    int ret = -ENOMEM;
    p->tids = calloc(eng->opts.threads, sizeof(*p->tids));
    if (!p->tids)
        goto fail_free;
    ret = -pthread_cond_init(&p->work, NULL);
    if (ret < 0)
        goto fail_free;
    ret = -pthread_cond_init(&p->done, NULL);
    if (ret < 0)
        goto fail_work;
    eng->impl = p;
    eng->ops = &pool_ops;
    p->nthreads = eng->opts.threads;
    uint32_t t;
    for (t = 0; t < eng->opts.threads; t++) {
        ret = -pthread_create(&p->tids[t], NULL, worker, eng);
        if (ret < 0)
            goto fail_threads;
    }
    eng->info.backend = FS_BACKEND_PREAD;
    eng->info.threads = t;
    eng->info.queue_depth = t;
    return 0;

fail_threads:
    stop_threads(eng, p, t);
    eng->impl = NULL;
    eng->ops = NULL;
    pthread_cond_destroy(&p->done);
fail_work:
    pthread_cond_destroy(&p->work);
fail_free:
    free(p->tids);
    free(p);
    return ret;
}
