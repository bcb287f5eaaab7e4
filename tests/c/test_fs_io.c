/* C-level test of the I/O engine (csrc/io), meant to run under AddressSanitizer/LeakSanitizer:
 *   gcc -g -fsanitize=address,undefined -D_GNU_SOURCE -DFS_HAVE_LIBURING=1 -Icsrc/io
 *       csrc/io/fs_io.c csrc/io/fs_uring.c csrc/io/fs_pool.c csrc/io/fs_cached.c tests/c/test_fs_io.c
 *       -luring -lpthread
 *       -o test_fs_io && ./test_fs_io DIR
 * (tests/native/test__uring.py builds and runs it this way when gcc is present).
 * Exit codes follow liburing's test/helpers.h: 0 pass, 1 fail, 77 skip (no io_uring here). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "fs_io.h"

#define T_EXIT_PASS 0
#define T_EXIT_FAIL 1
#define T_EXIT_SKIP 77

#define N 256
#define BS 4096

#define CHECK(cond)                                                                 \
    do {                                                                            \
        if (!(cond)) {                                                              \
            fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
            return T_EXIT_FAIL;                                                     \
        }                                                                           \
    } while (0)

struct arrays {
    int32_t fds[N];
    int64_t offsets[N], lengths[N], results[N];
    uint64_t addrs[N];
};

static struct fs_batch make(struct arrays *a, uint32_t op, int64_t n) {
    return (struct fs_batch){op, 0, n, a->fds, a->offsets, a->lengths, a->addrs, a->results};
}

static int run_backend(int backend, const char *dir) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/fs_io_c_%d.bin", dir, backend);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    unsigned char *src = mmap(NULL, N * BS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    unsigned char *dst = mmap(NULL, 2 * N * BS, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(src != MAP_FAILED && dst != MAP_FAILED);
    for (size_t i = 0; i < (size_t)N * BS; i++)
        src[i] = (unsigned char)(i * 31 + 7);

    /* RWF_NOWAIT off: the file is in the page cache, and the ring path is the one to test */
    struct fs_engine_opts opts = {.backend = backend, .queue_depth = 8, .threads = 3, .disable_nowait = 1};
    struct fs_engine *eng = NULL;
    int ret = fs_engine_create(&opts, &eng);
    if (ret == -ENOSYS || ret == -EPERM)
        return T_EXIT_SKIP;
    CHECK(ret == 0);

    static struct arrays a;
    for (int i = 0; i < N; i++) { /* write blocks in reverse order */
        a.fds[i] = fd;
        a.offsets[i] = (int64_t)(N - 1 - i) * BS;
        a.lengths[i] = BS;
        a.addrs[i] = (uint64_t)(uintptr_t)(src + (size_t)(N - 1 - i) * BS);
    }
    struct fs_batch b = make(&a, FS_OP_WRITE, N);
    CHECK(fs_engine_run(eng, &b) == 0);
    CHECK(fs_fsync(fd, 1) == 0);

    int32_t fds[1] = {fd};
    uint64_t baddr[1] = {(uint64_t)(uintptr_t)dst}, blen[1] = {2 * N * BS};
    CHECK(fs_engine_register_files(eng, fds, 1) == 0);
    CHECK(fs_engine_register_buffers(eng, baddr, blen, 1) == 0);

    /* two overlapping batches, waited in reverse order */
    static struct arrays r1, r2;
    for (int i = 0; i < N; i++) {
        r1.fds[i] = r2.fds[i] = fd;
        r1.offsets[i] = r2.offsets[i] = (int64_t)i * BS;
        r1.lengths[i] = r2.lengths[i] = BS;
        r1.addrs[i] = (uint64_t)(uintptr_t)(dst + (size_t)i * BS);
        r2.addrs[i] = (uint64_t)(uintptr_t)(dst + (size_t)(N + i) * BS);
    }
    struct fs_batch b1 = make(&r1, FS_OP_READ, N), b2 = make(&r2, FS_OP_READ, N);
    uint64_t t1, t2;
    CHECK(fs_engine_submit(eng, &b1, &t1) == 0);
    CHECK(fs_engine_submit(eng, &b2, &t2) == 0);
    CHECK(fs_engine_wait(eng, t2) == 0);
    CHECK(fs_engine_wait(eng, t1) == 0);
    CHECK(fs_engine_wait(eng, t1) == -ENOENT);
    CHECK(memcmp(src, dst, (size_t)N * BS) == 0);
    CHECK(memcmp(src, dst + (size_t)N * BS, (size_t)N * BS) == 0);

    /* per-request failures */
    r1.fds[1] = -1;
    r1.offsets[2] = (int64_t)N * BS; /* at EOF */
    b1.n = 3;
    CHECK(fs_engine_run(eng, &b1) == 2);
    CHECK(r1.results[0] == BS && r1.results[1] == -EBADF && r1.results[2] == -ENODATA);

    struct fs_engine_info info;
    CHECK(fs_engine_info(eng, &info) == 0);
    CHECK(info.backend == backend && info.failed == 2);
    if (backend == FS_BACKEND_URING)
        CHECK(info.fixed_file_ops >= 2 * N && info.fixed_buffer_ops >= 2 * N);

    /* destroy with a batch outstanding: no leak, no late writes */
    r1.fds[1] = fd;
    r1.offsets[2] = 0;
    b1.n = N;
    CHECK(fs_engine_submit(eng, &b1, &t1) == 0);
    fs_engine_destroy(eng);
    for (int i = 0; i < N; i++)
        CHECK(r1.results[i] == BS || r1.results[i] == -ECANCELED);

    munmap(src, (size_t)N * BS);
    munmap(dst, 2 * (size_t)N * BS);
    close(fd);
    unlink(path);
    return T_EXIT_PASS;
}

