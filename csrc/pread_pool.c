/* engram.store._pread_pool: a GIL-free batched pread reader for the disk tier, and the CRC32C of the pages
 * it returns (crc32c.h: crc32c, crc32c_pages, crc32c_impl; see the end of this file), and the read plan of one
 * disk-tier lookup (slab_plan, slab_check: csrc/slab_plan.c); Aio, the same reads through Linux AIO for
 * O_DIRECT files (csrc/aio_reader.c).
 *
 * Pool(threads) starts `threads` pthreads that live as long as the pool. Pool.read(fd, offsets, size, out)
 * reads len(offsets) blocks of `size` bytes, block i from file offset offsets[i] into out[i*size:(i+1)*size],
 * with up to `threads` preads in flight (the queue depth). The GIL is released while the calling thread
 * waits, so several Python threads may read at once: their jobs share the pool's threads in FIFO order.
 * Read returns None when every block was read in full, else (index, errno, got) of the lowest failing
 * block: errno != 0 for a failed pread (EIO, ...), errno == 0 with got < size for a short read (EOF).
 * Python turns that into an error naming the file and offset (engram/store/reader.py).
 *
 * Checksums: with crc_out (a writable buffer of uint32) and crc_page (dividing size), the worker that read
 * block i writes the CRC32C of each crc_page-byte page of it to crc_out[i * (size / crc_page) + k], right
 * after its pread, so a lookup's pages are checksummed in parallel with its other reads instead of after
 * all of them on the caller's thread (the values equal crc32c_pages over the same bytes). A failed block
 * leaves its entries unwritten.
 *
 * Fault injection for tests: inject_index >= 0 makes block inject_index fail as if pread had returned
 * errno inject_errno (when non-zero) or only inject_got bytes; it runs through the same reporting path.
 *
 * Work distribution: a worker attaches to the oldest job with unclaimed blocks (under the pool mutex),
 * then claims blocks one at a time with an atomic counter (no lock per read), so a job keeps `threads`
 * reads in flight until its tail. The calling thread claims blocks of its own job too, so its first read
 * starts at once (waking a sleeping worker costs tens of microseconds on a virtual machine) and a job of
 * n blocks wakes at most n - 1 workers. Not fork-safe: reader.py rebuilds the pool in a forked child.
 *
 * Priorities: two FIFOs, decode (priority 0: a step's own reads) before prompt (priority 1: reads ahead of
 * a prefill). A worker takes the oldest decode job if there is one. A prompt job's blocks are claimed one at
 * a time only while no decode job is queued here and no priority-0 read runs anywhere in the process
 * (engram_decode_reads, which Aio.read counts too); otherwise its readers (workers and its caller) stop after
 * the block in hand and the job waits in its queue, its caller sleeping until the workers finish it. So a
 * decode read waits for at most the blocks already in flight, never for a prompt's queue.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <pthread.h>

#include "crc32c.h"
#include "read_call.h"
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct Job {
    int fd;
    const int64_t *offsets;
    Py_ssize_t size;
    char *out;
    Py_ssize_t n;
    Py_ssize_t next;      /* next unclaimed block (atomic) */
    Py_ssize_t done;      /* blocks finished (under pool mutex) */
    int attached;         /* workers holding a pointer to this job (under pool mutex); it lives on the
                             caller's stack, so the caller waits for 0 before returning */
    int failed;           /* set once any block failed: remaining blocks are skipped (atomic) */
    Py_ssize_t fail_index;
    int fail_errno;
    Py_ssize_t fail_got;
    Py_ssize_t inject_index;
    int inject_errno;
    Py_ssize_t inject_got;
    Py_ssize_t crc_page;  /* > 0: after reading block i, the worker writes the CRC32C of each crc_page-byte
                             page of it to crc_out[i * (size / crc_page) + k] */
    uint32_t *crc_out;
    int64_t *order_out;   /* NULL, or where the claim ticket of each block goes */
    int priority;         /* 0 decode, 1 prompt: which FIFO */
    struct Job *link;     /* FIFO of jobs with unclaimed blocks */
    pthread_cond_t cv_done;
} Job;

