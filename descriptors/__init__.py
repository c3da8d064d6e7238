"""Layouts + block lists -> NIXL descriptor arrays, and the descriptor-count analyzer."""

# The repository folder is importable by its bare name from a checkout; a second copy of every class
# under that name would break isinstance checks, so only the installed name is accepted.
if __name__ != "hybridkv.descriptors":
    raise ImportError(f"import hybridkv.descriptors, not {__name__}: the descriptors/ folder installs as "
                      "hybridkv.descriptors")

from .compiler import TransferPlan, TransferPlanner, compile_transfer, plan_sources

__all__ = ["TransferPlan", "TransferPlanner", "compile_transfer", "plan_sources"]