/* The page-cache pass on helper threads: a warm file is served whole by it (every read a hit, from
 * several threads), an evicted one gives up and goes to the ring; the bytes are right either way. */
static int run_cached_pass(const char *dir) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/fs_io_c_cached.bin", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    unsigned char *src = malloc((size_t)N * BS), *dst = malloc((size_t)N * BS);
    CHECK(src && dst);
    for (size_t i = 0; i < (size_t)N * BS; i++)
        src[i] = (unsigned char)(i * 13 + 5);
    CHECK(pwrite(fd, src, (size_t)N * BS, 0) == (ssize_t)N * BS);

    struct fs_engine_opts opts = {.backend = FS_BACKEND_URING, .queue_depth = 16, .threads = 4};
    struct fs_engine *eng = NULL;
    int ret = fs_engine_create(&opts, &eng);
    if (ret == -ENOSYS || ret == -EPERM)
        return T_EXIT_SKIP;
    CHECK(ret == 0);
    static struct arrays a;
    for (int round = 0; round < 3; round++) {
        if (round == 2) { /* evicted: the probes miss, the pass gives up, the ring reads */
            CHECK(fdatasync(fd) == 0);
            CHECK(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0);
        }
        memset(dst, 0, (size_t)N * BS);
        for (int i = 0; i < N; i++) { /* a permutation of the blocks (37 is prime to N) */
            int k = (i * 37 + round) % N;
            a.fds[i] = fd;
            a.offsets[i] = (int64_t)k * BS;
            a.lengths[i] = BS;
            a.addrs[i] = (uint64_t)(uintptr_t)(dst + (size_t)k * BS);
        }
        struct fs_batch b = make(&a, FS_OP_READ, N);
        CHECK(fs_engine_run(eng, &b) == 0);
        for (int i = 0; i < N; i++)
            CHECK(a.results[i] == BS);
        CHECK(memcmp(src, dst, (size_t)N * BS) == 0);
    }
    struct fs_engine_info info;
    CHECK(fs_engine_info(eng, &info) == 0);
    CHECK(info.nowait_hits >= N); /* the warm rounds */

    /* the pass runs behind submit: two batches in flight, completed by polling alone, then waited for */
    static struct arrays a2;
    memset(dst, 0, (size_t)N * BS);
    unsigned char *dst2 = calloc(N, BS);
    CHECK(dst2);
    for (int i = 0; i < N; i++) {
        a.offsets[i] = a2.offsets[i] = (int64_t)i * BS;
        a.fds[i] = a2.fds[i] = fd;
        a.lengths[i] = a2.lengths[i] = BS;
        a.addrs[i] = (uint64_t)(uintptr_t)(dst + (size_t)i * BS);
        a2.addrs[i] = (uint64_t)(uintptr_t)(dst2 + (size_t)i * BS);
    }
    struct fs_batch p1 = make(&a, FS_OP_READ, N), p2 = make(&a2, FS_OP_READ, N);
    uint64_t pt1, pt2;
    CHECK(fs_engine_submit(eng, &p1, &pt1) == 0);
    CHECK(fs_engine_submit(eng, &p2, &pt2) == 0);
    int polls = 0;
    while (fs_engine_poll(eng, pt2) != 1)
        CHECK(++polls < 100000000);
    CHECK(fs_engine_poll(eng, pt1) == 1);
    CHECK(fs_engine_wait(eng, pt2) == 0 && fs_engine_wait(eng, pt1) == 0);
    for (int i = 0; i < N; i++)
        CHECK(a.results[i] == BS && a2.results[i] == BS);
    CHECK(memcmp(src, dst, (size_t)N * BS) == 0 && memcmp(src, dst2, (size_t)N * BS) == 0);

    /* three batches queued on the helpers, the last waited for first (its wait takes part in the passes before
     * it), then the others */
    static struct arrays a3;
    unsigned char *dst3 = calloc(N, BS);
    CHECK(dst3);
    memset(dst, 0, (size_t)N * BS);
    memset(dst2, 0, (size_t)N * BS);
    for (int i = 0; i < N; i++) {
        a3.offsets[i] = (int64_t)i * BS;
        a3.fds[i] = fd;
        a3.lengths[i] = BS;
        a3.addrs[i] = (uint64_t)(uintptr_t)(dst3 + (size_t)i * BS);
    }
    struct fs_batch p3 = make(&a3, FS_OP_READ, N);
    uint64_t pt3;
    CHECK(fs_engine_submit(eng, &p1, &pt1) == 0);
    CHECK(fs_engine_submit(eng, &p2, &pt2) == 0);
    CHECK(fs_engine_submit(eng, &p3, &pt3) == 0);
    CHECK(fs_engine_wait(eng, pt3) == 0 && fs_engine_wait(eng, pt1) == 0 && fs_engine_wait(eng, pt2) == 0);
    for (int i = 0; i < N; i++)
        CHECK(a.results[i] == BS && a2.results[i] == BS && a3.results[i] == BS);
    CHECK(memcmp(src, dst, (size_t)N * BS) == 0 && memcmp(src, dst2, (size_t)N * BS) == 0 &&
          memcmp(src, dst3, (size_t)N * BS) == 0);
    free(dst3);
    free(dst2);

    /* large reads are probed in 1 MiB pieces spread over the threads: pieces of one request, odd edges,
     * and a request over bytes another one also reads (into its own buffer) */
    const int64_t big = (6ll << 20) + 123, cut = (5ll << 19) + 1, inner = (1ll << 20) + 4096;
    unsigned char *bsrc = malloc((size_t)big), *bdst = calloc(1, (size_t)big), *bdst2 = calloc(1, (size_t)big);
    CHECK(bsrc && bdst && bdst2);
    for (int64_t i = 0; i < big; i++)
        bsrc[i] = (unsigned char)(i * 7 + (i >> 20));
    CHECK(pwrite(fd, bsrc, (size_t)big, 0) == (ssize_t)big);
    int64_t offs[3] = {0, cut, inner}, lens[3] = {cut, big - cut, cut - inner};
    unsigned char *dsts[3] = {bdst, bdst + cut, bdst2 + inner};
    for (int i = 0; i < 3; i++) {
        a.fds[i] = fd;
        a.offsets[i] = offs[i];
        a.lengths[i] = lens[i];
        a.addrs[i] = (uint64_t)(uintptr_t)dsts[i];
    }
    CHECK(fs_engine_info(eng, &info) == 0);
    uint64_t hits_before = info.nowait_hits;
    struct fs_batch bb = make(&a, FS_OP_READ, 3);
    CHECK(fs_engine_run(eng, &bb) == 0);
    for (int i = 0; i < 3; i++)
        CHECK(a.results[i] == lens[i]);
    CHECK(memcmp(bsrc, bdst, (size_t)big) == 0);
    CHECK(memcmp(bsrc + inner, bdst2 + inner, (size_t)(cut - inner)) == 0);
    CHECK(fs_engine_info(eng, &info) == 0);
    CHECK(info.nowait_hits == hits_before + 3);
    free(bsrc);
    free(bdst);
    free(bdst2);
    /* a batch in flight when the engine goes: helpers joined, nothing leaked */
    for (int i = 0; i < N; i++) {
        a.offsets[i] = (int64_t)i * BS;
        a.lengths[i] = BS;
        a.addrs[i] = (uint64_t)(uintptr_t)(dst + (size_t)i * BS);
    }
    uint64_t t;
    struct fs_batch b = make(&a, FS_OP_READ, N);
    CHECK(fs_engine_submit(eng, &b, &t) == 0);
    fs_engine_destroy(eng);
    free(src);
    free(dst);
    close(fd);
    return T_EXIT_PASS;
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "/tmp";
    int pool = run_backend(FS_BACKEND_PREAD, dir);
    if (pool != T_EXIT_PASS)
        return pool == T_EXIT_SKIP ? T_EXIT_FAIL : pool;
    int ring = fs_io_have_liburing() ? run_backend(FS_BACKEND_URING, dir) : T_EXIT_SKIP;
    if (ring != T_EXIT_PASS)
        return ring;
    return run_cached_pass(dir);
}
