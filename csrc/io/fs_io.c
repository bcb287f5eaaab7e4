/* Engine core: options, backend choice, tickets and per-request checks shared by both backends. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fs_internal.h"

int fs_io_have_liburing(void) {
#ifdef FS_HAVE_LIBURING
    return 1;
#else
    return 0;
#endif
}

static int fill_defaults(const struct fs_engine_opts *in, struct fs_engine_opts *o) {
    if (in)
        *o = *in;
    else
        memset(o, 0, sizeof(*o));
    if (o->backend != FS_BACKEND_AUTO && o->backend != FS_BACKEND_URING && o->backend != FS_BACKEND_PREAD)
        return -EINVAL;
    if (o->queue_depth == 0)
        o->queue_depth = 64;
    if (o->threads == 0)
        o->threads = 4;
    if (o->queue_depth > 4096 || o->threads > 256)
        return -EINVAL;
    if (o->sqpoll_idle_ms == 0)
        o->sqpoll_idle_ms = 1000;
    if (o->max_inflight_bytes == 0)
        o->max_inflight_bytes = 64ull << 20;
    return 0;
}

int fs_engine_create(const struct fs_engine_opts *opts, struct fs_engine **out) {
    if (!out)
        return -EINVAL;
    *out = NULL;
    struct fs_engine *eng = calloc(1, sizeof(*eng));
    if (!eng)
        return -ENOMEM;
    int ret = fill_defaults(opts, &eng->opts);
    if (ret < 0)
        goto fail_free;
    ret = -pthread_mutex_init(&eng->lock, NULL);
    if (ret < 0)
        goto fail_free;
    eng->next_ticket = 1;

    ret = -ENOSYS;
    if (eng->opts.backend != FS_BACKEND_PREAD)
        ret = fs_uring_create(eng);
    if (ret < 0) {
        if (eng->opts.backend == FS_BACKEND_URING)
            goto fail_mutex;
        if (eng->opts.backend == FS_BACKEND_AUTO)
            eng->info.uring_errno = -ret;
        ret = fs_pool_create(eng);
        if (ret < 0)
            goto fail_mutex;
    }
    *out = eng;
    return 0;

fail_mutex:
    pthread_mutex_destroy(&eng->lock);
fail_free:
    free(eng);
    return ret;
}

void fs_engine_destroy(struct fs_engine *eng) {
    if (!eng)
        return;
    eng->ops->destroy(eng); /* cancels unstarted requests and drains those in flight */
    struct fs_job *job = eng->head;
    while (job) {
        struct fs_job *next = job->link;
        free(job);
        job = next;
    }
    pthread_mutex_destroy(&eng->lock);
    free(eng);
}

int fs_engine_info(struct fs_engine *eng, struct fs_engine_info *info) {
    if (!eng || !info)
        return -EINVAL;
    pthread_mutex_lock(&eng->lock);
    *info = eng->info;
    pthread_mutex_unlock(&eng->lock);
    return 0;
}

int fs_engine_register_files(struct fs_engine *eng, const int32_t *fds, uint32_t n) {
    if (!eng || (n && !fds))
        return -EINVAL;
    pthread_mutex_lock(&eng->lock);
    int ret = eng->ops->register_files(eng, fds, n);
    pthread_mutex_unlock(&eng->lock);
    return ret;
}

int fs_engine_register_buffers(struct fs_engine *eng, const uint64_t *addrs, const uint64_t *lens, uint32_t n) {
    if (!eng || (n && (!addrs || !lens)))
        return -EINVAL;
    for (uint32_t i = 0; i < n; i++)
        if (!addrs[i] || !lens[i] || addrs[i] + lens[i] < addrs[i])
            return -EINVAL;
    pthread_mutex_lock(&eng->lock);
    int ret = eng->ops->register_buffers(eng, addrs, lens, n);
    pthread_mutex_unlock(&eng->lock);
    return ret;
}

static int check_batch(const struct fs_batch *b) {
    if (!b || b->n < 0 || (b->op != FS_OP_READ && b->op != FS_OP_WRITE) || (b->flags & ~FS_BATCH_ALLOW_EOF))
        return -EINVAL;
    if (b->n > 0 && (!b->fds || !b->offsets || !b->lengths || !b->addrs || !b->results))
        return -EINVAL;
    return 0;
}

int fs_engine_submit(struct fs_engine *eng, const struct fs_batch *batch, uint64_t *ticket) {
    if (!eng || !ticket)
        return -EINVAL;
    int ret = check_batch(batch);
    if (ret < 0)
        return ret;
    struct fs_job *job = calloc(1, sizeof(*job));
    if (!job)
        return -ENOMEM;
    job->b = *batch;
    for (int64_t i = 0; i < batch->n; i++)
        batch->results[i] = 0;

    pthread_mutex_lock(&eng->lock);
    if (eng->error) {
        ret = eng->error;
        pthread_mutex_unlock(&eng->lock);
        free(job);
        return ret;
    }
    job->ticket = eng->next_ticket++;
    if (eng->tail)
        eng->tail->link = job;
    else
        eng->head = job;
    eng->tail = job;
    *ticket = job->ticket;
    ret = eng->ops->submit(eng, job);
    pthread_mutex_unlock(&eng->lock);
    return ret < 0 ? ret : 0;
}

static struct fs_job *find_job(struct fs_engine *eng, uint64_t ticket, struct fs_job **prev) {
    struct fs_job *p = NULL;
    for (struct fs_job *job = eng->head; job; p = job, job = job->link) {
        if (job->ticket == ticket) {
            if (prev)
                *prev = p;
            return job;
        }
    }
    return NULL;
}

