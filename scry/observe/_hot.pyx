# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The drain's per-value Count-Min update compiled: ``HotData.add_values``'
inner loop (keyed hash, four counters, the estimate) in C.

The reference is ``scry.observe.sketch._count_digests`` (pure Python, same
arguments, same results; tests/unit/test_observe_sketch.py holds them to the
same answers). Why: in ``pgbench -S`` nearly every statement looks up a new
value, and the Python loop cost ~0.6 µs of the drain's ~1.7 µs a record; the
hashing (blake3's own calls) is all that is left of it here.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)


cdef inline unsigned int _u32(const unsigned char* p) noexcept nogil:
    return p[0] | (p[1] << 8) | (p[2] << 16) | (<unsigned int>p[3] << 24)


def count_digests(dict counts, hasher, long long[::1] cells, Py_ssize_t width, long long floor):
    """Hash each key of ``counts`` with ``hasher`` (reset before each), add
    its count to its four cells (rows of ``width`` in ``cells``) and return
    ``[(digest, key, estimate)]`` for the keys whose estimate is above
    ``floor`` (the only ones a top-k table could admit), in ``counts`` order."""
    reset, update, finish = hasher.reset, hasher.update, hasher.digest
    cdef list candidates = []
    cdef bytes digest
    cdef tuple candidate
    cdef const unsigned char* p
    cdef Py_ssize_t a, b, c, d
    cdef long long count, estimate, cell
    if width <= 0 or cells.shape[0] < 4 * width:
        raise ValueError("cells must hold four rows of width counters")
    for key, value in counts.items():
        count = value
        reset()
        update(key)
        digest = finish()
        if PyBytes_GET_SIZE(digest) < 16:
            raise ValueError("the digest is shorter than four 32-bit indexes")
        p = <const unsigned char*>PyBytes_AS_STRING(digest)
        a = _u32(p) % width
        b = _u32(p + 4) % width + width
        c = _u32(p + 8) % width + 2 * width
        d = _u32(p + 12) % width + 3 * width
        cells[a] += count
        estimate = cells[a]
        cells[b] += count
        cell = cells[b]
        if cell < estimate:
            estimate = cell
        cells[c] += count
        cell = cells[c]
        if cell < estimate:
            estimate = cell
        cells[d] += count
        cell = cells[d]
        if cell < estimate:
            estimate = cell
        if estimate > floor:
            # (bytes, bytes, int: never in a cycle; a chunk's worth alive at
            # once would otherwise be walked by any collection they set off)
            candidate = (digest, key, estimate)
            PyObject_GC_UnTrack(<void*>candidate)
            candidates.append(candidate)
    return candidates
