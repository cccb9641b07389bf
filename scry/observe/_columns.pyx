# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""``scry.observe.columns`` compiled: a drained chunk's columns in one pass.

The reference is the pure-Python ``py_group_columns`` / ``py_event_columns``
/ ``py_chunk_variants`` / ``py_group_records`` there; these take the same arguments and
return equal values (tests/unit/test_observe_columns.py), except that
``group_columns`` gives its durations as ``array('q')``s where the twin gives
lists. Why: in Python
the drain walks a chunk a dozen times (one ``map`` per field and per
subtraction), about 0.8 µs a record for statistics and events together;
here each list is filled in one walk. The variant keys are hashed where
the digits are zeroed, without a zeroed copy of each text (0.77 -> 0.54 µs
a pgbench record for the whole summary step).

A record whose times are not 64-bit ints (never from the proxy) sends the
whole call to the Python twin, which handles any number (and raises on a
record that is not one).
"""

from cpython cimport array as carray
from cpython.dict cimport PyDict_CheckExact, PyDict_GetItem
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_CheckExact, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLong, PyLong_CheckExact, PyLong_FromSsize_t
from cpython.mem cimport PyMem_Free, PyMem_Malloc


cdef extern from *:
    # GCC's and Clang's checked arithmetic: an int64 that would wrap sends
    # the call to the Python twin (OverflowError), which has no bound.
    bint __builtin_saddll_overflow(long long a, long long b, long long* out) nogil
    bint __builtin_ssubll_overflow(long long a, long long b, long long* out) nogil


cdef inline long long _sub(long long a, long long b) except? -1:
    cdef long long out
    if __builtin_ssubll_overflow(a, b, &out):
        raise OverflowError("a duration beyond 64 bits")
    return out


cdef inline long long _add(long long a, long long b) except? -1:
    cdef long long out
    if __builtin_saddll_overflow(a, b, &out):
        raise OverflowError("a sum beyond 64 bits")
    return out


cdef extern from "Python.h":
    # What hash() of a bytes object is (the process's keyed SipHash).
    Py_hash_t _Py_HashBytes(const void* src, Py_ssize_t length)


from array import array

cdef carray.array _DOUBLES = array("d")
cdef carray.array _INT64S = array("q")


cdef inline long long _floor_us(long long ns) noexcept nogil:
    """``ns // 1000`` as Python rounds it (toward minus infinity)."""
    cdef long long q = ns / 1000
    if ns % 1000 != 0 and ns < 0:
        q -= 1
    return q


cdef inline long long _int64(object value) except? -1:
    """``value`` as a C int64, by Cython's conversion: it reads an int's
    digits directly, where CPython 3.11's ``PyLong_AsLongLong`` takes the
    byte-by-byte ``_PyLong_AsByteArray`` for anything of 2**30 or more,
    which every perf_counter_ns() reading is (a third of this module's
    time per record). Anything but an exact int goes the C API's way, which
    raises OverflowError or TypeError (a float too: no truncation)."""
    if PyLong_CheckExact(value):
        return value
    return PyLong_AsLongLong(value)


cdef inline object _item(tuple t, Py_ssize_t i):
    return <object>PyTuple_GET_ITEM(t, i)


cdef inline tuple _record(object rec):
    if not PyTuple_Check(rec) or PyTuple_GET_SIZE(rec) != 9:
        raise TypeError("a query record is a tuple of 9 fields")
    return <tuple>rec


cdef inline tuple _context(tuple rec):
    ctx = _item(rec, 0)
    if not PyTuple_Check(ctx) or PyTuple_GET_SIZE(ctx) < 5:
        raise TypeError("a record's context is a ClientContext")
    return <tuple>ctx


cdef inline object _rows(object tag_rows, object tag):
    cdef PyObject* found
    if PyDict_CheckExact(tag_rows) or isinstance(tag_rows, dict):
        found = PyDict_GetItem(tag_rows, tag)
        if found is not NULL:
            return <object>found
    return tag_rows[tag]  # a miss: the mapping's __missing__ parses the tag


cdef inline void _set(list out, Py_ssize_t i, object value):
    Py_INCREF(value)
    PyList_SET_ITEM(out, i, value)


