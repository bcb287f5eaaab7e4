#include "fs_io.h"
int fs_io_have_liburing(void) {
#ifdef FS_HAVE_LIBURING
    return 1;
#else
    return 0;
#endif
}
