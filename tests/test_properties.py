"""Hypothesis: the verifier over random (collective, family, world size up to 64, count, root,
node map), and real inproc runs of random calls against the numpy reference."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import minicomm as mc
from collective_check import COLLS, check_one, ops_for
from minicomm.algorithms import FAMILIES, build_all
from minicomm.schedule import COLLECTIVES, ROOTED
from minicomm.verifier import verify


@st.composite
def schedule_cases(draw):
    coll = draw(st.sampled_from(COLLECTIVES))
    fam = draw(st.sampled_from(FAMILIES))
    p = draw(st.integers(1, 64))
    count = 0 if coll == "barrier" else draw(st.integers(0, 2 * p + 3))
    root = draw(st.integers(0, p - 1)) if coll in ROOTED else 0
    topo = None
    if fam == "hier":
        nodes = draw(st.integers(1, p))
        # an arbitrary (not necessarily contiguous) rank -> node map with every node used
        labels = draw(st.lists(st.integers(0, nodes - 1), min_size=p, max_size=p))
        topo = tuple(labels)
    return coll, fam, p, count, root, topo


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schedule_cases())
def test_every_generated_schedule_verifies(case):
    coll, fam, p, count, root, topo = case
    stats = verify(build_all(coll, fam, p, count, root, topo))
    assert stats["ranks"] == p


@st.composite
def data_cases(draw):
    coll = draw(st.sampled_from(COLLS))
    fam = draw(st.sampled_from(FAMILIES + ("auto",)))
    p = draw(st.integers(1, 7))
    nodes = draw(st.integers(1, p))
    count = draw(st.integers(0, 3 * p + 2))
    dtype = draw(st.sampled_from(["int8", "uint16", "int64", "float32", "float64", "bool"]))
    op = draw(st.sampled_from(ops_for(dtype)))
    root = draw(st.integers(0, p - 1))
    inplace = draw(st.booleans())
    salt = draw(st.integers(0, 100))
    return coll, fam, p, nodes, count, dtype, op, root, inplace, salt


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data_cases())
def test_random_calls_match_numpy(case):
    coll, fam, p, nodes, count, dtype, op, root, inplace, salt = case

    def fn(comm):
        return check_one(comm, coll, fam, count, dtype, op, root, inplace, salt)
    assert mc.spawn(fn, p, transport="inproc", nodes=nodes, timeout=60) == [1] * p