def group_columns(list recs, tag_rows):
    """See ``scry.observe.columns.py_group_columns``."""
    try:
        return _group_columns(recs, tag_rows)
    except (OverflowError, TypeError):
        # Not all 64-bit ints: the twin takes any number (and raises on a
        # record that is not one).
        from scry.observe.columns import py_group_columns

        return py_group_columns(recs, tag_rows)


cdef tuple _group_columns(list recs, tag_rows):
    cdef Py_ssize_t n = len(recs), i
    if n == 0:
        raise ValueError("an empty group")
    cdef list databases = PyList_New(n)
    # The durations as int64 arrays: no int object per value to make here,
    # then chase and free in each histogram pass (histogram.count_positions
    # reads them in place).
    cdef carray.array totals = carray.clone(_INT64S, n, False)
    cdef carray.array queues = carray.clone(_INT64S, n, False)
    cdef carray.array backends = carray.clone(_INT64S, n, False)
    cdef carray.array acquires = carray.clone(_INT64S, n, False)
    cdef list sqlstates = PyList_New(n)
    cdef list pins = PyList_New(n)
    cdef long long received, acquired, sent, done, total, queue, backend
    cdef long long first_done = 0, min_done = 0, max_done = 0
    cdef long long total_sum = 0, shortest = 0, longest = 0, queue_sum = 0, backend_sum = 0
    cdef Py_ssize_t errors = 0
    cdef bint any_acquire = False, any_pin = False, one_database = True
    cdef tuple rec
    rows = 0
    first_database = None
    for i in range(n):
        rec = _record(recs[i])
        database = _item(_context(rec), 1)
        _set(databases, i, database)
        received = _int64(_item(rec, 2))
        acquired = _int64(_item(rec, 3))
        sent = _int64(_item(rec, 4))
        done = _int64(_item(rec, 5))
        total = _sub(done, received)
        queue = _sub(acquired, received)
        backend = _sub(done, sent)
        totals.data.as_longlongs[i] = total
        queues.data.as_longlongs[i] = queue
        backends.data.as_longlongs[i] = backend
        acquires.data.as_longlongs[i] = _sub(sent, acquired)
        total_sum = _add(total_sum, total)
        queue_sum = _add(queue_sum, queue)
        backend_sum = _add(backend_sum, backend)
        if sent != acquired:
            any_acquire = True
        if i == 0:
            first_done = min_done = max_done = done
            shortest = longest = total
            first_database = database
        else:
            if one_database and database is not first_database:
                one_database = database == first_database
            if done < min_done:
                min_done = done
            elif done > max_done:
                max_done = done
            if total < shortest:
                shortest = total
            elif total > longest:
                longest = total
        rows += _rows(tag_rows, _item(rec, 6))
        sqlstate = _item(rec, 7)
        _set(sqlstates, i, sqlstate)
        if sqlstate is not None:
            errors += 1
        pin = _item(rec, 8)
        _set(pins, i, pin)
        if pin is not None:
            any_pin = True
    return (
        databases,
        totals,
        queues,
        backends,
        acquires if any_acquire else None,
        sqlstates,
        pins if any_pin else None,
        errors,
        rows,
        first_done,
        min_done,
        max_done,
        total_sum,
        shortest,
        longest,
        queue_sum,
        backend_sum,
        one_database,
    )


def event_columns(list batch, tag_rows, double wall_offset):
    """See ``scry.observe.columns.py_event_columns``."""
    try:
        return _event_columns(batch, tag_rows, wall_offset)
    except (OverflowError, TypeError):
        # Not all 64-bit ints: the twin takes any number (and raises on a
        # record that is not one).
        from scry.observe.columns import py_event_columns

        return py_event_columns(batch, tag_rows, wall_offset)


