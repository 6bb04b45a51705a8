"""Gloo's bcube allreduce, written only through minicomm's public API.

Source: gloo, gloo/allreduce_bcube.h (``AllreduceBcube``), and the base it is run with,
caffe2/contrib/gloo/allreduce_ops.cc (``getAllrduceBcubeBase``); the topology is BCube's
(C. Guo et al., "BCube: A High Performance, Server-centric Network Architecture for Modular
Data Centers", SIGCOMM 2009).

Algorithm: the p ranks are the points of a k-dimensional mixed-radix cube with radices
b_0, ..., b_{k-1} (p = b_0 * ... * b_{k-1}); digit s of rank r is (r // w_s) % b_s with
w_s = b_0 * ... * b_{s-1}, so the group of dimension s -- the b_s ranks that differ from r only
in digit s -- is {r + (j - digit_s) w_s : j < b_s}: gloo's groups of ``base`` peers at
distance base^s. Reduce-scatter, steps s = 0..k-1: each group holds the same range of the
vector (the one its digits 0..s-1 picked); it is cut into b_s parts (sizes differ by at most
one), the member with digit j keeps part j, sends every other part to the member that keeps it
and reduces the b_s - 1 partials it receives into its own, so the range shrinks by b_s each
step and rank r ends owning 1/p of the vector, fully reduced. Allgather, steps s = k-1..0: the
reverse -- send the part it holds to the b_s - 1 group peers and receive theirs into place. All
in ``out`` (no scratch); the first step sends straight from ``in`` and copies only the kept
part. Every rank ends with the same result (each element is reduced at one place, then copied).

Choosing the radices (what this file adds; gloo takes ``base`` from its context):
  * caffe2's ``getAllrduceBcubeBase``: the first B of 6, 5, 4, 3, 2 with p = B^e, or with
    p < B^2 and B | p; gloo then runs groups of B at distances 1, B, B^2, ... and the last
    dimension holds p / B^(e-1) ranks. This file's rule below gives exactly that radix list
    wherever caffe2 picks B >= 3, or p <= 16 (e.g. 1,024 -> 4^5, 36 -> 6 x 6, 24 -> 6 x 4,
    8 -> 4 x 2, 10 -> 5 x 2; checked against an integer port of getAllrduceBcubeBase for every
    p up to 20,000). caffe2 computes the exponent as ceil(log2 p / log2 B) in single-precision
    floats, which misses 36 = 6^2, 216 = 6^3 and 1,296 = 6^4; they are powers of 6 here.
  * Where caffe2 would pick B = 2 for p = 2^(2j+1) >= 32 or give up (it then runs halving-doubling
    instead): p is factored into the fewest radices of at most 6 (5s; a 3 with a 2 as a 6;
    other 2s in pairs as 4s; a lone 2 or 3s), largest first -- e.g. 32 -> 4 x 4 x 2, which is
    also what gloo's AllreduceBcube itself runs with base 4 (it handles p = c * base^x, c <= base),
    and 100 -> 5 x 5 x 4, 96 -> 6 x 4 x 4.
  * p with a prime factor >= 7 (7, 11, 13, 14, ...): folded, as MPICH's Rabenseifner does, onto
    p' = the largest p' <= p whose prime factors are all <= 5 (p' >= p/2: a power of two
    qualifies). With m = p - p', the first 2m ranks pair up (2i, 2i+1); the odd one sends its
    input to the even one, which reduces it in, and sits out; the p' survivors run the cube on
    participant indices; at the end each even rank sends the result to its odd partner.

Cost (n elements; k = the number of radices of p'; all messages of a step go at once):
    2k alpha + 2 (p'-1)/p' n beta + (p'-1)/p' n gamma, plus 2 alpha + 2 n beta + n gamma folded;
step s sends b_s - 1 messages of n / (b_0 ... b_s) elements each (a port that sends one message
at a time pays (b_s - 1) alpha for it). With radix 4, k = log_4 p: half the rounds of halving-
doubling at the same bandwidth term. Small vectors: parts smaller than one element travel as
zero-length messages (they keep the order); gloo instead sends one element at least.

Restrictions: allreduce only.
"""
import minicomm as mc
from minicomm.schedule import IN, OUT, Copy, Recv, ScheduleBuilder, Send, chunk_bounds

NAME = "bcube"


def smooth(p):
    """True when every prime factor of p is at most 5."""
    for f in (2, 3, 5):
        while p % f == 0:
            p //= f
    return p == 1


def radices(p):
    """(p', radix list) for a world of p: the participants after the fold and their cube."""
    pp = p
    while not smooth(pp):
        pp -= 1
    counts = {}
    q = pp
    for f in (2, 3, 5):
        while q % f == 0:
            q //= f
            counts[f] = counts.get(f, 0) + 1
    twos, threes, fives = counts.get(2, 0), counts.get(3, 0), counts.get(5, 0)
    sixes = min(twos, threes)
    twos, threes = twos - sixes, threes - sixes
    rad = [5] * fives + [6] * sixes + [4] * (twos // 2) + [2] * (twos % 2) + [3] * threes
    rad.sort(reverse=True)
    return pp, tuple(rad)


def build(collective, rank, size, count, root, topology):
    b = ScheduleBuilder(collective, NAME, rank, size, count, root)
    n, p = count, size
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return b.build()
    pp, rad = radices(p)
    rem = p - pp
    folded = rank < 2 * rem                   # one of a folding pair (2i, 2i+1)
    if folded and rank % 2 == 1:              # the pair's odd rank sits out
        b.step(Send(rank - 1, IN, 0, n))
        b.step(Recv(rank - 1, OUT, 0, n))
        return b.build()
    me = rank // 2 if folded else rank - rem   # participant index

    def real(part):
        return 2 * part if part < rem else part + rem

    from_in = True
    if folded:
        b.step(Copy(IN, 0, OUT, 0, n), Recv(rank + 1, OUT, 0, n, True))
        from_in = False

    # per dimension: (group members by digit, my digit, the range's parts (offset, count))
    dims, lo, cnt, w = [], 0, n, 1
    for radix in rad:
        digit = (me // w) % radix
        members = [real(me + (j - digit) * w) for j in range(radix)]
        parts = [(lo + o, c) for o, c in chunk_bounds(cnt, radix)]
        dims.append((members, digit, parts))
        lo, cnt = parts[digit]
        w *= radix

    for members, digit, parts in dims:        # reduce-scatter
        ko, kn = parts[digit]
        others = [j for j in range(len(members)) if j != digit]
        src = IN if from_in else OUT
        lead = [Copy(IN, ko, OUT, ko, kn)] if from_in else []
        b.step(*lead, *[Send(members[j], src, *parts[j]) for j in others],
               *[Recv(members[j], OUT, ko, kn, True) for j in others])
        from_in = False
    for members, digit, parts in reversed(dims):   # allgather
        others = [j for j in range(len(members)) if j != digit]
        b.step(*[Send(members[j], OUT, *parts[digit]) for j in others],
               *[Recv(members[j], OUT, *parts[j]) for j in others])
    if folded:
        b.step(Send(rank + 1, OUT, 0, n))
    return b.build()


mc.algorithms.register(NAME, build, collectives=("allreduce",))
