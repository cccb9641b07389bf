# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The drain's per-value Count-Min update compiled: ``HotData.add_values``'
inner loop (the row hash, the counters, the estimate) in C.

The reference is ``scry.observe.sketch._py_count_keys`` (pure Python, same
arguments, same results; tests/unit/test_observe_sketch.py holds them to the
same answers). Why: in ``pgbench -S`` nearly every statement looks up a new
value, and the Python loop cost ~0.6 µs of the drain's ~1.7 µs a record.
The row hash is ``sketch.RowHash``'s: a polynomial over the key's 32-bit
words modulo the prime 2**61 - 1, then one ``(a * h + b) mod p`` per row.
``count_spans`` hashes the values where they sit in the query texts, so the
drain makes no key per value (only per candidate).
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.object cimport PyObject
from libc.string cimport memchr, memcpy


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


cdef unsigned long long _fold_words(
    const unsigned char* p, Py_ssize_t n, unsigned long long h, unsigned long long base
) noexcept nogil:
    """``h`` carried on over the little-endian 32-bit words of ``p[:n]``
    (the last one zero-padded)."""
    cdef unsigned char tail[4]
    cdef Py_ssize_t i = 0, j
    while i + 4 <= n:
        h = _add_mod(scry_mulmod61(h, base), _u32(p + i))
        i += 4
    if i < n:
        for j in range(4):
            tail[j] = p[i + j] if i + j < n else 0
        h = _add_mod(scry_mulmod61(h, base), _u32(tail))
    return h


cdef inline unsigned long long _finish(unsigned long long h, Py_ssize_t n, unsigned long long base) noexcept nogil:
    return _add_mod(scry_mulmod61(h, base), <unsigned long long>n)


cdef inline long long _count(
    unsigned long long h,
    long long count,
    const unsigned long long* seeds,
    long long* cells,
    Py_ssize_t depth,
    Py_ssize_t width,
) noexcept nogil:
    """Add ``count`` to the key's cell in each row; its new estimate."""
    cdef Py_ssize_t row, i
    cdef long long estimate = 0
    for row in range(depth):
        i = <Py_ssize_t>(_add_mod(scry_mulmod61(seeds[1 + 2 * row], h), seeds[2 + 2 * row]) % <unsigned long long>width)
        i += row * width
        cells[i] += count
        if row == 0 or cells[i] < estimate:
            estimate = cells[i]
    return estimate


cdef Py_ssize_t _depth(const unsigned long long[::1] seeds, long long[::1] cells, Py_ssize_t width) except -1:
    cdef Py_ssize_t depth = (seeds.shape[0] - 1) // 2
    if depth < 1 or seeds.shape[0] != 2 * depth + 1:
        raise ValueError("seeds are a base and two numbers per row")
    if width <= 0 or cells.shape[0] < depth * width:
        raise ValueError("cells must hold depth rows of width counters")
    return depth


def count_keys(
    dict counts,
    const unsigned long long[::1] seeds,
    long long[::1] cells,
    Py_ssize_t width,
    long long floor,
):
    """Add each key's count of ``counts`` to its cell in each row of
    ``cells`` (``depth`` rows of ``width``; ``seeds`` is ``RowHash.seeds``:
    the base, then ``a, b`` per row) and return ``{h: [key, estimate]}``
    for the keys whose estimate is above ``floor`` (the only ones a top-k
    table could admit), in ``counts`` order; ``h`` is the key's polynomial,
    which gives its cells again (``RowHash.cells``)."""
    cdef Py_ssize_t depth = _depth(seeds, cells, width), n, cut
    cdef dict candidates = {}
    cdef const unsigned char* p
    cdef const unsigned char* nul
    cdef unsigned long long h, base = seeds[0]
    cdef long long estimate, count
    for key, value in counts.items():
        if not PyBytes_CheckExact(key):
            raise TypeError("a lookup value's key is bytes")
        p = <const unsigned char*>PyBytes_AS_STRING(key)
        n = PyBytes_GET_SIZE(key)
        nul = <const unsigned char*>memchr(p, 0, n)
        cut = n if nul is NULL else nul - p + 1
        h = _fold_words(p + cut, n - cut, _fold_words(p, cut, 1, base), base)
        h = _finish(h, n - cut, base)
        count = value
        estimate = _count(h, count, &seeds[0], &cells[0], depth, width)
        if estimate > floor:
            candidates[h] = [key, estimate]
    return candidates


def count_spans(
    list spanned,
    const unsigned long long[::1] seeds,
    long long[::1] cells,
    Py_ssize_t width,
    long long floor,
):
    """``count_keys`` of the keys ``prefix + text[start:end]`` (sliced as
    Python slices) for every ``(texts, spans)`` of ``spanned``, every text
    and every span ``(prefix, start, end)`` (``fingerprint.Variant.spans``;
    a prefix ends in its only NUL), each counted once per text, span by
    span, without making the keys: a key is made only the first time its
    estimate is above ``floor``; met again, its estimate is updated."""
    cdef Py_ssize_t depth = _depth(seeds, cells, width), i, start, end, length, s, e, prefix_length
    cdef dict candidates = {}
    cdef const unsigned char* p
    cdef const unsigned char* text_bytes
    cdef unsigned long long h, h_prefix, base = seeds[0]
    cdef long long estimate
    cdef list texts
    cdef bytes key
    cdef PyObject* found
    for group in spanned:
        texts, spans = group
        for span in spans:
            prefix, start, end = span
            if not PyBytes_CheckExact(prefix) or start < 0 or end < 0:
                raise TypeError("a span is (bytes prefix, start, end)")
            p = <const unsigned char*>PyBytes_AS_STRING(prefix)
            prefix_length = PyBytes_GET_SIZE(prefix)
            if prefix_length == 0 or memchr(p, 0, prefix_length) != p + prefix_length - 1:
                raise ValueError("a span's prefix ends in its only NUL")
            h_prefix = _fold_words(p, prefix_length, 1, base)
            for i in range(len(texts)):
                text = texts[i]
                if not PyBytes_CheckExact(text):
                    raise TypeError("a record's text is bytes")
                length = PyBytes_GET_SIZE(text)  # text[start:end], clamped as slicing does
                s = start if start < length else length
                e = end if end < length else length
                if e < s:
                    e = s
                text_bytes = <const unsigned char*>PyBytes_AS_STRING(text)
                h = _finish(_fold_words(text_bytes + s, e - s, h_prefix, base), e - s, base)
                estimate = _count(h, 1, &seeds[0], &cells[0], depth, width)
                if estimate <= floor:
                    continue
                # Looked up by h: a hot value met again makes no key.
                h_object = h
                found = PyDict_GetItem(candidates, h_object)
                if found is not NULL:
                    (<list>found)[1] = estimate
                    continue
                key = PyBytes_FromStringAndSize(NULL, prefix_length + e - s)
                memcpy(PyBytes_AS_STRING(key), p, prefix_length)
                memcpy(PyBytes_AS_STRING(key) + prefix_length, text_bytes + s, e - s)
                candidates[h_object] = [key, estimate]
    return candidates
