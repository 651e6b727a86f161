/* engram.store._pread_pool.Aio: batched O_DIRECT page reads through Linux native AIO (io_submit /
 * io_getevents), for the disk tier's io="direct" reads.
 *
 * Aio(depth) owns one kernel AIO context of `depth` slots. Aio.read(fd, offsets, size, out, inject_index=-1,
 * inject_errno=0, inject_got=0, crc_out=None, crc_page=0, priority=0) has Pool.read's contract (csrc/pread_pool.c):
 * block i of `size` bytes from offsets[i] into out[i*size:], up to `depth` reads in flight, the CRC32C of each
 * crc_page-byte page of a block into crc_out once that block is in, None when every block was read in full,
 * else (index, errno, got) of the lowest failing block; the same fault injection. The GIL is released while
 * the call submits and waits. A priority-0 call counts as a decode read in flight (read_call.h), which holds
 * back the pools' priority-1 jobs; priority-1 reads go through the pool (reader.py), where they can wait.
 *
 * Why: the thread pool wakes one sleeping worker per block in flight. On the virtual machines we measured,
 * a worker that slept through a decode step (~4 ms) costs tens of microseconds to wake, so a batch-1 lookup's
 * 24 reads took 0.56-0.64 ms after an idle gap against 0.44 ms back to back; one io_submit of all 24 and
 * waiting for their completions took 0.41 / 0.33 ms (docs/store.md). With O_DIRECT the kernel queues the
 * reads to the device without a thread per read; with the page cache (io="buffered") io_submit would read
 * synchronously, so buffered reads stay on the pool.
 *
 * A context serves one thread at a time (io_getevents would hand one caller another's completions):
 * reader.py keeps one per thread and depth. A block that completes short (only at the end of the file, for
 * O_DIRECT) is finished with pread, which then reports EOF as a short read, like the pool.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "read_call.h"

typedef struct {
    PyObject_HEAD
    aio_context_t ctx;
    int depth;
    struct iocb *cbs;     /* [depth] */
    struct iocb **ptrs;   /* [depth] */
    struct io_event *evs; /* [depth] */
    int *free_slots;      /* [depth]: stack of unused iocbs */
} Aio;

static void aio_free(Aio *self) {
    if (self->ctx) syscall(SYS_io_destroy, self->ctx);
    self->ctx = 0;
    PyMem_RawFree(self->cbs);
    PyMem_RawFree(self->ptrs);
    PyMem_RawFree(self->evs);
    PyMem_RawFree(self->free_slots);
    self->cbs = NULL;
    self->ptrs = NULL;
    self->evs = NULL;
    self->free_slots = NULL;
}

static int Aio_init(Aio *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"depth", NULL};
    int depth;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &depth)) return -1;
    if (depth < 1 || depth > 1024) {
        PyErr_Format(PyExc_ValueError, "depth=%d: must be in [1, 1024]", depth);
        return -1;
    }
    if (self->ctx) {
        PyErr_SetString(PyExc_RuntimeError, "Aio is already initialised");
        return -1;
    }
    static int crc_ready; /* crc32c.h keeps its tables per file: this file's, filled once (the GIL is held) */
    if (!crc_ready) {
        crc32c_init();
        crc_ready = 1;
    }
    self->depth = depth;
    self->cbs = PyMem_RawCalloc((size_t)depth, sizeof(struct iocb));
    self->ptrs = PyMem_RawCalloc((size_t)depth, sizeof(struct iocb *));
    self->evs = PyMem_RawCalloc((size_t)depth, sizeof(struct io_event));
    self->free_slots = PyMem_RawCalloc((size_t)depth, sizeof(int));
    if (!self->cbs || !self->ptrs || !self->evs || !self->free_slots) {
        aio_free(self);
        PyErr_NoMemory();
        return -1;
    }
    if (syscall(SYS_io_setup, depth, &self->ctx) != 0) {
        self->ctx = 0;
        aio_free(self);
        PyErr_SetFromErrno(PyExc_OSError);
        return -1;
    }
    return 0;
}