cdef list _event_columns(list batch, tag_rows, double wall_offset):
    cdef Py_ssize_t n = len(batch), i
    cdef carray.array ts = carray.clone(_DOUBLES, n, False)
    cdef list workers = PyList_New(n)
    cdef list client_ids = PyList_New(n)
    cdef list databases = PyList_New(n)
    cdef list users = PyList_New(n)
    cdef list applications = PyList_New(n)
    cdef carray.array queue_us = carray.clone(_INT64S, n, False)
    cdef carray.array acquire_us = carray.clone(_INT64S, n, False)
    cdef carray.array backend_us = carray.clone(_INT64S, n, False)
    cdef carray.array total_us = carray.clone(_INT64S, n, False)
    cdef carray.array rows = carray.clone(_INT64S, n, False)
    cdef list sqlstates = PyList_New(n)
    cdef list pinned = PyList_New(n)
    cdef list reasons = PyList_New(n)
    cdef long long received, acquired, sent, done
    cdef tuple rec, ctx
    cdef tuple no_reasons = ()
    for i in range(n):
        rec = _record(batch[i])
        ctx = _context(rec)
        received = _int64(_item(rec, 2))
        acquired = _int64(_item(rec, 3))
        sent = _int64(_item(rec, 4))
        done = _int64(_item(rec, 5))
        ts.data.as_doubles[i] = <double>done / 1e9 + wall_offset
        _set(workers, i, _item(ctx, 4))
        _set(client_ids, i, _item(ctx, 0))
        _set(databases, i, _item(ctx, 1))
        _set(users, i, _item(ctx, 2))
        _set(applications, i, _item(ctx, 3))
        queue_us.data.as_longlongs[i] = _floor_us(_sub(acquired, received))
        acquire_us.data.as_longlongs[i] = _floor_us(_sub(sent, acquired))
        backend_us.data.as_longlongs[i] = _floor_us(_sub(done, sent))
        total_us.data.as_longlongs[i] = _floor_us(_sub(done, received))
        rows.data.as_longlongs[i] = _rows(tag_rows, _item(rec, 6))
        _set(sqlstates, i, _item(rec, 7))
        pin = _item(rec, 8)
        _set(pinned, i, pin is not None)
        _set(reasons, i, pin or no_reasons)
    return [
        ts, workers, client_ids, databases, users, applications, queue_us, acquire_us,
        backend_us, total_us, rows, sqlstates, pinned, reasons,
    ]


def chunk_variants(list batch, variants):
    """See ``scry.observe.columns.py_chunk_variants``."""
    if not isinstance(variants, dict):
        raise TypeError("variants is a dict (fingerprint.VariantCache)")
    cdef Py_ssize_t n = len(batch), i, j, length
    cdef list texts = PyList_New(n)
    cdef list keys = PyList_New(n)
    cdef list found = PyList_New(n)
    cdef char small[512]
    cdef char* zeroed
    cdef const unsigned char* src
    cdef unsigned char c
    cdef PyObject* variant
    cdef tuple rec
    for i in range(n):
        rec = _record(batch[i])
        text = _item(rec, 1)
        _set(texts, i, text)
        if not PyBytes_CheckExact(text):
            raise TypeError("a record's text is bytes")
        length = PyBytes_GET_SIZE(text)
        src = <const unsigned char*>PyBytes_AS_STRING(text)
        if length <= 512:
            zeroed = &small[0]
        else:
            zeroed = <char*>PyMem_Malloc(length)
            if zeroed is NULL:
                raise MemoryError()
        for j in range(length):  # DIGITS_TO_ZERO
            c = src[j]
            zeroed[j] = 48 if 49 <= c <= 57 else c
        key = PyLong_FromSsize_t(_Py_HashBytes(zeroed, length))
        if length > 512:
            PyMem_Free(zeroed)
        _set(keys, i, key)
        variant = PyDict_GetItem(variants, key)
        _set(found, i, <object>variant if variant is not NULL else None)
    return texts, keys, found


def group_records(list variants, list batch):
    """See ``scry.observe.columns.py_group_records``."""
    cdef Py_ssize_t n = len(batch), i
    if len(variants) != n:
        raise ValueError("one variant per record")
    cdef dict groups = {}
    cdef PyObject* group
    for i in range(n):
        variant = variants[i]
        group = PyDict_GetItem(groups, variant)
        if group is NULL:
            groups[variant] = [batch[i]]
        else:
            (<list>group).append(batch[i])
    return groups