typedef struct {
    PyObject_HEAD
    int nthreads;
    pthread_t *threads;
    int started;          /* threads actually created */
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    Job *head[2], *tail[2]; /* FIFOs of jobs with unclaimed blocks: [0] decode, [1] prompt */
    int decode_queued;    /* decode jobs in head[0] (atomic reads outside mu) */
    int64_t tickets;      /* claims so far (atomic): each block's order_out entry */
    int stop;
} Pool;

/* Whether a prompt job must hold its next claim: a decode job queued here, or a decode read in flight. */
static int prompt_holds(Pool *p) {
    return __atomic_load_n(&p->decode_queued, __ATOMIC_SEQ_CST) > 0 ||
           __atomic_load_n(&engram_decode_reads, __ATOMIC_SEQ_CST) > 0;
}


/* Reads block i of job j in full (or fails it as injected); returns 0 or fills *err / *got. */
static int read_block(Job *j, Py_ssize_t i, int *err, Py_ssize_t *got) {
    if (i == j->inject_index) {
        *err = j->inject_errno;
        *got = j->inject_errno ? 0 : (j->inject_got < j->size ? j->inject_got : j->size - 1);
        return -1;
    }
    return pread_full(j->fd, j->out + i * j->size, j->size, j->offsets[i], 0, err, got);
}

typedef struct {
    Py_ssize_t finished; /* blocks this thread claimed */
    Py_ssize_t fail;     /* its lowest failing block, or -1 */
    int err;
    Py_ssize_t got;
} Share;

/* Claims blocks of j one at a time until none is left (a prompt job: or until it must hold), reading (and
 * checksumming) each: one thread's share. A claim is a compare-and-swap so a held job keeps its next block. */
static Share take_share(Pool *p, Job *j) {
    Share s = {0, -1, 0, 0};
    for (;;) {
        if (j->priority && prompt_holds(p)) break;
        Py_ssize_t i = __atomic_load_n(&j->next, __ATOMIC_RELAXED);
        if (i >= j->n) break;
        if (!__atomic_compare_exchange_n(&j->next, &i, i + 1, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) continue;
        int64_t ticket = __atomic_fetch_add(&p->tickets, 1, __ATOMIC_RELAXED);
        if (j->order_out != NULL) j->order_out[i] = ticket;
        s.finished++;
        if (__atomic_load_n(&j->failed, __ATOMIC_RELAXED)) continue;
        int err;
        Py_ssize_t got;
        if (read_block(j, i, &err, &got) != 0) {
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
            if (s.fail < 0 || i < s.fail) { s.fail = i; s.err = err; s.got = got; }
        } else {
            crc_block(j->out, i, j->size, j->crc_page, j->crc_out);
        }
    }
    return s;
}

/* Under p->mu, after a share: once every block of j is claimed, j leaves its queue (wherever it is: the
 * caller's own share may end while an older job is still at the head; a held prompt job stays); the share
 * is counted and the thread detaches, waking the caller when j is complete. */
static void end_share(Pool *p, Job *j, Share s) {
    int q = j->priority;
    Job **link = &p->head[q], *prev = NULL;
    while (*link != NULL && *link != j) {
        prev = *link;
        link = &(*link)->link;
    }
    if (*link == j && __atomic_load_n(&j->next, __ATOMIC_RELAXED) >= j->n) {
        *link = j->link;
        if (p->tail[q] == j) p->tail[q] = prev;
        if (q == 0) __atomic_sub_fetch(&p->decode_queued, 1, __ATOMIC_SEQ_CST);
    }
    if (s.fail >= 0 && (j->fail_index < 0 || s.fail < j->fail_index)) {
        j->fail_index = s.fail;
        j->fail_errno = s.err;
        j->fail_got = s.got;
    }
    j->done += s.finished;
    j->attached--;
    if (j->done == j->n && j->attached == 0) pthread_cond_signal(&j->cv_done);
}

static void *worker(void *arg) {
    Pool *p = (Pool *)arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->head[0] == NULL && p->head[1] == NULL) pthread_cond_wait(&p->cv_work, &p->mu);
        if (p->stop) break;
        Job *j = p->head[0] != NULL ? p->head[0] : p->head[1];
        if (j->priority && prompt_holds(p)) { /* only a held prompt job: wait for the decode reads to end */
            pthread_mutex_unlock(&p->mu);
            engram_wait_decode_idle();
            pthread_mutex_lock(&p->mu);
            continue;
        }
        j->attached++;
        pthread_mutex_unlock(&p->mu);
        Share s = take_share(p, j);
        pthread_mutex_lock(&p->mu);
        end_share(p, j, s);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

static void pool_shutdown(Pool *p) {
    if (p->threads == NULL) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (int t = 0; t < p->started; t++) pthread_join(p->threads[t], NULL);
    PyMem_RawFree(p->threads);
    p->threads = NULL;
    p->started = 0;
}

static int Pool_init(Pool *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"threads", NULL};
    int nthreads;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "i", kwlist, &nthreads)) return -1;
    if (nthreads < 1 || nthreads > 1024) {
        PyErr_Format(PyExc_ValueError, "threads=%d: must be in [1, 1024]", nthreads);
        return -1;
    }
    if (self->threads != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is already initialised");
        return -1;
    }
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv_work, NULL);
    self->head[0] = self->head[1] = self->tail[0] = self->tail[1] = NULL;
    self->decode_queued = 0;
    self->tickets = 0;
    self->stop = 0;
    self->nthreads = nthreads;
    self->threads = PyMem_RawCalloc((size_t)nthreads, sizeof(pthread_t));
    if (self->threads == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int t = 0; t < nthreads; t++) {
        int rc = pthread_create(&self->threads[t], NULL, worker, self);
        if (rc != 0) {
            pool_shutdown(self);
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->started++;
    }
    return 0;
}

