"""Cases shared by the flat family tests (ring, tree, rhd): which counts and roots a world size
is verified with, and the verification sweeps every flat family runs the same way."""
from minicomm.algorithms import build_all
from minicomm.schedule import ROOTED
from minicomm.verifier import verify

SIZES = range(1, 21)


def counts(collective, p):
    """0, 1, a count below p, and counts above p not divisible by it (barrier moves no data)."""
    return [0] if collective == "barrier" else sorted({0, 1, 3, p + 1, 2 * p + 3})


def roots(collective, p):
    return range(p) if collective in ROOTED else [0]


def ceil_lg(p):
    return (p - 1).bit_length()


def verify_every_root_and_count(family, collective, p):
    for n in counts(collective, p):
        for root in roots(collective, p):
            scheds = build_all(collective, family, p, n, root)
            assert all(s.algorithm == family for s in scheds)
            verify(scheds)


def verify_large_world(family, collective, p):
    n = 0 if collective == "barrier" else p + 1
    for root in sorted({0, p // 2, p - 1} & set(roots(collective, p))):
        verify(build_all(collective, family, p, n, root))