int fs_engine_poll(struct fs_engine *eng, uint64_t ticket) {
    if (!eng)
        return -EINVAL;
    pthread_mutex_lock(&eng->lock);
    struct fs_job *job = find_job(eng, ticket, NULL);
    int ret = -ENOENT;
    if (job)
        ret = eng->ops->poll(eng, job);
    pthread_mutex_unlock(&eng->lock);
    return ret;
}

int64_t fs_engine_wait(struct fs_engine *eng, uint64_t ticket) {
    if (!eng)
        return -EINVAL;
    pthread_mutex_lock(&eng->lock);
    struct fs_job *prev = NULL;
    struct fs_job *job = find_job(eng, ticket, &prev);
    if (!job) {
        pthread_mutex_unlock(&eng->lock);
        return -ENOENT;
    }
    if (job->waiting) { /* another thread waits for it and will free it */
        pthread_mutex_unlock(&eng->lock);
        return -EBUSY;
    }
    job->waiting = 1;
    int ret = eng->ops->wait(eng, job);
    if (ret < 0) {
        job->waiting = 0; /* engine-level failure: the ticket stays, destroy drains it */
        pthread_mutex_unlock(&eng->lock);
        return ret;
    }
    /* wait may have dropped the lock (pool backend): look the neighbour up again */
    find_job(eng, ticket, &prev);
    if (prev)
        prev->link = job->link;
    else
        eng->head = job->link;
    if (eng->tail == job)
        eng->tail = prev;
    int64_t failed = job->failed;
    pthread_mutex_unlock(&eng->lock);
    free(job);
    return failed;
}

int64_t fs_engine_run(struct fs_engine *eng, const struct fs_batch *batch) {
    uint64_t ticket = 0;
    int ret = fs_engine_submit(eng, batch, &ticket);
    if (ret < 0)
        return ret;
    return fs_engine_wait(eng, ticket);
}

int fs_fsync(int fd, int datasync) {
    int ret;
    do
        ret = datasync ? fdatasync(fd) : fsync(fd);
    while (ret < 0 && errno == EINTR);
    return ret < 0 ? -errno : 0;
}

int fs_req_check(const struct fs_job *job, int64_t i, struct fs_fd_cache *cache, int *direct) {
    const struct fs_batch *b = &job->b;
    int fd = b->fds[i];
    int64_t off = b->offsets[i], len = b->lengths[i];
    uint64_t addr = b->addrs[i];
    if (fd < 0)
        return -EBADF;
    if (off < 0 || len < 0 || off > INT64_MAX - len)
        return -EINVAL;
    if (len > 0 && addr == 0)
        return -EFAULT;
    if (cache->fd != fd || cache->job != job) {
        int fl = fcntl(fd, F_GETFL);
        cache->job = job;
        cache->fd = fd;
        cache->flags = fl < 0 ? -errno : fl;
        cache->have_id = 0;
    }
    if (cache->flags < 0)
        return cache->flags;
    *direct = (cache->flags & O_DIRECT) != 0;
    if (*direct && ((uint64_t)off | (uint64_t)len | addr) % FS_DIRECT_ALIGN)
        return -EINVAL;
    return 0;
}

int fs_fd_identity(struct fs_fd_cache *cache, uint64_t *dev, uint64_t *ino) {
    if (!cache->have_id) {
        struct stat st;
        if (fstat(cache->fd, &st) < 0)
            return -errno;
        cache->dev = (uint64_t)st.st_dev;
        cache->ino = (uint64_t)st.st_ino;
        cache->have_id = 1;
    }
    *dev = cache->dev;
    *ino = cache->ino;
    return 0;
}

int fs_fixed_file_index(const struct fs_fixed *f, struct fs_fd_cache *cache) {
    int fd = cache->fd;
    if (!f || fd < 0 || (uint32_t)fd >= f->file_slot_len || f->file_slot[fd] < 0)
        return -1;
    int k = f->file_slot[fd];
    uint64_t dev, ino;
    if (fs_fd_identity(cache, &dev, &ino) < 0 || dev != f->files[k].dev || ino != f->files[k].ino)
        return -1;
    return k;
}

int fs_fixed_buf_index(const struct fs_fixed *f, uint64_t addr, uint64_t len) {
    if (!f || !f->nbufs)
        return -1;
    uint32_t lo = 0, hi = f->nbufs; /* last registered buffer starting at or below addr */
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (f->bufs[mid].addr <= addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    if (lo > 0 && addr + len <= f->bufs[lo - 1].addr + f->bufs[lo - 1].len)
        return (int)(lo - 1);
    return -1;
}

void fs_job_finish(struct fs_engine *eng, struct fs_job *job, int64_t i, int64_t res) {
    job->b.results[i] = res;
    job->done++;
    eng->info.requests++;
    if (res < 0) {
        job->failed++;
        eng->info.failed++;
    } else {
        eng->info.bytes += (uint64_t)res;
    }
}

void fs_jobs_cancel_unstarted(struct fs_engine *eng) {
    for (struct fs_job *job = eng->head; job; job = job->link)
        while (job->next < job->b.n)
            fs_job_finish(eng, job, job->next++, -ECANCELED);
}

struct fs_job *fs_jobs_feedable(struct fs_engine *eng) {
    for (struct fs_job *job = eng->head; job; job = job->link)
        if (job->next < job->b.n)
            return job;
    return NULL;
}
