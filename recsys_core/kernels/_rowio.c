/* Row reads and writes for the cached embedding kernel's backing files (cached_tbe.py).
 *
 * Loading a cache miss reads one row of a backing file and evicting a trained row writes it
 * back: rows far apart in a file, a few hundred bytes each. pread/pwrite move them through the
 * page cache without mapping a page into the process (a memory-mapped access maps the page and
 * its cached neighbours, which must then be dropped again), in one call from Python that runs
 * without the GIL (ctypes releases it).
 *
 * Both return 0, or -(errno) after the first failed row (a short read past the end of the file
 * is -EIO). Loaded through ctypes; the module object exists only so that the package's build
 * can compile this file as an (optional) extension.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <unistd.h>

static int64_t move_rows(int fd, const int64_t *rows, int64_t n, int64_t row_bytes, char *buf,
                         int write) {
    for (int64_t i = 0; i < n; i++) {
        char *p = buf + i * row_bytes;
        int64_t off = rows[i] * row_bytes, done = 0;
        while (done < row_bytes) {
            ssize_t r = write ? pwrite(fd, p + done, (size_t)(row_bytes - done), off + done)
                              : pread(fd, p + done, (size_t)(row_bytes - done), off + done);
            if (r < 0) {
                if (errno == EINTR) continue;
                return -(int64_t)errno;
            }
            if (r == 0) return -(int64_t)EIO;
            done += r;
        }
    }
    return 0;
}

/* Read rows[i] (of row_bytes bytes each) of the file into dst[i]. */
int64_t recsys_read_rows(int fd, const int64_t *rows, int64_t n, int64_t row_bytes, char *dst) {
    return move_rows(fd, rows, n, row_bytes, dst, 0);
}

/* Write src[i] over rows[i] of the file. */
int64_t recsys_write_rows(int fd, const int64_t *rows, int64_t n, int64_t row_bytes,
                          const char *src) {
    return move_rows(fd, rows, n, row_bytes, (char *)src, 1);
}

static struct PyModuleDef rowio_module = {
    PyModuleDef_HEAD_INIT, "_rowio",
    "pread/pwrite of scattered rows, called through ctypes by recsys_core.kernels.cached_tbe",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__rowio(void) { return PyModule_Create(&rowio_module); }
