"""Swing allreduce, written only through minicomm's public API.

Source: D. De Sensi, T. Bonato, D. Saam, T. Hoefler, "Swing: Short-cutting Rings for Higher
Bandwidth Allreduce", USENIX NSDI 2024 (the bandwidth-optimal variant, section 3).

Algorithm: a reduce-scatter then an allgather, both over k = lg p steps of pairwise exchanges.
At step s rank r talks to

    pi(r, s) = r + rho(s) if r is even, r - rho(s) if r is odd (mod p),
    rho(s) = sum_{i=0..s} (-2)^i = 1, -1, 3, -5, 11, -21, ...

so the step that moves the most data (step 0, half the vector) goes to a neighbour, and step s
"short-cuts" a ring at distance |rho(s)| = (2^(s+1) +- 1)/3, about two thirds of rhd's 2^s.
pi(., s) is an involution (rho(s) is odd, so an even rank's peer is odd and back): each step is
a perfect matching. Let A_k(r) = {r} and A_s(r) = A_{s+1}(r) | A_{s+1}(pi(r, s)), the ranks r
reaches in steps s..k-1 (its binomial tree). For p a power of two these are disjoint halves and
form a laminar family (each A_s(r) is A_s of each of its members), so one global order of the p
chunks of the vector -- a depth-first walk of that tree -- makes every A_s(r) a contiguous run of
chunks (``layout`` builds it and checks both properties). Reduce-scatter step s: rank r keeps
A_{s+1}(r), sends A_{s+1}(peer) (the half the peer keeps) and reduces the peer's partial of its
own half into place, the data halving each step; rank r ends owning the chunk at its position,
fully reduced. The allgather is the same steps in reverse order (s = k-1..0): send the run it
holds, receive the peer's, the data doubling each step. Each message is one contiguous run, in
``out`` itself (no scratch); the first step sends straight from ``in`` and copies only the kept
half.

Non-powers of two (MPICH's Rabenseifner fold): with p' the largest power of two <= p and
r = p - p', the first 2r ranks pair up (2i, 2i+1); the odd one sends its whole input to the even
one, which reduces it in, and sits out; the p' survivors run Swing on participant indices
0..p'-1 (pi taken mod p'); at the end every even rank of a pair sends the result to its odd
partner. The paper's own non-power-of-two schemes are not used.

Cost (n elements, lg = log2):
    p a power of two:  2 lg p alpha + 2 (p-1)/p n beta + (p-1)/p n gamma
    otherwise:         (2 lg p' + 2) alpha + (2 (p'-1)/p' + 2) n beta + ((p'-1)/p' + 1) n gamma
the same alpha-beta terms as Rabenseifner (rhd); what Swing changes is how far each step's data
travels on the physical topology (fewer hops on tori, more of the big steps on local links).
Small vectors: there is no latency-optimal variant here; with n < p' some chunks are empty and
travel as zero-length messages (they keep the step order). Every rank ends with bitwise the same
result (each chunk is reduced at one place, then copied).

Restrictions: allreduce only.
"""
import minicomm as mc
from minicomm.schedule import IN, OUT, Copy, Recv, ScheduleBuilder, Send, chunk_bounds

NAME = "swing"


def rho(s):
    """sum_{i=0..s} (-2)^i: 1, -1, 3, -5, 11, ..."""
    return (1 - (-2) ** (s + 1)) // 3


def peer(r, s, p):
    """Swing's peer of participant r at step s among p (a power of two) participants."""
    return (r + rho(s)) % p if r % 2 == 0 else (r - rho(s)) % p


# p -> layout(p). A plain dict, not functools.lru_cache: mc.spawn pickles build by value for its
# ranks, and the cache wrapper of a file loaded with runpy cannot be pickled.
_LAYOUTS = {}


def layout(p):
    """For p a power of two: ``runs[s][r] = (first chunk position, chunks)`` of A_s(r), s = 0..k,
    in the depth-first chunk order that makes every A_s(r) contiguous (the module doc)."""
    if p in _LAYOUTS:
        return _LAYOUTS[p]
    k = p.bit_length() - 1
    sets = [(r,) for r in range(p)]
    levels = [sets]
    for s in range(k - 1, -1, -1):            # A_s(r) = A_{s+1}(r) ++ A_{s+1}(pi(r, s))
        nxt = []
        for r in range(p):
            a, b = sets[r], sets[peer(r, s, p)]
            if set(a) & set(b):               # never for a power of two (Swing's theorem)
                raise AssertionError(f"swing: A_{s} not disjoint at p={p}")
            nxt.append(a + b if a[0] < b[0] else b + a)   # the same order on both partners
        sets = nxt
        levels.append(sets)
    levels.reverse()                          # levels[s][r] = A_s(r), as ordered tuples
    order = levels[0][0]
    pos = {rank: i for i, rank in enumerate(order)}
    runs = []
    for s, sets in enumerate(levels):
        row = []
        for r in range(p):
            first, m = pos[sets[r][0]], len(sets[r])
            if order[first:first + m] != sets[r]:   # laminar: A_s(r) is a run of the order
                raise AssertionError(f"swing: A_{s}({r}) not contiguous at p={p}")
            row.append((first, m))
        runs.append(tuple(row))
    _LAYOUTS[p] = tuple(runs)
    return _LAYOUTS[p]


def build(collective, rank, size, count, root, topology):
    b = ScheduleBuilder(collective, NAME, rank, size, count, root)
    n, p = count, size
    if p == 1:
        b.step(Copy(IN, 0, OUT, 0, n))
        return b.build()
    p2 = 1 << (p.bit_length() - 1)
    rem = p - p2
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

    k = p2.bit_length() - 1
    runs = layout(p2)
    starts = [o for o, _ in chunk_bounds(n, p2)] + [n]

    def span(s, r):                           # A_s(r) as (element offset, elements)
        first, m = runs[s][r]
        return starts[first], starts[first + m] - starts[first]

    # reduce-scatter: steps 0..k-1, keep A_{s+1}(me), hand over A_{s+1}(peer)
    for s in range(k):
        q = peer(me, s, p2)
        (ko, kn), (go, gn) = span(s + 1, me), span(s + 1, q)
        if from_in:
            b.step(Copy(IN, ko, OUT, ko, kn), Send(real(q), IN, go, gn),
                   Recv(real(q), OUT, ko, kn, True))
            from_in = False
        else:
            b.step(Send(real(q), OUT, go, gn), Recv(real(q), OUT, ko, kn, True))
    # allgather: the same steps in reverse, the held run doubling
    for s in range(k - 1, -1, -1):
        q = peer(me, s, p2)
        (ko, kn), (go, gn) = span(s + 1, me), span(s + 1, q)
        b.step(Send(real(q), OUT, ko, kn), Recv(real(q), OUT, go, gn))
    if folded:
        b.step(Send(rank + 1, OUT, 0, n))
    return b.build()


mc.algorithms.register(NAME, build, collectives=("allreduce",))
