/* Ordering and waiting on 64-bit words in a shared-memory segment, for
 * recsys_core.distributed.shm_comm (the intra-host transport of the CPU collectives).
 *
 * The payload is written with ordinary (or string / non-temporal) stores by torch's copy; a
 * writer then publishes a sequence number with store_release, which fences first so that every
 * earlier store (non-temporal ones included: sfence) is visible before the number is. Readers
 * wait_ge on the number (acquire loads) before they read the payload.
 *
 * wait_ge spins briefly, then yields, then sleeps in short naps, always with the GIL released:
 * the core it spins on is the one its own rank (and its data loader thread) computes on.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#define STORE_FENCE() _mm_sfence()
#else
#define CPU_RELAX() ((void)0)
#define STORE_FENCE() __atomic_thread_fence(__ATOMIC_SEQ_CST)
#endif

static int parse_addr(PyObject *obj, int64_t **out) {
    unsigned long long a = PyLong_AsUnsignedLongLong(obj);
    if (a == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (a == 0 || (a & 7)) {
        PyErr_SetString(PyExc_ValueError, "shm word address must be non-null and 8-byte aligned");
        return -1;
    }
    *out = (int64_t *)(uintptr_t)a;
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static PyObject *load_acquire(PyObject *self, PyObject *args) {
    PyObject *addr_obj;
    int64_t *addr;
    if (!PyArg_ParseTuple(args, "O", &addr_obj) || parse_addr(addr_obj, &addr)) return NULL;
    return PyLong_FromLongLong(__atomic_load_n(addr, __ATOMIC_ACQUIRE));
}

static PyObject *store_release(PyObject *self, PyObject *args) {
    PyObject *addr_obj;
    long long value;
    int64_t *addr;
    if (!PyArg_ParseTuple(args, "OL", &addr_obj, &value) || parse_addr(addr_obj, &addr))
        return NULL;
    STORE_FENCE();
    __atomic_store_n(addr, (int64_t)value, __ATOMIC_RELEASE);
    Py_RETURN_NONE;
}

/* wait_ge(addr, target, slice_s, abort_addr) -> the word's value: >= target when it got
 * there, smaller when slice_s passed or the abort word became non-zero first (the caller
 * checks the abort word, its peers' liveness and its own deadline, then calls again). */
static PyObject *wait_ge(PyObject *self, PyObject *args) {
    PyObject *addr_obj, *abort_obj;
    long long target;
    double slice_s;
    int64_t *addr, *abort_word;
    if (!PyArg_ParseTuple(args, "OLdO", &addr_obj, &target, &slice_s, &abort_obj) ||
        parse_addr(addr_obj, &addr) || parse_addr(abort_obj, &abort_word))
        return NULL;
    int64_t v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
    if (v >= target) return PyLong_FromLongLong(v);
    Py_BEGIN_ALLOW_THREADS
    double deadline = now_s() + slice_s;
    long nap_ns = 2000;
    for (unsigned long i = 0;; i++) {
        v = __atomic_load_n(addr, __ATOMIC_ACQUIRE);
        if (v >= target || __atomic_load_n(abort_word, __ATOMIC_ACQUIRE) != 0) break;
        if (i < 256) {
            CPU_RELAX();
        } else if (i < 512) {
            sched_yield();
        } else {
            struct timespec ts = {0, nap_ns};
            nanosleep(&ts, NULL);
            if (nap_ns < 50000) nap_ns += nap_ns / 2;
            if ((i & 15) == 0 && now_s() > deadline) break;
        }
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLongLong(v);
}

static PyMethodDef methods[] = {
    {"load_acquire", load_acquire, METH_VARARGS, "load_acquire(addr) -> int64 (acquire load)"},
    {"store_release", store_release, METH_VARARGS,
     "store_release(addr, value): store fence, then a release store of value"},
    {"wait_ge", wait_ge, METH_VARARGS,
     "wait_ge(addr, target, slice_s, abort_addr) -> value; GIL released while waiting"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shm_sync", NULL, -1, methods};

PyMODINIT_FUNC PyInit__shm_sync(void) { return PyModule_Create(&module); }
