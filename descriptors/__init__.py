"""Layouts + block lists -> NIXL descriptor arrays, and the descriptor-count analyzer."""

from .compiler import TransferPlan, TransferPlanner, compile_transfer, plan_sources

__all__ = ["TransferPlan", "TransferPlanner", "compile_transfer", "plan_sources"]
