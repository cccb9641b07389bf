"""Count-Min Sketch bounds, Top-K recall on a Zipf workload, decay, hot data."""

from __future__ import annotations

import random
from array import array
from collections import Counter

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scry.observe import sketch
from scry.observe.anonymize import Anonymizer
from scry.observe.sketch import CountMinSketch, HotData, RowHash, TopK


def _digest(key: object, depth: int) -> bytes:
    return blake3.blake3(repr(key).encode()).digest(4 * depth)


def _positions(cms: CountMinSketch, key: object) -> list[int]:
    """A key's cells the way a lookup value finds them (``RowHash``)."""
    return RowHash(Anonymizer("k"), cms.width, cms.depth).positions(repr(key).encode())


@settings(max_examples=100, deadline=None)
@given(
    keys=st.lists(st.integers(min_value=0, max_value=500), min_size=1, max_size=400),
    width=st.integers(min_value=1, max_value=64),
    depth=st.integers(min_value=1, max_value=6),
)
def test_cms_never_underestimates(keys: list[int], width: int, depth: int) -> None:
    cms = CountMinSketch(width, depth)
    exact = Counter()
    # Odd keys find their cells as table names do, even ones as lookup values.
    cells = {
        k: _positions(cms, k) if k % 2 == 0 else cms.indexes(_digest(k, depth)) for k in set(keys)
    }
    for k in keys:
        estimate = cms.add(cells[k])
        exact[k] += 1
        assert estimate >= exact[k]
    for k, n in exact.items():
        assert cms.estimate(cells[k]) >= n
    assert cms.total == len(keys)


