/* Row reads and writes for the cached embedding kernel's backing files (offload_store.py).
 *
 * Loading a cache miss reads one row of a backing file and evicting a trained row writes it
 * back: rows far apart in a file, a few hundred bytes each. pread/pwrite move them through the
 * page cache without mapping a page into the process (a memory-mapped access maps the page and
 * its cached neighbours, which must then be dropped again), in one call from Python that runs
 * without the GIL (ctypes releases it).
 *
 * Each row moved can also be hashed while it is in cache: with coef != NULL, row i's int32
 * words w_j add sum_j w_j * coef[j] (mod 2^64) to acc[i]; the caller keeps the top 32 bits of
 * the sum over a row's files as its checksum (offload_store.row_checksums is the same in torch).
 *
 * Read and write return 0, or -(errno) after the first failed row (a short read past the end
 * of the file is -EIO). Loaded through ctypes; the module object exists only so that the
 * package's build can compile this file as an (optional) extension.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

static uint64_t hash_row(const char *p, int64_t row_bytes, const uint64_t *coef) {
    uint64_t h = 0;
    int64_t words = row_bytes / 4;
    for (int64_t j = 0; j < words; j++) {
        int32_t w;
        memcpy(&w, p + 4 * j, 4);
        h += (uint64_t)(int64_t)w * coef[j];
    }
    return h;
}

static int64_t move_rows(int fd, const int64_t *rows, int64_t n, int64_t row_bytes, char *buf,
                         int write, const uint64_t *coef, uint64_t *acc) {
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
        if (coef) acc[i] += hash_row(p, row_bytes, coef);
    }
    return 0;
}

/* Read rows[i] (of row_bytes bytes each) of the file into dst[i] (hashed into acc[i]). */
int64_t recsys_read_rows(int fd, const int64_t *rows, int64_t n, int64_t row_bytes, char *dst,
                         const uint64_t *coef, uint64_t *acc) {
    return move_rows(fd, rows, n, row_bytes, dst, 0, coef, acc);
}

/* Write src[i] over rows[i] of the file (hashed into acc[i]). */
int64_t recsys_write_rows(int fd, const int64_t *rows, int64_t n, int64_t row_bytes,
                          const char *src, const uint64_t *coef, uint64_t *acc) {
    return move_rows(fd, rows, n, row_bytes, (char *)src, 1, coef, acc);
}

/* Hash n contiguous rows in memory into acc[i] (a whole store, block by block). */
void recsys_hash_rows(const char *src, int64_t n, int64_t row_bytes, const uint64_t *coef,
                      uint64_t *acc) {
    for (int64_t i = 0; i < n; i++) acc[i] += hash_row(src + i * row_bytes, row_bytes, coef);
}

static struct PyModuleDef rowio_module = {
    PyModuleDef_HEAD_INIT, "_rowio",
    "pread/pwrite and hashing of scattered rows, called through ctypes by "
    "recsys_core.kernels.offload_store",
    -1, NULL,
};

PyMODINIT_FUNC PyInit__rowio(void) { return PyModule_Create(&rowio_module); }
