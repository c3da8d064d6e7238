"""hybridkv's logs inside vLLM: in vLLM's format, at vLLM's level, through vLLM's handlers.

The connector and the library log under ``hybridkv.*``. vLLM configures only its own ``vllm`` logger
(``VLLM_LOGGING_LEVEL``, ``VLLM_CONFIGURE_LOGGING``, ``--logging-config``: a handler with vLLM's
format, its level, ``propagate`` off), so under ``vllm serve`` hybridkv's INFO lines were dropped
and its warnings printed bare by Python's last-resort handler.

:func:`follow_vllm_logging` makes the ``vllm`` logger the parent of ``hybridkv``. Level and handlers
are then looked up through it at each record, so hybridkv follows whatever vLLM configures, before
or after this call, and every reconfiguration (each vLLM process applies its logging config at
start): with vLLM's logging on, a connector line is formatted, filtered and written as
NixlConnector's are; with ``VLLM_CONFIGURE_LOGGING=0``, ``vllm`` is a plain logger that passes
records on to the root, as before. A level set on ``hybridkv`` itself still wins. Nothing here
imports vLLM.
"""

from __future__ import annotations

import logging

ROOT = "hybridkv"
VLLM = "vllm"


def follow_vllm_logging() -> None:
    """Route ``hybridkv.*`` records through vLLM's ``vllm`` logger (idempotent)."""
    ours = logging.getLogger(ROOT)
    vllm = logging.getLogger(VLLM)
    if ours.parent is not vllm:
        # A logger's parent is what the logging module walks for the effective level and for handlers;
        # "hybridkv" is a top-level name, so nothing re-parents it later.
        ours.parent = vllm


def following_vllm_logging() -> bool:
    return logging.getLogger(ROOT).parent is logging.getLogger(VLLM)
