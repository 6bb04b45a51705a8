from minicomm.schedule import *
def build(collective, rank, size, count, root, topology):
    assert collective == "allreduce"
    b = ScheduleBuilder(collective, "ring", rank, size, count, root)
    p = size; ch = chunk_bounds(count, p)
    right, left = (rank + 1) % p, (rank - 1) % p
    first = [Copy(IN, 0, OUT, 0, count)]
    if p == 1:
        b.step(*first); return b.build()
    for s in range(p - 1):
        so, sn = ch[(rank - s) % p]; ro, rn = ch[(rank - s - 1) % p]
        b.step(*(first if s == 0 else []), Send(right, OUT, so, sn), Recv(left, OUT, ro, rn, True))
    for s in range(p - 1):
        so, sn = ch[(rank + 1 - s) % p]; ro, rn = ch[(rank - s) % p]
        b.step(Send(right, OUT, so, sn), Recv(left, OUT, ro, rn))
    return b.build()