def _zipf_stream(n: int, universe: int, s: float, seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [1 / (rank**s) for rank in range(1, universe + 1)]
    return rng.choices(range(universe), weights=weights, k=n)


@pytest.mark.parametrize("hashing", ["table digest", "value rows"])
def test_topk_recall_on_zipf(hashing: str) -> None:
    k, depth = 50, 4
    stream = _zipf_stream(200_000, 50_000, 1.1, seed=7)
    cms, top = CountMinSketch(2048, depth), TopK(k)
    rows = RowHash(Anonymizer("k"), cms.width, depth)
    cells = {
        key: cms.indexes(_digest(key, depth))
        if hashing == "table digest"
        else rows.positions(b"t.c\0%d" % key)
        for key in set(stream)
    }
    for key in stream:
        if top.offer(key, cms.add(cells[key])):
            top.labels[key] = key
    exact = Counter(stream)
    truth = {key for key, _ in exact.most_common(k)}
    found = {label for label, _ in top.items()}
    recall = len(truth & found) / k
    assert recall >= 0.95, recall
    for label, estimate in top.items():
        assert estimate >= exact[label]  # estimates only ever overestimate


def test_decay_halves_everything() -> None:
    cms, top = CountMinSketch(16, 2), TopK(2)
    d = _digest("x", 2)
    for _ in range(10):
        top.offer("x", cms.add(cms.indexes(d)))
    top.labels["x"] = "x"
    cms.halve()
    top.halve()
    assert cms.estimate(cms.indexes(d)) == 5
    assert top.items() == [("x", 5)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_hot_data_tables_values_and_decay() -> None:
    clock = Clock()
    hot = HotData(Anonymizer("k"), top_k=5, width=256, depth=4, decay_seconds=60, clock=clock)
    for i in range(100):
        hot.add_table("pgbench_accounts")
        hot.add_value("pgbench_accounts.aid", b"424242" if i % 2 else str(i).encode())
    hot.add_table("pgbench_branches", 7)
    view = hot.hot(3)
    assert view["tables"][0] == {"table": "pgbench_accounts", "count": 100}
    assert view["tables"][1] == {"table": "pgbench_branches", "count": 7}
    top_value = view["values"][0]
    assert top_value["column"] == "pgbench_accounts.aid" and top_value["count"] >= 50
    assert "424242" not in repr(view)
    assert hot.maybe_decay() is False
    clock.now += 61
    assert hot.maybe_decay() is True
    assert hot.hot(1)["tables"][0]["count"] == 50


def test_value_tokens_depend_on_the_key() -> None:
    a = HotData(Anonymizer("one"), top_k=2)
    b = HotData(Anonymizer("two"), top_k=2)
    for hot in (a, b):
        hot.add_value("t.c", b"'secret'")
    assert a.hot()["values"][0]["value"] != b.hot()["values"][0]["value"]
    assert "secret" not in repr(a.hot())


def test_add_values_matches_add_value_one_by_one() -> None:
    rng = random.Random(7)
    literals = [str(int(rng.paretovariate(1.0))).encode() for _ in range(2_000)]
    for depth in (4, 3):
        one = HotData(Anonymizer("k"), top_k=10, width=64, depth=depth)
        many = HotData(Anonymizer("k"), top_k=10, width=64, depth=depth)
        for literal in literals:
            one.add_value("t.c", literal)
        counts = Counter(b"t.c\0" + literal for literal in literals)
        many.add_values(dict(counts))
        assert many.values._counts == one.values._counts
        assert many.values.total == one.values.total == 2_000
        # One offer per key (not per use): the estimates the Top-K keeps may
        # differ by collisions, never below the true counts; same leaders.
        top_many, top_one = many.hot(3)["values"], one.hot(3)["values"]
        assert [v["value"] for v in top_many] == [v["value"] for v in top_one]
        exact = sorted(counts.values(), reverse=True)[:3]
        assert all(v["count"] >= n for v, n in zip(top_many, exact, strict=True))


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(min_value=0, max_value=10_000),
    depth=st.sampled_from([4, 3]),
    top_k=st.integers(min_value=1, max_value=8),
)
def test_add_values_keeps_what_a_plain_cms_and_topk_keep(seed: int, depth: int, top_k: int) -> None:
    """add_values skips the Top-K for estimates at or under its floor without
    looking the key up: the table must end up as offering every key would."""
    rng = random.Random(seed)
    anonymizer = Anonymizer("k")
    hot = HotData(anonymizer, top_k=top_k, width=32, depth=depth)
    cms, top = CountMinSketch(32, depth), TopK(top_k)
    rows = RowHash(anonymizer, 32, depth)
    for drain in range(30):
        counts = Counter(
            b"t.c\0%d" % int(rng.paretovariate(0.8)) for _ in range(rng.randrange(1, 60))
        )
        hot.add_values(dict(counts))
        for key, count in counts.items():
            digest = anonymizer.digest(key, 32)
            if top.offer(digest, cms.add(rows.positions(key), count)):
                top.labels[digest] = key
        if drain % 7 == 6:  # decay now and then
            for part in (hot.values, hot.top_values, cms, top):
                part.halve()
    assert hot.values._counts == cms._counts
    assert hot.top_values.counts == top.counts


_P61 = (1 << 61) - 1


@pytest.mark.skipif(sketch._compiled_count_keys is None, reason="the extension was not built")
@settings(max_examples=80, deadline=None)
@given(
    keys=st.lists(st.binary(max_size=40), max_size=120),
    seeds=st.lists(st.integers(min_value=1, max_value=_P61 - 1), min_size=3, max_size=13).filter(
        lambda seeds: len(seeds) % 2 == 1
    ),
    width=st.integers(min_value=1, max_value=5_000),
    floor=st.integers(min_value=-1, max_value=6),
)
def test_compiled_count_keys_says_what_the_python_one_says(
    keys: list[bytes], seeds: list[int], width: int, floor: int
) -> None:
    counts = dict(Counter(keys))
    depth = (len(seeds) - 1) // 2
    said = []
    for count_keys in (sketch._py_count_keys, sketch._compiled_count_keys):
        cells = array("q", bytes(8 * depth * width))
        cells[0] = 3  # counts already there add up
        found = count_keys(counts, array("Q", seeds), cells, width, floor)
        said.append((list(found.items()), cells))
    assert said[0] == said[1]


_SPANS = st.lists(
    st.tuples(
        st.sampled_from([b"t.id\0", b"t.name\0", b"\0", b"pgbench_accounts.aid\0"]),
        st.integers(0, 35),
        st.integers(0, 35),
    ),
    max_size=3,
).map(tuple)


@pytest.mark.skipif(sketch._compiled_count_spans is None, reason="the extension was not built")
@settings(max_examples=100, deadline=None)
@given(
    texts=st.lists(st.binary(max_size=30), max_size=40),
    spans=_SPANS,
    width=st.integers(min_value=1, max_value=64),
    floor=st.integers(min_value=-1, max_value=4),
)
def test_compiled_count_spans_says_what_the_python_one_says(
    texts: list[bytes], spans: tuple[tuple[bytes, int, int], ...], width: int, floor: int
) -> None:
    seeds = RowHash(Anonymizer("k"), width, 3).seeds
    said = []
    for count_spans in (sketch._py_count_spans, sketch._compiled_count_spans):
        cells = array("q", bytes(8 * 3 * width))
        found = count_spans([(texts, spans), (texts[::2], spans)], seeds, cells, width, floor)
        said.append((list(found.items()), cells))
    assert said[0] == said[1]


@settings(max_examples=60, deadline=None)
@given(texts=st.lists(st.binary(max_size=30), max_size=40), spans=_SPANS)
def test_span_values_count_as_their_keys_do(
    texts: list[bytes], spans: tuple[tuple[bytes, int, int], ...]
) -> None:
    """A value hashed where it sits in its text lands in the cells its key
    (``prefix + text[start:end]``) does, and the top values agree."""
    by_span = HotData(Anonymizer("k"), top_k=4, width=16, depth=3)
    by_key = HotData(Anonymizer("k"), top_k=4, width=16, depth=3)
    by_span.add_span_values([(texts, spans), (texts[1:], spans[:1])])
    by_key.add_values(
        dict(
            Counter(p + t[s:e] for p, s, e in spans for t in texts)
            + Counter(p + t[s:e] for p, s, e in spans[:1] for t in texts[1:])
        )
    )
    assert by_span.values._counts == by_key.values._counts
    assert by_span.values.total == by_key.values.total
    for hot in (by_span, by_key):  # every kept value at least as counted
        for (_column, _token, h), estimate in hot.top_values.items():
            assert estimate <= hot.values.estimate(hot._rows.cells(h))


def test_what_is_not_a_span_is_refused_by_both() -> None:
    seeds = RowHash(Anonymizer("k"), 4, 2).seeds
    for count_spans in filter(None, (sketch._py_count_spans, sketch._compiled_count_spans)):
        for texts, spans, error in (
            (["text"], ((b"t.id\0", 0, 2),), TypeError),
            ([b"text"], (("t.id\0", 0, 2),), TypeError),
            ([b"text"], ((b"t.id\0", -1, 2),), TypeError),
            ([b"text"], ((b"t.id", 0, 2),), ValueError),  # no NUL
            ([b"text"], ((b"t\0id\0", 0, 2),), ValueError),  # two
        ):
            with pytest.raises(error):
                count_spans([(texts, spans)], seeds, array("q", bytes(8 * 8)), 4, 0)


def test_row_hash_is_the_polynomial_then_one_affine_map_per_row() -> None:
    rows = RowHash(Anonymizer("k"), 1_000, 2)
    base, a0, b0, a1, b1 = rows.seeds

    def words(data: bytes) -> list[int]:
        data += bytes(-len(data) % 4)
        return [int.from_bytes(data[i : i + 4], "little") for i in range(0, len(data), 4)]

    key = b"t.c\0abcdefg"  # the prefix one word, the value two (zero-padded)
    h = 1
    for word in [*words(b"t.c\0"), *words(b"abcdefg"), 7]:
        h = (h * base + word) % _P61
    assert rows.positions(key) == [
        (a0 * h + b0) % _P61 % 1_000,
        1_000 + (a1 * h + b1) % _P61 % 1_000,
    ]
    # The cells depend on the key: another deployment's sketch puts values elsewhere.
    other = RowHash(Anonymizer("another key"), 1_000, 2)
    keys = [b"t.c\0%d" % i for i in range(50)]
    assert [rows.positions(k) for k in keys] != [other.positions(k) for k in keys]


def test_value_keys_are_bytes() -> None:
    for count_keys in filter(None, (sketch._py_count_keys, sketch._compiled_count_keys)):
        with pytest.raises(TypeError):
            count_keys(
                {"t.c\0text": 1},
                RowHash(Anonymizer("k"), 4, 4).seeds,
                array("q", bytes(8 * 16)),
                4,
                0,
            )


def test_add_values_without_the_extension_keeps_what_it_keeps_with_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = random.Random(3)
    drains = [
        dict(Counter(b"t.c\0%d" % int(rng.paretovariate(0.8)) for _ in range(50)))
        for _ in range(40)
    ]
    kept = []
    for count_keys in (sketch._count_keys, sketch._py_count_keys):
        monkeypatch.setattr(sketch, "_count_keys", count_keys)
        hot = HotData(Anonymizer("k"), top_k=5, width=32)
        for counts in drains:
            hot.add_values(counts)
        kept.append((hot.values._counts, hot.values.total, hot.top_values.counts, hot.hot(5)))
    assert kept[0] == kept[1]
