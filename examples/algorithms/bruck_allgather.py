"""Bruck's allgather, written only through minicomm's public API.

Source: J. Bruck, C.-T. Ho, S. Kipnis, E. Upfal, D. Weathersby, "Efficient algorithms for
all-to-all communications in multiport message-passing systems", IEEE TPDS 8(11), 1997.

Algorithm: rank r keeps the blocks in rotated order (its own first) in ``tmp``. At round k
(distance d = 2^k) it sends the first min(d, p - d) blocks it holds to rank r - d and receives as
many from rank r + d, appended after them. After ceil(lg p) rounds it holds all p blocks,
rotated by r, and copies them into place.

Cost: ceil(lg p) α + ((p - 1)/p) p n β (n elements per block): the fewest rounds of any
allgather, for any p (not only powers of two), with one final local rotation.

Restrictions: allgather only.
"""
import minicomm as mc
from minicomm.schedule import IN, OUT, ScheduleBuilder

NAME = "bruck"


def build(collective, rank, size, count, root, topology):
    b = ScheduleBuilder(collective, NAME, rank, size, count, root)
    blocks = b.tmp_chunk(size * count).split(size)     # block i = rank (rank + i)'s
    out = b.chunks(OUT, size)
    b.step(b.chunks(IN, 1)[0].copy_to(blocks[0]))
    have, d = 1, 1
    while have < size:
        m = min(d, size - have)
        src, dst = (rank + d) % size, (rank - d) % size
        b.step(*[blocks[i].send(dst) for i in range(m)],
               *[blocks[have + i].recv(src) for i in range(m)])
        have += m
        d *= 2
    b.step(*[blocks[i].copy_to(out[(rank + i) % size]) for i in range(size)])
    return b.build()


mc.algorithms.register(NAME, build, collectives=("allgather",))
