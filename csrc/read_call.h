/* What Pool.read (pread_pool.c) and Aio.read (aio_reader.c) share: their arguments and checks, their
 * result, reading one block in full with pread, and checksumming a block that landed.
 *
 * read(fd, offsets, size, out, inject_index=-1, inject_errno=0, inject_got=0, crc_out=None, crc_page=0,
 *      priority=0, order_out=None):
 * block i of `size` bytes from file offset offsets[i] (int64) into out[i*size:]; with crc_out, the CRC32C of
 * each crc_page-byte page of block i into crc_out[i * (size / crc_page) + k]. Returns None, or
 * (index, errno, got) of the lowest failing block (errno 0: a short read of `got` bytes). Needs crc32c.h.
 * priority: 0 (decode: a step's own reads) or 1 (prompt: reads ahead of a prefill); while any priority-0 read
 * of the process is in flight (engram_decode_reads, counted by both readers) the pool claims no new block of a
 * priority-1 job. order_out (int64, one per block; Pool only): the pool-wide sequence number at which each block
 * was claimed, so tests can check the order reads were issued in.
 */
#ifndef ENGRAM_READ_CALL_H
#define ENGRAM_READ_CALL_H

#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

typedef struct {
    int fd, inject_errno, priority;
    Py_ssize_t size, n, inject_index, inject_got, crc_page; /* crc_page 0: no checksums */
    Py_buffer offs, out, crc, order;
} ReadCall;

/* Priority-0 reads in flight in this process, over every Pool and Aio (defined in pread_pool.c); atomic. */
extern int engram_decode_reads;
/* Call around a priority-0 read (without the GIL): the count above, and waking pools whose priority-1 jobs wait. */
void engram_decode_begin(void);
void engram_decode_end(void);
/* Sleeps until no priority-0 read runs (1 ms at most: callers re-check their own queues). */
void engram_wait_decode_idle(void);

static void read_call_release(ReadCall *c) {
    PyBuffer_Release(&c->offs);
    PyBuffer_Release(&c->out);
    if (c->crc.obj != NULL) PyBuffer_Release(&c->crc);
    if (c->order.obj != NULL) PyBuffer_Release(&c->order);
}

/* Parses and checks a call: 0 with the buffers held (read_call_release), or -1 with an exception set. */
static int read_call_parse(PyObject *args, PyObject *kwds, ReadCall *c) {
    static char *kwlist[] = {"fd", "offsets", "size", "out", "inject_index", "inject_errno", "inject_got",
                             "crc_out", "crc_page", "priority", "order_out", NULL};
    memset(c, 0, sizeof *c);
    c->inject_index = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iy*nw*|ninw*niw*", kwlist, &c->fd, &c->offs, &c->size, &c->out,
                                     &c->inject_index, &c->inject_errno, &c->inject_got, &c->crc, &c->crc_page,
                                     &c->priority, &c->order))
        return -1;
    Py_ssize_t n = c->n = c->offs.len / (Py_ssize_t)sizeof(int64_t);
    if (c->size < 1) {
        PyErr_Format(PyExc_ValueError, "size=%zd: must be >= 1", c->size);
    } else if (c->offs.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_Format(PyExc_ValueError, "offsets must hold int64 values, got %zd bytes", c->offs.len);
    } else if (c->out.len < n * c->size) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes but %zd blocks of %zd bytes need %zd",
                     c->out.len, n, c->size, n * c->size);
    } else if ((c->crc.buf != NULL || c->crc_page != 0) &&
               (c->crc.buf == NULL || c->crc_page < 1 || c->size % c->crc_page != 0)) {
        PyErr_Format(PyExc_ValueError, "crc_out needs crc_page >= 1 dividing size=%zd (crc_page=%zd)",
                     c->size, c->crc_page);
    } else if (c->crc.buf != NULL &&
               c->crc.len < n * (c->size / c->crc_page) * (Py_ssize_t)sizeof(uint32_t)) {
        PyErr_Format(PyExc_ValueError, "crc_out holds %zd bytes but %zd pages need %zd", c->crc.len,
                     n * (c->size / c->crc_page), n * (c->size / c->crc_page) * (Py_ssize_t)sizeof(uint32_t));
    } else if (c->priority != 0 && c->priority != 1) {
        PyErr_Format(PyExc_ValueError, "priority=%d: must be 0 (decode) or 1 (prompt)", c->priority);
    } else if (c->order.buf != NULL && c->order.len < n * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_Format(PyExc_ValueError, "order_out holds %zd bytes but %zd blocks need %zd", c->order.len, n,
                     n * (Py_ssize_t)sizeof(int64_t));
    } else {
        if (c->crc.buf == NULL) c->crc_page = 0;
        return 0;
    }
    read_call_release(c);
    return -1;
}

static PyObject *read_call_result(Py_ssize_t fail_index, int err, Py_ssize_t got) {
    if (fail_index < 0) return Py_NewRef(Py_None);
    return Py_BuildValue("(nin)", fail_index, err, got);
}

/* Reads size bytes at off into dst in full, from `have` bytes on (retrying EINTR and partial reads):
 * 0, or -1 with *err (0 at end of file: a short read) and *got (bytes read). */
static int pread_full(int fd, char *dst, Py_ssize_t size, int64_t off, Py_ssize_t have, int *err, Py_ssize_t *got) {
    while (have < size) {
        ssize_t r = pread(fd, dst + have, (size_t)(size - have), (off_t)(off + have));
        if (r < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            *got = have;
            return -1;
        }
        if (r == 0) {
            *err = 0;
            *got = have;
            return -1;
        }
        have += r;
    }
    return 0;
}

/* The CRC32C of each crc_page-byte page of block i (of `size` bytes in out) into crc_out; none when crc_page
 * is 0. Called right after the block lands, while it is hot in this core's cache. */
static void crc_block(const char *out, Py_ssize_t i, Py_ssize_t size, Py_ssize_t crc_page, uint32_t *crc_out) {
    if (crc_page <= 0) return;
    Py_ssize_t per = size / crc_page;
    const char *src = out + i * size;
    for (Py_ssize_t k = 0; k < per; k++)
        crc_out[i * per + k] = crc32c_update(0, src + k * crc_page, (size_t)crc_page);
}

#endif
