/* foresight C I/O engine: batched reads and writes over io_uring, pread pool fallback.
 * Functions return 0 or a count on success and -errno on failure; they never print. */
#ifndef FS_IO_H
#define FS_IO_H
int fs_io_have_liburing(void);
#endif
