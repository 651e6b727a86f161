/* The read plan of one disk-tier lookup and its check, in C (part of engram.store._pread_pool; the numpy
 * reference is engram/store/slab_plan.py, which dispatches here and is tested for equal results).
 *
 * slab_plan(ids, rows_per_page, page_size, offsets, slots, uniq, uslots) -> (n_pages, n_unique)
 *   ids: int64 [N], in range (the caller checked them). Sorts (id, position) pairs, then in one pass writes
 *   the byte offset of each distinct page, ascending (offsets[:n_pages]), each distinct id ascending
 *   (uniq[:n_unique]) and its row in the page buffer the pages are read into (uslots: page index *
 *   rows_per_page + id % rows_per_page), and that row for every position of ids (slots[:N]).
 *
 * slab_check(n_pages, offsets, page_size, got, expected, n_unique, uniq, uslots, scales, scale_cols,
 *            slab_scales) -> (n_bad, first_bad)
 *   Compares the CRC32C of each page read (got[i], as the reader computed it) with the stored one
 *   (expected[offsets[i] / page_size]); when all match and scales is not None, copies each distinct id's
 *   scale_cols scale bytes to its buffer row of slab_scales. Returns the number of bad pages and the index
 *   of the first (-1 when none).
 *
 * Both release the GIL while they work; buffers are checked for size first (ValueError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t id;
    int64_t pos;
} IdPos;

static int cmp_idpos(const void *a, const void *b) {
    const IdPos *x = a, *y = b;
    if (x->id != y->id) return x->id < y->id ? -1 : 1;
    return x->pos < y->pos ? -1 : (x->pos > y->pos);
}

static int need(const Py_buffer *b, Py_ssize_t bytes, const char *name) {
    if (b->len < bytes) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, %zd needed", name, b->len, bytes);
        return -1;
    }
    return 0;
}

PyObject *engram_slab_plan(PyObject *Py_UNUSED(mod), PyObject *args) {
    Py_buffer ids, offs, slots, uniq, uslots;
    Py_ssize_t rpp, page;
    if (!PyArg_ParseTuple(args, "y*nnw*w*w*w*", &ids, &rpp, &page, &offs, &slots, &uniq, &uslots)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = ids.len / (Py_ssize_t)sizeof(int64_t);
    IdPos *pairs = NULL;
    if (rpp < 1 || page < 1) {
        PyErr_Format(PyExc_ValueError, "rows_per_page=%zd and page_size=%zd must be >= 1", rpp, page);
        goto done;
    }
    Py_ssize_t bytes = n * (Py_ssize_t)sizeof(int64_t);
    if (need(&offs, bytes, "offsets") || need(&slots, bytes, "slots") || need(&uniq, bytes, "uniq") ||
        need(&uslots, bytes, "uslots"))
        goto done;
    pairs = PyMem_RawMalloc((size_t)(n > 0 ? n : 1) * sizeof(IdPos));
    if (pairs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t n_pages = 0, n_unique = 0;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *in = ids.buf;
    int64_t *o = offs.buf, *s = slots.buf, *u = uniq.buf, *us = uslots.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        pairs[i].id = in[i];
        pairs[i].pos = i;
    }
    qsort(pairs, (size_t)n, sizeof(IdPos), cmp_idpos);
    int64_t last_page = -1, last_id = -1, slot = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t id = pairs[i].id;
        if (n_unique == 0 || id != last_id) {
            int64_t pg = id / rpp;
            if (n_pages == 0 || pg != last_page) {
                o[n_pages++] = pg * (int64_t)page;
                last_page = pg;
            }
            slot = (int64_t)(n_pages - 1) * rpp + id % rpp;
            u[n_unique] = id;
            us[n_unique++] = slot;
            last_id = id;
        }
        s[pairs[i].pos] = slot;
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(nn)", n_pages, n_unique);
done:
    PyMem_RawFree(pairs);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&uniq);
    PyBuffer_Release(&uslots);
    return result;
}

PyObject *engram_slab_check(PyObject *Py_UNUSED(mod), PyObject *args) {
    Py_ssize_t n_pages, page, n_unique, scale_cols;
    Py_buffer offs, got, expected, uniq, uslots;
    PyObject *scales_obj, *slab_obj;
    if (!PyArg_ParseTuple(args, "ny*ny*y*ny*y*OnO", &n_pages, &offs, &page, &got, &expected, &n_unique, &uniq,
                          &uslots, &scales_obj, &scale_cols, &slab_obj))
        return NULL;
    Py_buffer scales = {0}, slab = {0};
    PyObject *result = NULL;
    int with_scales = scales_obj != Py_None;
    if (with_scales && (PyObject_GetBuffer(scales_obj, &scales, PyBUF_SIMPLE) < 0 ||
                        PyObject_GetBuffer(slab_obj, &slab, PyBUF_WRITABLE) < 0))
        goto done;
    if (page < 1 || n_pages < 0 || n_unique < 0 || (with_scales && scale_cols < 1)) {
        PyErr_Format(PyExc_ValueError, "page_size=%zd, n_pages=%zd, n_unique=%zd, scale_cols=%zd out of range",
                     page, n_pages, n_unique, scale_cols);
        goto done;
    }
    if (need(&offs, n_pages * 8, "offsets") || need(&got, n_pages * 4, "got") || need(&uniq, n_unique * 8, "uniq") ||
        need(&uslots, n_unique * 8, "uslots"))
        goto done;
    const int64_t *o = offs.buf, *u = uniq.buf, *us = uslots.buf;
    Py_ssize_t total = expected.len / 4;
    for (Py_ssize_t i = 0; i < n_pages; i++) {  /* every page inside the table (the plan made them so) */
        if (o[i] < 0 || o[i] / page >= total) {
            PyErr_Format(PyExc_ValueError, "offset %lld is past the %zd pages of the checksums",
                         (long long)o[i], total);
            goto done;
        }
    }
    if (with_scales) {
        Py_ssize_t rows = scales.len / scale_cols, cap = slab.len / scale_cols;
        for (Py_ssize_t k = 0; k < n_unique; k++) {
            if (u[k] < 0 || u[k] >= rows || us[k] < 0 || us[k] >= cap) {
                PyErr_Format(PyExc_ValueError, "row %lld (buffer row %lld) is outside the scales (%zd rows) or "
                             "the slab (%zd rows)", (long long)u[k], (long long)us[k], rows, cap);
                goto done;
            }
        }
    }
    Py_ssize_t n_bad = 0, first = -1;
    Py_BEGIN_ALLOW_THREADS
    const uint32_t *g = got.buf, *e = expected.buf;
    for (Py_ssize_t i = 0; i < n_pages; i++) {
        if (g[i] != e[o[i] / page]) {
            if (first < 0) first = i;
            n_bad++;
        }
    }
    if (n_bad == 0 && with_scales) {
        const char *src = scales.buf;
        char *dst = slab.buf;
        for (Py_ssize_t k = 0; k < n_unique; k++)
            memcpy(dst + us[k] * scale_cols, src + u[k] * scale_cols, (size_t)scale_cols);
    }
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(nn)", n_bad, first);
done:
    PyBuffer_Release(&offs);
    PyBuffer_Release(&got);
    PyBuffer_Release(&expected);
    PyBuffer_Release(&uniq);
    PyBuffer_Release(&uslots);
    if (scales.obj != NULL) PyBuffer_Release(&scales);
    if (slab.obj != NULL) PyBuffer_Release(&slab);
    return result;
}
