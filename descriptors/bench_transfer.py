"""`hybridkv bench transfer`: the transport's benchmark (hybridkv.transport.bench), given hybridkv's planner.

The transport never pairs blocks; its benchmark's producer and consumer need a
planner, which lives here, one layer above the transport. Both sides of the
benchmark cut pages alike, so the planner promises pages (and posts the
prepped-list index pairs of the compiler's affine fast path).
"""

from __future__ import annotations

import argparse


def register(parser: argparse.ArgumentParser) -> None:
    from hybridkv.transport import bench
    from hybridkv.transport.config import Pairing

    from .planning import DescriptorPlanner

    bench.register(parser)
    parser.set_defaults(planner=DescriptorPlanner(pairing=Pairing.PAGES))
