"""Tools built on the library: ``bench`` (``minicomm bench``, nccl-tests style), ``peers`` (the
same calls through MPICH and gloo, side by side), and ``benchspec`` (what both share)."""
