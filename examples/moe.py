"""A mixture-of-experts layer over ranks: top-k routing, alltoallv dispatch and combine.

Every rank holds a batch of tokens and ``--experts-per-rank`` experts (small MLPs); a gate sends
each token to its top-k experts, wherever they live. The layer:

1. gate: scores = x @ Wg, softmax, the top-k experts per token and their renormalised weights;
2. dispatch: each (token, expert) pair goes to the expert's rank: the rows are sorted by
   destination and sent with ``comm.alltoallv`` (the counts differ per pair of ranks, zeros
   included), with the expert ids in a second alltoallv of the same counts;
3. experts: each rank runs its experts on the rows it received;
4. combine: the outputs go back with the reverse alltoallv (the counts just learnt are its
   receive counts, so it needs no exchange), and each token sums its k outputs, weighted.

The check: every rank's outputs equal the same layer computed in one process over all tokens
(``reference``), to float64 rounding. Run:

    python examples/moe.py --ranks 4 --tokens 64 --experts-per-rank 2 --top-k 2
"""
from __future__ import annotations

import argparse

import numpy as np

import minicomm as mc


def parameters(seed: int, d: int, hidden: int, experts: int):
    """The gate and every expert's weights: the same on every rank (one seed)."""
    rng = np.random.default_rng(seed)
    gate = rng.normal(size=(d, experts)) / np.sqrt(d)
    w1 = rng.normal(size=(experts, d, hidden)) / np.sqrt(d)
    w2 = rng.normal(size=(experts, hidden, d)) / np.sqrt(hidden)
    return gate, w1, w2


def tokens_of(rank: int, seed: int, tokens: int, d: int) -> np.ndarray:
    """Rank ``rank``'s batch; every rank can make every other's (for the reference)."""
    return np.random.default_rng(seed * 1000 + rank).normal(size=(tokens, d))


def route(x: np.ndarray, gate: np.ndarray, k: int):
    """Top-k experts per token and their weights (softmax over the chosen k)."""
    scores = x @ gate
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    chosen = np.take_along_axis(scores, top, axis=1)
    w = np.exp(chosen - chosen.max(axis=1, keepdims=True))
    return top, w / w.sum(axis=1, keepdims=True)


def expert(x: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> np.ndarray:
    return np.maximum(x @ w1, 0.0) @ w2


def moe_layer(comm, x: np.ndarray, params, k: int, per_rank: int):
    """The layer on this rank's tokens (module doc). Returns (y, rows sent to each rank)."""
    gate, w1, w2 = params
    top, weight = route(x, gate, k)
    token = np.repeat(np.arange(x.shape[0]), k)           # one row per (token, expert) pair
    eid = top.reshape(-1)
    dest = eid // per_rank
    order = np.argsort(dest, kind="stable")               # rows grouped by destination rank
    send_counts = np.bincount(dest, minlength=comm.size).tolist()
    rows, recv_counts = comm.alltoallv(x[token[order]], send_counts, return_counts=True)
    ids = comm.alltoallv(eid[order], send_counts, recv_counts=recv_counts)
    out = np.empty_like(rows)
    for e in np.unique(ids):                               # this rank's experts
        sel = ids == e
        out[sel] = expert(rows[sel], w1[e], w2[e])
    back = comm.alltoallv(out, recv_counts, recv_counts=send_counts)
    y = np.zeros_like(x)
    np.add.at(y, token[order], back * weight.reshape(-1)[order][:, None])
    return y, send_counts


def reference(xs, params, k: int) -> list:
    """The same layer in one process: every token through its top-k experts, no messages."""
    gate, w1, w2 = params
    out = []
    for x in xs:
        top, weight = route(x, gate, k)
        y = np.zeros_like(x)
        for j in range(k):
            for e in np.unique(top[:, j]):
                sel = top[:, j] == e
                y[sel] += weight[sel, j:j + 1] * expert(x[sel], w1[e], w2[e])
        out.append(y)
    return out


def run(comm, seed, tokens, d, hidden, per_rank, k):
    params = parameters(seed, d, hidden, comm.size * per_rank)
    x = tokens_of(comm.rank, seed, tokens, d)
    y, sent = moe_layer(comm, x, params, k, per_rank)
    want = reference([x], params, k)[0]
    return float(np.max(np.abs(y - want))), sent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64, help="tokens per rank")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--experts-per-rank", type=int, default=2)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transport", default="auto")
    a = ap.parse_args(argv)
    res = mc.spawn(run, a.ranks, args=(a.seed, a.tokens, a.dim, a.hidden, a.experts_per_rank,
                                       a.top_k), transport=a.transport)
    for r, (err, sent) in enumerate(res):
        print(f"rank {r}: rows sent to each rank {sent}, max |y - reference| = {err:.2e}")
    worst = max(err for err, _ in res)
    print("MoE layer matches the single-process reference" if worst < 1e-12
          else f"MISMATCH: {worst}")
    return 0 if worst < 1e-12 else 1


if __name__ == "__main__":
    raise SystemExit(main())
