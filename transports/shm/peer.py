"""One peer of the shm transport: both rings with it, its doorbell socket, the receive matching."""
from __future__ import annotations

import socket
from collections import deque
from typing import Dict, Optional

import numpy as np

from .. import cma
from ..progress import Inbox


class _Peer:
    """Both directions with one peer: the outbound ring (in the peer's segment), the inbound ring
    (in ours), the doorbell socket, and the receive matching."""
    __slots__ = ("rank", "sock", "fd", "flag_q", "tx_mm", "tx_u8", "tx_ctl", "tx_data", "tx_size",
                 "tx_head", "tx_tail", "tx_chunk", "txq", "tx_q", "rx_mm", "rx_u8", "rx_ctl",
                 "rx_data", "rx_size", "rx_q", "rx_head", "rx_tail", "rx_cur", "inbox", "owed",
                 "closed", "pid", "cma", "cma_read", "cma_wait", "cma_min", "cma_pace",
                 "rx_typed", "futex_i", "futex_addr")

    def __init__(self, rank: int):
        self.rank = rank
        self.sock: Optional[socket.socket] = None
        self.fd = -1
        # the rings, mapped by setup (segments.py): None until then and after teardown
        self.tx_mm = self.tx_u8 = self.tx_q = self.flag_q = None
        self.rx_mm = self.rx_u8 = self.rx_q = None
        self.tx_ctl = self.tx_data = self.tx_size = self.tx_chunk = 0
        self.rx_ctl = self.rx_data = self.rx_size = 0
        self.txq: deque = deque()
        self.tx_head = self.tx_tail = 0
        self.rx_head = self.rx_tail = 0
        self.rx_cur = None
        self.rx_typed: Dict[np.dtype, np.ndarray] = {}   # the inbound segment per dtype
        self.futex_i = None           # the peer's first page as int32 words (its futex word)
        self.futex_addr = 0
        self.inbox = Inbox(rank)
        self.owed = False             # a doorbell is due at the end of this pass
        self.closed: Optional[str] = None
        self.pid = 0
        self.cma = False              # our large sends to it go single-copy (it reads us)
        self.cma_read: Optional[str] = "not probed"   # None: we can read its memory; else why not
        self.cma_wait: deque = deque()  # (ring position past the descriptor, send) being read
        self.cma_min = cma.DEFAULT_MIN  # our collective sends to it of this size go single-copy
        self.cma_pace: Optional[tuple] = None   # (read s, copy s) of our setup probe of its memory
