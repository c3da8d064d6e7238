"""The mutation check (``python -m tests.property.mutate``) in CI: two of its mutants, corpus only.

The whole check (every mutant, generated examples) takes minutes and runs by hand; here two mutants
keep it working: each must still be found by text in hybridkv/fencing, and caught.
"""

from __future__ import annotations

from tests.property import mutate


def test_every_mutant_line_is_still_in_the_fencing_code(tmp_path) -> None:
    # The line of each mutant, found by text: a refactor that moves or rewrites one fails here, naming it.
    # Each against the unmutated code (two mutants may rewrite the same line, each its own way).
    mutate._copy(tmp_path)
    for m in mutate.MUTANTS:
        lines = (tmp_path / mutate.FENCING / m.file).read_text().split("\n")
        if len(mutate._find(m, lines)) != 1:
            mutate.apply(m, tmp_path)  # raises MutantNotFound, naming the mutant and the file
    assert len(mutate.MUTANTS) >= 8


def test_two_mutants_are_caught_by_the_corpus() -> None:
    # Reuse without the watermark (rule 2) and an aborted import's blocks freed under its write (rule 5).
    chosen = [m for m in mutate.MUTANTS if m.name in ("reuse-without-watermark", "abort-ignores-transfers")]
    results = mutate.check(chosen, examples=0, seed=26, machine=False, timeout_s=120, log=lambda _: None)
    assert results == {"reuse-without-watermark": "caught", "abort-ignores-transfers": "caught"}