static void Aio_dealloc(Aio *self) {
    aio_free(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

typedef struct {
    int fd;
    const int64_t *offsets;
    Py_ssize_t size, n;
    char *out;
    Py_ssize_t crc_page;
    uint32_t *crc_out;
    Py_ssize_t fail_index, fail_got;
    int fail_errno;
} Batch;

static void fail_block(Batch *b, Py_ssize_t i, int err, Py_ssize_t got) {
    if (b->fail_index < 0 || i < b->fail_index) {
        b->fail_index = i;
        b->fail_errno = err;
        b->fail_got = got;
    }
}

/* A block that came back short: the rest with pread (EOF then shows as a short read). */
static void finish_short(Batch *b, Py_ssize_t i, Py_ssize_t have) {
    int err;
    Py_ssize_t got;
    if (pread_full(b->fd, b->out + i * b->size, b->size, b->offsets[i], have, &err, &got) != 0)
        fail_block(b, i, err, got);
    else
        crc_block(b->out, i, b->size, b->crc_page, b->crc_out);
}

/* Runs without the GIL. Returns 0, or an errno of the context itself (io_submit / io_getevents failing). */
static int run_batch(Aio *self, Batch *b, Py_ssize_t inject_index, int inject_errno, Py_ssize_t inject_got) {
    int nfree = self->depth;
    for (int k = 0; k < self->depth; k++) self->free_slots[k] = self->depth - 1 - k;
    Py_ssize_t next = 0, inflight = 0;
    while (next < b->n || inflight > 0) {
        int batch = 0;
        while (next < b->n && nfree > 0) {
            Py_ssize_t i = next++;
            if (i == inject_index) {
                fail_block(b, i, inject_errno, inject_errno ? 0 : (inject_got < b->size ? inject_got : b->size - 1));
                continue;
            }
            if (b->fail_index >= 0) continue; /* a block failed: the rest are skipped, as in the pool */
            int slot = self->free_slots[--nfree];
            struct iocb *cb = &self->cbs[slot];
            memset(cb, 0, sizeof *cb);
            cb->aio_data = ((uint64_t)i << 16) | (uint64_t)slot;
            cb->aio_lio_opcode = IOCB_CMD_PREAD;
            cb->aio_fildes = (uint32_t)b->fd;
            cb->aio_buf = (uint64_t)(uintptr_t)(b->out + i * b->size);
            cb->aio_nbytes = (uint64_t)b->size;
            cb->aio_offset = b->offsets[i];
            self->ptrs[batch++] = cb;
        }
        int sent = 0;
        while (sent < batch) {
            long r = syscall(SYS_io_submit, self->ctx, (long)(batch - sent), self->ptrs + sent);
            if (r < 0) {
                if (errno == EINTR) continue;
                if (errno == EAGAIN && inflight > 0) break; /* reap some first, then submit the rest */
                int err = errno;
                for (int k = sent; k < batch; k++) { /* never submitted: they fail here */
                    uint64_t d = self->ptrs[k]->aio_data;
                    fail_block(b, (Py_ssize_t)(d >> 16), err, 0);
                    self->free_slots[nfree++] = (int)(d & 0xffff);
                }
                batch = sent;
                break;
            }
            sent += (int)r;
            inflight += r;
        }
        if (sent < batch) { /* EAGAIN: put the unsent blocks back in line, reap, retry */
            for (int k = batch - 1; k >= sent; k--) {
                uint64_t d = self->ptrs[k]->aio_data;
                self->free_slots[nfree++] = (int)(d & 0xffff);
            }
            next = (Py_ssize_t)(self->ptrs[sent]->aio_data >> 16);
        }
        if (inflight == 0) continue;
        long got = syscall(SYS_io_getevents, self->ctx, 1L, (long)inflight, self->evs, NULL);
        if (got < 0) {
            if (errno == EINTR) continue;
            return errno;
        }
        for (long e = 0; e < got; e++) {
            uint64_t d = self->evs[e].data;
            Py_ssize_t i = (Py_ssize_t)(d >> 16);
            int64_t res = self->evs[e].res;
            self->free_slots[nfree++] = (int)(d & 0xffff);
            inflight--;
            if (res < 0) fail_block(b, i, (int)-res, 0);
            else if (res < b->size) finish_short(b, i, (Py_ssize_t)res);
            else crc_block(b->out, i, b->size, b->crc_page, b->crc_out);
        }
    }
    return 0;
}

static PyObject *Aio_read(Aio *self, PyObject *args, PyObject *kwds) {
    if (!self->ctx) {
        PyErr_SetString(PyExc_RuntimeError, "Aio is closed");
        return NULL;
    }
    ReadCall c;
    if (read_call_parse(args, kwds, &c) < 0) return NULL;
    if (c.n >= ((Py_ssize_t)1 << 47)) { /* a block's index shares aio_data with its iocb slot (16 bits) */
        read_call_release(&c);
        PyErr_SetString(PyExc_ValueError, "too many blocks");
        return NULL;
    }
    Batch b = {c.fd, (const int64_t *)c.offs.buf, c.size, c.n, (char *)c.out.buf, c.crc_page,
               (uint32_t *)c.crc.buf, -1, 0, 0};
    int ctx_err = 0;
    if (c.n > 0) {
        Py_BEGIN_ALLOW_THREADS
        if (c.priority == 0) engram_decode_begin();
        ctx_err = run_batch(self, &b, c.inject_index, c.inject_errno, c.inject_got);
        if (c.priority == 0) engram_decode_end();
        if (ctx_err) { /* reads may still be in flight into `out`: io_destroy waits for them; then a fresh
                          context, so this object keeps reading (or reports itself closed) */
            syscall(SYS_io_destroy, self->ctx);
            self->ctx = 0;
            if (syscall(SYS_io_setup, self->depth, &self->ctx) != 0) self->ctx = 0;
        }
        Py_END_ALLOW_THREADS
    }
    read_call_release(&c);
    if (ctx_err) {
        errno = ctx_err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return read_call_result(b.fail_index, b.fail_errno, b.fail_got);
}

static PyObject *Aio_get_depth(Aio *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(self->depth);
}

static PyMethodDef Aio_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Aio_read, METH_VARARGS | METH_KEYWORDS,
     "read(fd, offsets, size, out, inject_index=-1, inject_errno=0, inject_got=0, crc_out=None, crc_page=0) "
     "-> None | (index, errno, got)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Aio_getset[] = {
    {"threads", (getter)Aio_get_depth, NULL, "reads in flight at most (the queue depth)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject EngramAioType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engram.store._pread_pool.Aio",
    .tp_basicsize = sizeof(Aio),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Aio(depth): one Linux AIO context for batched O_DIRECT page reads; read() releases the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Aio_init,
    .tp_dealloc = (destructor)Aio_dealloc,
    .tp_methods = Aio_methods,
    .tp_getset = Aio_getset,
};
