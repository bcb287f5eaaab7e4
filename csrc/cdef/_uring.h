/* cffi declarations for foresight._uring; mirrors csrc/io/fs_io.h (the one C API, documented there).
 * Constants and struct layouts are filled in by the compiler ("..."). */
#define FS_BACKEND_AUTO ...
#define FS_BACKEND_URING ...
#define FS_BACKEND_PREAD ...
#define FS_OP_READ ...
#define FS_OP_WRITE ...
#define FS_BATCH_ALLOW_EOF ...
#define FS_DIRECT_ALIGN ...
#define FS_MAX_REGISTERED_BUFFER ...

struct fs_engine;

struct fs_engine_opts {
    int32_t backend;
    uint32_t queue_depth;
    uint32_t threads;
    uint32_t sqpoll;
    uint32_t sqpoll_idle_ms;
    uint32_t disable_nowait;
    uint64_t max_inflight_bytes;
    ...;
};

struct fs_batch {
    uint32_t op;
    uint32_t flags;
    int64_t n;
    const int32_t *fds;
    const int64_t *offsets;
    const int64_t *lengths;
    const uint64_t *addrs;
    int64_t *results;
    ...;
};

struct fs_engine_info {
    int32_t backend;
    int32_t uring_errno;
    uint32_t queue_depth;
    uint32_t threads;
    uint32_t sqpoll;
    uint32_t nowait;
    uint32_t registered_files;
    uint32_t registered_buffers;
    uint64_t requests;
    uint64_t bytes;
    uint64_t failed;
    uint64_t nowait_hits;
    uint64_t nowait_misses;
    uint64_t fixed_buffer_ops;
    uint64_t fixed_file_ops;
    uint64_t requeues;
    uint64_t retries;
    uint64_t syscalls;
    uint32_t cached_rings;
    uint64_t cached_ring_ops;
    uint64_t cached_fixed_buffer_ops;
    uint64_t cached_fixed_file_ops;
    ...;
};

int fs_io_have_liburing(void);

int fs_engine_create(const struct fs_engine_opts *opts, struct fs_engine **out);
void fs_engine_destroy(struct fs_engine *eng);
int fs_engine_info(struct fs_engine *eng, struct fs_engine_info *info);
int fs_engine_register_files(struct fs_engine *eng, const int32_t *fds, uint32_t n);
int fs_engine_register_buffers(struct fs_engine *eng, const uint64_t *addrs, const uint64_t *lens, uint32_t n);
int64_t fs_engine_run(struct fs_engine *eng, const struct fs_batch *batch);
int fs_engine_submit(struct fs_engine *eng, const struct fs_batch *batch, uint64_t *ticket);
int fs_engine_poll(struct fs_engine *eng, uint64_t ticket);
int64_t fs_engine_wait(struct fs_engine *eng, uint64_t ticket);
int fs_fsync(int fd, int datasync);
