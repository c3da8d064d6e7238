"""Which producer ranks a vLLM decode rank reads, and how their blocks pair.

Both live in descriptors/planning.py, beside the planner that decides every
pairing (pages where both sides cut them alike, fields otherwise): the worker
hands that planner to its endpoints and names the producer ranks with
:func:`source_ranks` (NixlConnector's TP mapping). Re-exported here for the
connector's callers. Importing it does not import vLLM.
"""

from __future__ import annotations

from descriptors.planning import DescriptorPlanner, FieldPlan, source_ranks

__all__ = ["DescriptorPlanner", "FieldPlan", "source_ranks"]
