/* cffi declarations for foresight._uring; mirrors csrc/io/fs_io.h (the one C API). */
int fs_io_have_liburing(void);