static void Pool_dealloc(Pool *self) {
    if (self->threads != NULL) {
        Py_BEGIN_ALLOW_THREADS
        pool_shutdown(self);
        Py_END_ALLOW_THREADS
        pthread_cond_destroy(&self->cv_work);
        pthread_mutex_destroy(&self->mu);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Pool_read(Pool *self, PyObject *args, PyObject *kwds) {
    if (self->threads == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Pool is closed");
        return NULL;
    }
    ReadCall c;
    if (read_call_parse(args, kwds, &c) < 0) return NULL;
    Py_ssize_t n = c.n;
    if (n == 0) {
        read_call_release(&c);
        Py_RETURN_NONE;
    }
    Job j;
    memset(&j, 0, sizeof j);
    j.fd = c.fd;
    j.offsets = (const int64_t *)c.offs.buf;
    j.size = c.size;
    j.out = (char *)c.out.buf;
    j.n = n;
    j.fail_index = -1;
    j.inject_index = c.inject_index;
    j.inject_errno = c.inject_errno;
    j.inject_got = c.inject_got;
    j.crc_page = c.crc_page;
    j.crc_out = (uint32_t *)c.crc.buf;
    j.order_out = (int64_t *)c.order.buf;
    j.priority = c.priority;
    pthread_cond_init(&j.cv_done, NULL);
    int q = c.priority;

    Py_BEGIN_ALLOW_THREADS
    if (q == 0) engram_decode_begin();
    pthread_mutex_lock(&self->mu);
    if (self->tail[q]) self->tail[q]->link = &j; else self->head[q] = &j;
    self->tail[q] = &j;
    if (q == 0) __atomic_add_fetch(&self->decode_queued, 1, __ATOMIC_SEQ_CST);
    j.attached = 1; /* the calling thread reads a share too: its first read starts without a wake-up */
    if (n - 1 >= self->nthreads || q == 0) { /* a decode job: also wake workers parked behind a held prompt job */
        pthread_cond_broadcast(&self->cv_work);
    } else { /* wake only as many workers as there are blocks besides the caller's first */
        for (Py_ssize_t k = 0; k < n - 1; k++) pthread_cond_signal(&self->cv_work);
    }
    pthread_mutex_unlock(&self->mu);
    Share mine = take_share(self, &j);
    pthread_mutex_lock(&self->mu);
    end_share(self, &j, mine);
    while (j.done < j.n || j.attached > 0) pthread_cond_wait(&j.cv_done, &self->mu);
    pthread_mutex_unlock(&self->mu);
    if (q == 0) engram_decode_end();
    Py_END_ALLOW_THREADS
    pthread_cond_destroy(&j.cv_done);
    read_call_release(&c);
    return read_call_result(j.fail_index, j.fail_errno, j.fail_got);
}

static PyObject *Pool_close(Pool *self, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    pool_shutdown(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Pool_get_threads(Pool *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(self->nthreads);
}

static PyMethodDef Pool_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Pool_read, METH_VARARGS | METH_KEYWORDS,
     "read(fd, offsets, size, out, inject_index=-1, inject_errno=0, inject_got=0, crc_out=None, crc_page=0, "
     "priority=0, order_out=None) -> None | (index, errno, got)"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "Stop and join the worker threads."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"threads", (getter)Pool_get_threads, NULL, "number of worker threads (the queue depth)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "engram.store._pread_pool.Pool",
    .tp_basicsize = sizeof(Pool),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(threads): persistent pthread pread pool; read() releases the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Pool_init,
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
};

/* crc32c(data, crc=0) -> int: CRC32C of a bytes-like object, continuing from `crc` (GIL released above
 * 64 KiB). */
static PyObject *mod_crc32c(PyObject *Py_UNUSED(mod), PyObject *args) {
    Py_buffer data;
    unsigned int crc = 0;
    if (!PyArg_ParseTuple(args, "y*|I", &data, &crc)) return NULL;
    uint32_t r;
    if (data.len > (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        r = crc32c_update(crc, data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        r = crc32c_update(crc, data.buf, (size_t)data.len);
    }
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(r);
}

/* crc32c_pages(data, page_size, out): out[i] (native uint32) = CRC32C of page i of data (len(data) must be a
 * multiple of page_size, out at least 4 bytes per page); GIL released. */
static PyObject *mod_crc32c_pages(PyObject *Py_UNUSED(mod), PyObject *args) {
    Py_buffer data, out;
    Py_ssize_t page;
    if (!PyArg_ParseTuple(args, "y*nw*", &data, &page, &out)) return NULL;
    PyObject *result = NULL;
    if (page <= 0 || data.len % page) {
        PyErr_Format(PyExc_ValueError, "data of %zd bytes is not whole pages of %zd bytes", data.len, page);
        goto done;
    }
    Py_ssize_t n = data.len / page;
    if (out.len < n * 4) {
        PyErr_Format(PyExc_ValueError, "out has %zd bytes, %zd pages need %zd", out.len, n, n * 4);
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t c = crc32c_update(0, (const char *)data.buf + i * page, (size_t)page);
        memcpy((char *)out.buf + i * 4, &c, 4);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *mod_crc32c_impl(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored)) {
    return PyUnicode_FromString(crc32c_hw ? "sse4.2" : "table");
}

/* csrc/aio_reader.c: batched O_DIRECT reads through Linux AIO */
extern PyTypeObject EngramAioType;

/* csrc/slab_plan.c: the read plan of one lookup and its check */
PyObject *engram_slab_plan(PyObject *mod, PyObject *args);
PyObject *engram_slab_check(PyObject *mod, PyObject *args);

static PyMethodDef module_methods[] = {
    {"slab_plan", engram_slab_plan, METH_VARARGS,
     "slab_plan(ids, rows_per_page, page_size, offsets, slots, uniq, uslots) -> (n_pages, n_unique)"},
    {"slab_check", engram_slab_check, METH_VARARGS,
     "slab_check(n_pages, offsets, page_size, got, expected, n_unique, uniq, uslots, scales, scale_cols, "
     "slab_scales) -> (n_bad, first_bad)"},
    {"crc32c", mod_crc32c, METH_VARARGS, "crc32c(data, crc=0) -> int: CRC32C of data continuing from crc."},
    {"crc32c_pages", mod_crc32c_pages, METH_VARARGS,
     "crc32c_pages(data, page_size, out): the CRC32C of each page of data as native uint32 into out."},
    {"crc32c_impl", mod_crc32c_impl, METH_NOARGS, "'sse4.2' (the crc32 instruction) or 'table' (portable)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_pread_pool",
    "GIL-free batched pread reader and CRC32C page checksums of the disk tier (see csrc/pread_pool.c, crc32c.h).",
    -1, module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__pread_pool(void) {
    crc32c_init();
    if (PyType_Ready(&PoolType) < 0 || PyType_Ready(&EngramAioType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    if (PyModule_AddObjectRef(m, "Pool", (PyObject *)&PoolType) < 0 ||
        PyModule_AddObjectRef(m, "Aio", (PyObject *)&EngramAioType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
