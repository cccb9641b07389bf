# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The drain's per-value Count-Min update compiled: ``HotData.add_values``'
inner loop (the row hash, the counters, the estimate) in C.

The reference is ``scry.observe.sketch._py_count_keys`` (pure Python, same
arguments, same results; tests/unit/test_observe_sketch.py holds them to the
same answers). Why: in ``pgbench -S`` nearly every statement looks up a new
value, and the Python loop cost ~0.6 µs of the drain's ~1.7 µs a record.
The row hash is ``sketch.RowHash``'s: a polynomial over the value's 32-bit
words modulo the prime 2**61 - 1, then one ``(a * h + b) mod p`` per row.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE


cdef extern from "Python.h":
    void PyObject_GC_UnTrack(void* op)


cdef extern from *:
    """
    /* a * b mod 2**61 - 1, for a and b below it: the 122-bit product's
       high and low 61 bits add up to it modulo the prime. */
    static inline unsigned long long scry_mulmod61(unsigned long long a, unsigned long long b) {
        unsigned __int128 z = (unsigned __int128)a * b;
        unsigned long long r = ((unsigned long long)z & 0x1FFFFFFFFFFFFFFFULL)
            + (unsigned long long)(z >> 61);
        return r >= 0x1FFFFFFFFFFFFFFFULL ? r - 0x1FFFFFFFFFFFFFFFULL : r;
    }
    """
    unsigned long long scry_mulmod61(unsigned long long a, unsigned long long b) noexcept nogil


cdef unsigned long long _P61 = 0x1FFFFFFFFFFFFFFFULL


cdef inline unsigned long long _u32(const unsigned char* p) noexcept nogil:
    return p[0] | (p[1] << 8) | (p[2] << 16) | (<unsigned long long>p[3] << 24)


cdef inline unsigned long long _add_mod(unsigned long long a, unsigned long long b) noexcept nogil:
    """a + b mod 2**61 - 1, for a and b below it."""
    a += b
    return a - _P61 if a >= _P61 else a


cdef unsigned long long _fold(const unsigned char* p, Py_ssize_t n, unsigned long long base) noexcept nogil:
    """The value's polynomial in ``base``: its little-endian 32-bit words
    (the last one zero-padded), then its length."""
    cdef unsigned long long h = 0
    cdef unsigned char tail[4]
    cdef Py_ssize_t i = 0, j
    while i + 4 <= n:
        h = _add_mod(scry_mulmod61(h, base), _u32(p + i))
        i += 4
    if i < n:
        for j in range(4):
            tail[j] = p[i + j] if i + j < n else 0
        h = _add_mod(scry_mulmod61(h, base), _u32(tail))
    return _add_mod(scry_mulmod61(h, base), <unsigned long long>n)


def count_keys(
    dict counts,
    const unsigned long long[::1] seeds,
    long long[::1] cells,
    Py_ssize_t width,
    long long floor,
):
    """Add each key's count of ``counts`` to its cell in each row of
    ``cells`` (``depth`` rows of ``width``; ``seeds`` is ``RowHash.seeds``:
    the base, then ``a, b`` per row) and return ``[(key, estimate, h)]``
    for the keys whose estimate is above ``floor`` (the only ones a top-k
    table could admit), in ``counts`` order; ``h`` is the key's polynomial,
    which gives its cells again (``RowHash.cells``)."""
    cdef Py_ssize_t depth = (seeds.shape[0] - 1) // 2, row, i
    cdef list candidates = []
    cdef tuple candidate
    cdef unsigned long long h, base
    cdef long long count, estimate, cell
    if depth < 1 or seeds.shape[0] != 2 * depth + 1:
        raise ValueError("seeds are a base and two numbers per row")
    if width <= 0 or cells.shape[0] < depth * width:
        raise ValueError("cells must hold depth rows of width counters")
    base = seeds[0]
    for key, value in counts.items():
        if not PyBytes_CheckExact(key):
            raise TypeError("a lookup value's key is bytes")
        count = value
        h = _fold(<const unsigned char*>PyBytes_AS_STRING(key), PyBytes_GET_SIZE(key), base)
        estimate = 0
        for row in range(depth):
            i = <Py_ssize_t>(_add_mod(scry_mulmod61(seeds[1 + 2 * row], h), seeds[2 + 2 * row]) % <unsigned long long>width)
            i += row * width
            cells[i] += count
            cell = cells[i]
            if row == 0 or cell < estimate:
                estimate = cell
        if estimate > floor:
            # (bytes and ints: never in a cycle; a chunk's worth alive at
            # once would otherwise be walked by any collection they set off)
            candidate = (key, estimate, h)
            PyObject_GC_UnTrack(<void*>candidate)
            candidates.append(candidate)
    return candidates
