# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""``MessageScanner`` compiled: the relay's per-chunk header walk in C.

The reference is the pure-Python ``scry.protocol.framing.PyMessageScanner``;
this class has the same constructor, methods and results (tests/unit/
test_framing*.py run both). ``scry.protocol.framing.MessageScanner`` is this
one when the extension was built, else the Python one.

Why: on a pgbench -S response (four messages) the Python loop costs about a
microsecond, a quarter of the proxy's Python work per transaction; here it
costs a few tens of nanoseconds.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.string cimport memcpy

from scry.protocol.framing import _check_length, _want_table

cdef list _NO_EVENTS = []  # shared and never mutated: callers only iterate
cdef dict _TABLES = {}  # (want, mark) -> _c_table(want, mark)
# [(want, mark, table)] for the first few (want, mark) objects seen: found by
# identity, as hashing two tuples of kinds cost ~0.3 µs a connection.
cdef list _SEEN = []


cdef bytes _c_table(want, mark):
    """The scanner's table as 256 signed chars: -1 not wanted, 0 reported
    bare, 1 with its body (framing._want_table's dict, laid out)."""
    cdef signed char table[256]
    cdef int i
    for i in range(256):
        table[i] = -1
    for kind, copy in _want_table(want, mark).items():
        table[<unsigned char>kind] = 1 if copy else 0
    return PyBytes_FromStringAndSize(<char*>table, 256)


cdef inline Py_ssize_t _length_at(const unsigned char* p) noexcept nogil:
    return (<Py_ssize_t>p[0] << 24) | (p[1] << 16) | (p[2] << 8) | p[3]


cdef inline bytes _part(bytes b, Py_ssize_t start, Py_ssize_t end):
    """``b[start:end]`` for 0 <= start, copied directly: Cython slices bytes
    through PySequence_GetSlice, which builds a slice object and unpacks it."""
    cdef Py_ssize_t n = PyBytes_GET_SIZE(b)
    if end > n:
        end = n
    if start > n:
        start = n
    if start == 0 and end == n:
        return b
    if end < start:
        end = start
    return PyBytes_FromStringAndSize(PyBytes_AS_STRING(b) + start, end - start)


cdef class MessageScanner:
    """Finds the messages of interest in a stream without copying the rest.

    (Its fields are declared in _scan.pxd.)"""

    def __init__(
        self,
        want,
        Py_ssize_t max_message_size=0x3FFFFFFF,
        Py_ssize_t max_collect=1 << 20,
        mark=(),
    ):
        # The table for these (want, mark), built once: every connection
        # makes a scanner, nearly all with the same few constant tuples.
        cdef tuple seen
        for entry in _SEEN:
            seen = <tuple>entry
            if seen[0] is want and seen[1] is mark:
                table = seen[2]
                break
        else:
            hashable = True
            try:
                table = _TABLES[want, mark]
            except (KeyError, TypeError) as exc:  # (TypeError: unhashable, so not kept)
                hashable = isinstance(exc, KeyError)
                table = _c_table(want, mark)
                if hashable and len(_TABLES) < 64:
                    _TABLES[want, mark] = table
            if hashable and len(_SEEN) < 8 and type(want) is tuple and type(mark) is tuple:
                _SEEN.append((want, mark, table))  # (held: their ids stay theirs)
        memcpy(self._table, PyBytes_AS_STRING(table), 256)
        self._max = max_message_size
        self._max_collect = max_collect
        self._held = b""
        self._remaining = 0
        self._collect = None
        self._collect_limit = max_collect
        self._kind = 0

    @property
    def at_boundary(self):
        """True when the stream so far ends exactly between two messages."""
        return self._remaining == 0 and PyBytes_GET_SIZE(self._held) == 0

    def partial_message(self):
        """(type, body bytes gathered so far) of a wanted message begun in the
        stream and not complete yet (up to max_collect); None if there is none."""
        if self._remaining == 0 or self._collect is None:
            return None
        return self._kind, len(self._collect)

    def detach(self):
        """Stop scanning: return the held-back partial header and reset."""
        held = self._held
        self._held = b""
        self._remaining = 0
        self._collect = None
        return held

    cdef void _gather(self, bytearray collect, bytes part):
        cdef Py_ssize_t room = self._collect_limit - len(collect)
        if room > 0:
            collect += _part(part, 0, room)

    def feed(self, data):
        """Scan ``data``; return (bytes to forward, wanted messages completed in them)."""
        if type(data) is not bytes:
            data = bytes(data)
        cdef bytes chunk = <bytes>data
        cdef Py_ssize_t n = PyBytes_GET_SIZE(chunk)
        cdef const unsigned char* p = <const unsigned char*>PyBytes_AS_STRING(chunk)
        cdef Py_ssize_t pos, end, length, stop
        cdef int kind, copy
        cdef list events
        if self._remaining == 0 and PyBytes_GET_SIZE(self._held) == 0 and n >= 5:
            # Fast path: the chunk is exactly one whole message.
            length = _length_at(p + 1)
            if length + 1 == n and 4 <= length <= self._max + 4:
                kind = p[0]
                copy = self._table[kind]
                if copy > 0:
                    return chunk, [(kind, n, _part(chunk, 5, 5 + self._max_collect))]
                if copy == 0:
                    return chunk, [(kind, n, b"")]
                return chunk, _NO_EVENTS
        if PyBytes_GET_SIZE(self._held):
            chunk = self._held + chunk
            self._held = b""
            n = PyBytes_GET_SIZE(chunk)
            p = <const unsigned char*>PyBytes_AS_STRING(chunk)
        events = []
        pos = self._remaining
        if pos:
            collect = self._collect
            if pos > n:
                if collect is not None:
                    self._gather(collect, chunk)
                self._remaining = pos - n
                return chunk, events
            if collect is not None:
                self._gather(collect, _part(chunk, 0, pos))
                events.append((self._kind, pos, bytes(collect)))
                self._collect = None
            self._remaining = 0
        while n - pos >= 5:
            kind = p[pos]
            length = _length_at(p + pos + 1)
            if length < 4 or length - 4 > self._max:
                _check_length(kind, length, self._max)
            end = pos + 1 + length
            copy = self._table[kind]
            if end > n:
                self._remaining = end - n
                if copy >= 0:
                    self._kind = kind
                    self._collect = bytearray()
                    self._collect_limit = self._max_collect if copy else 0
                    self._gather(self._collect, _part(chunk, pos + 5, n))
                return chunk, events
            if copy > 0:
                stop = pos + 5 + self._max_collect
                events.append((kind, end, _part(chunk, pos + 5, end if end < stop else stop)))
            elif copy == 0:
                events.append((kind, end, b""))
            pos = end
        if pos < n:
            self._held = _part(chunk, pos, n)
            chunk = _part(chunk, 0, pos)
        return chunk, events
