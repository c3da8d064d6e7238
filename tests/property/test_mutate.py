"""The mutation check (``python -m tests.property.mutate``) in CI: a few of its mutants, corpus only.

The whole check (every mutant, generated examples) takes minutes and runs by hand; here every mutant's
line must still be found in hybridkv/fencing (or hybridkv/transport, for the staging slots), and one mutant of each family must be caught by the corpus.
"""

from __future__ import annotations

from tests.property import mutate


def test_every_mutant_line_is_still_in_the_fencing_code(tmp_path) -> None:
    # The line of each mutant, found by text: a refactor that moves or rewrites one fails here, naming it.
    # Each against the unmutated code (two mutants may rewrite the same line, each its own way).
    mutate._copy(tmp_path)
    for m in mutate.MUTANTS:
        lines = (tmp_path / m.package / m.file).read_text().split("\n")
        if len(mutate._find(m, lines)) != 1:
            mutate.apply(m, tmp_path)  # raises MutantNotFound, naming the mutant and the file
    assert len(mutate.MUTANTS) >= 44


# One mutant of each family of issue 47 (the ledger and the quarantine paths), with the first two of the list,
# and one of the staging slots (issue 49).
CHOSEN = {
    "reuse-without-watermark": "rule 2",
    "abort-ignores-transfers": "rule 5",
    "ledger-failed-is-drained": "a quarantined block released before its transfer is terminal",
    "unpark-stays-quarantined": "a quarantined block taken back by a prefix hit, freed by its old transfer's end",
    "dead-incarnation-lands": "a dead incarnation's landing counted for the next request of the same id",
    "quarantine-exit-joins-earlier-entry": "a release that ignores the fence of a block settled later",
    "give-up-once-failed": "a recompute (give-up) allowed while an inbound write still runs",
    "slot-back-at-first-reader": "a staging slot given back while another reader reads it (issue 49)",
}


def test_a_mutant_of_each_family_is_caught_by_the_corpus() -> None:
    chosen = [m for m in mutate.MUTANTS if m.name in CHOSEN]
    results = mutate.check(chosen, examples=0, seed=26, machine=False, timeout_s=120, log=lambda _: None)
    assert results == {name: "caught" for name in CHOSEN}
