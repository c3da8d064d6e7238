"""One simulated request: its sizes, where it is, and the times of each stage (the engine's only record of it)."""

from __future__ import annotations

import math


class Request:
    __slots__ = ("isl", "osl", "descriptors", "posted", "nbytes", "rank", "endpoint", "t_arrive", "t_started",
                 "t_prefilled", "t_admitted", "t_transferred", "t_first", "t_finish", "waited", "blocks",
                 "prefill_blocks", "join", "cover", "epoch", "made", "recompute", "posting_s", "preempted",
                 "prefill")

    def __init__(self, t: float, isl: int, osl: int, transfer: tuple[int, int], posted: int) -> None:
        self.t_arrive = t
        self.isl, self.osl = isl, osl
        # All of the rank's descriptors cross the link; one posting thread posts `posted` of them.
        self.descriptors, self.nbytes = transfer
        self.posted = posted
        self.rank = self.endpoint = self.prefill = -1
        self.t_started = self.t_prefilled = self.t_admitted = self.t_transferred = math.nan
        self.t_first = self.t_finish = math.nan
        self.waited = False
        self.blocks = self.prefill_blocks = 0
        self.join = self.cover = self.epoch = self.made = 0
        self.recompute = 0  # context tokens to compute again on decode after a preemption
        self.posting_s = 0.0
        self.preempted = 0
