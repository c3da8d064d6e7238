"""Mutation check of the fencing proof: plausible one-line bugs in hybridkv/fencing (and in the staging
slots' bookkeeping, hybridkv/transport), each of which the property suite must catch.

    python -m tests.property.mutate                 # every mutant, the rule tests at 200 examples each
    python -m tests.property.mutate --corpus-only   # the fixed @example corpus alone (seconds a mutant)
    python -m tests.property.mutate --generated-only  # the random search alone, no corpus
    python -m tests.property.mutate --machine       # also the two-sided state machine
    python -m tests.property.mutate --only reuse-off-by-one abort-ignores-transfers

For each mutant, hybridkv/ and tests/ are copied into a temporary directory, the one line is
replaced there (never in the working tree) and pytest runs the property suite on the copy, stopping at
the first failure. A mutant is *caught* when the suite fails, *survives* when it passes. The original
copy runs first and must pass, or nothing is concluded. The exit status is 0 only if every mutant was
caught.

A mutant names its line by exact text, not number (the fencing modules are edited by others while
this list stands still): the text must be one whole line of the file, stripped of its newline, found
exactly once, or the check stops with an error naming the mutant and the file. When a refactor moves
or rewrites a line, update the mutant here, with the same bug.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FENCING = "hybridkv/fencing"
TRANSPORT = "hybridkv/transport"


@dataclass(frozen=True, kw_only=True)
class Mutant:
    name: str
    file: str  # relative to ``package``
    original: str  # one whole line, exact (indentation included)
    replacement: str
    bug: str  # what goes wrong, in the rules' words
    within: str | None = None  # a function name, where the line also occurs elsewhere in the file
    package: str = FENCING


MUTANTS: tuple[Mutant, ...] = (
    Mutant(name="reuse-off-by-one", file="block_pool.py",
           original="        if not self._fenced or fence <= self._table.watermark:",
           replacement="        if not self._fenced or fence <= self._table.watermark + 1:",
           bug="rule 2: a freed block is reused while the step after the watermark may still touch it"),
    Mutant(name="reuse-without-watermark", file="block_pool.py",
           original="            if f <= w:",
           replacement="            if True:",
           bug="rule 2: park_many releases a freed block without waiting for the watermark"),
    Mutant(name="free-under-read", file="block_pool.py",
           original="            if readers[key] or writers[key]:",
           replacement="            if writers[key]:",
           bug="rule 5: blocks an outbound read is reading are freed when their request goes"),
    Mutant(name="abort-ignores-transfers", file="records.py",
           original="        busy = bool(rec.transfers) or any(map(readers.__getitem__, keys)) or any(map(writers.__getitem__, keys))",
           replacement="        busy = False",
           bug="rule 5: an aborted request's blocks are freed while its transfer is in flight"),
    Mutant(name="release-ignores-others-transfers", file="records.py",
           original="        busy = bool(rec.transfers) or any(map(readers.__getitem__, keys)) or any(map(writers.__getitem__, keys))",
           replacement="        busy = bool(rec.transfers)",
           bug="rules 5, 7: the last holder's release frees a shared block another holder's export still reads"),
    Mutant(name="share-under-write", file="steps.py",
           original="        if self._fenced and self._table.writers[key]:",
           replacement="        if False:",
           bug="rules 5, 7: a block an import writes gets a second holder, whose release frees it under the write"),
    Mutant(name="quarantine-ends-before-watermark", file="block_pool.py",
           original="                if f <= w:",
           replacement="                if True:",
           bug="rule 2, 5: a quarantined block is released when its transfer ends though a step may still touch it"),
    Mutant(name="give-up-under-write", file="steps.py",
           original="        if self._fenced and rec.transfers:",
           replacement="        if False:",
           bug="rule 5: a request recomputes (gives its import up) while an inbound write into its blocks runs"),
    # Issue 47 item 6: the ledger and the quarantine paths, by family. (1) a quarantined block released before
    # its transfer is terminal or before the watermark passes its fence (also quarantine-ends-before-watermark)
    Mutant(name="quarantine-ends-at-first-transfer", file="block_pool.py",
           original="            if key in q and not readers[key] and not writers[key]:",
           replacement="            if key in q:",
           bug="rule 5: a quarantined block is released when one of its transfers ends while another still runs"),
    Mutant(name="ledger-lands-on-first-writer", file="imports.py",
           original="            if len(seen) >= e.writers:",
           replacement="            if seen:",
           bug="rule 5 per writer: a component's transfer ends at its first writer's LANDED, another still writes"),
    Mutant(name="ledger-first-drained-ends", file="imports.py",
           original="        if e.state is ImportState.OPEN and len(e.drained) >= e.writers:",
           replacement="        if e.state is ImportState.OPEN and e.drained:",
           bug="rule 5 per writer: an import ends at its first writer's DRAINED while another writer may write"),
    Mutant(name="ledger-failed-is-drained", file="imports.py",
           original="            e.failed.setdefault(writer, reason)",
           replacement="            e.drained.add(writer)",
           bug="rule 5: a writer's Failed counts as drained (a terminal status read as 'nothing in flight')"),
    Mutant(name="ledger-deadline-now", file="imports.py",
           original="            e.deadline = self.clock() + self.drain_timeout_s",
           replacement="            e.deadline = self.clock()",
           bug="rule 5: a failed import's drain deadline is its failure: its blocks settle while a writer writes"),
    # (2) a quarantined block a prefix hit takes back (unpark), then freed by its old transfer's end or entry
    Mutant(name="unpark-stays-quarantined", file="block_pool.py",
           original="            self._quarantine.discard(key)  # no heap occurrence while quarantined",
           replacement="            pass",
           bug="rule 7: a quarantined block a prefix hit took back is freed, held, when its old transfer ends"),
    Mutant(name="unpark-keeps-heap-entry", file="block_pool.py",
           original="            self._stale[key] = self._stale.get(key, 0) + 1",
           replacement="            pass",
           bug="rule 7: a parked block a prefix hit took back is freed, held, by its old entry at the watermark"),
    # (3) a dead incarnation's landing counted for the next request of the same id
    Mutant(name="dead-incarnation-lands", file="transfers.py",
           original="        rec = None if tr.orphaned else self._requests.get(tr.request)",
           replacement="        rec = self._requests.get(tr.request)",
           bug="rule 4: a transfer of a request that died lands for the next request of the same id"),
    Mutant(name="drop-keeps-transfers", file="records.py",
           original="                transfers[tid].orphaned = True",
           replacement="                pass",
           bug="rule 4: a dropped request's transfers stay its id's: their end counts for its next incarnation"),
    Mutant(name="ledger-ignores-generation", file="imports.py",
           original="        if e is None or (generation is not None and generation != e.generation):",
           replacement="        if e is None:",
           bug="rule 5: a writer's message of a dead generation counts for the import now under its key"),
    # (4) a release that ignores the fence of a block settled later
    Mutant(name="drop-assumes-one-fence", file="records.py",
           original="                uniform = False",
           replacement="                pass",
           bug="rule 2: a request's blocks are released at its own fence though one is fenced later (zeroing)"),
    Mutant(name="hold-release-forgets-residency", file="fence.py",
           original="            self.fence[key] = hs",
           replacement="            pass",
           bug="rules 2, 7: a holder's release leaves its residency out of the block's fence"),
    Mutant(name="park-joins-earlier-entry", file="block_pool.py",
           original="        if tail is not None and tail[0] == fence:",
           replacement="        if tail is not None and tail[0] <= fence:",
           bug="rule 2: blocks fenced later join the last heap entry, released at its earlier fence"),
    Mutant(name="quarantine-exit-joins-earlier-entry", file="block_pool.py",
           original="                    if tail is not None and tail[0] == f:",
           replacement="                    if tail is not None and tail[0] <= f:",
           bug="rules 2, 5: a block leaving quarantine joins an entry of an earlier fence, released before it settles"),
    # (5) a recompute (give-up) allowed while an inbound write still runs (also give-up-under-write)
    Mutant(name="give-up-once-failed", file="steps.py",
           original="        if self._fenced and rec.transfers:",
           replacement="        if self._fenced and rec.transfers and rec.phase is not _FAILED:",
           bug="rule 5: a failed import gives up (recompute) while another component's write still runs"),
    Mutant(name="ledger-failure-settles", file="imports.py",
           original="        return self.fail(key, reason)",
           replacement="        return self.settle(key, reason)",
           bug="rule 5: a writer's Failed ends the import at once; the request recomputes while that writer writes"),
    Mutant(name="finish-closes-at-watermark", file="steps.py",
           original="            rec.last_step = self._table.scheduled",
           replacement="            rec.last_step = self._table.watermark", within="request_finished",
           bug="rule 2: a finished request's residency ends at the watermark, not the last scheduled step"),
    Mutant(name="abort-export-frees", file="steps.py",
           original="        if self._fenced and rec.phase is _EXPORTING and self._leases.deadline(request) is not None:",
           replacement="        if self._fenced and rec.phase is _EXPORTING and rec.abandoned:",
           bug="rules 5, 6: an aborted export is freed at once though a pulling consumer may still read it"),
    Mutant(name="zeroing-only-while-writing", file="steps.py",
           original="                    if k in imported or writers[k]:",
           replacement="                    if writers[k]:",
           bug="rule 3 (Race B): a zeroing scheduled after an import landed runs over the received bytes"),
    Mutant(name="import-under-pending-step", file="transfers.py",
           original="                    if fence[k] > w:",
           replacement="                    if fence[k] > w + 1:",
           bug="rule 3: an import is posted into a block the next pending step still touches"),
    Mutant(name="import-ignores-duration", file="transfers.py",
           original="            if lease_deadline is not None and self._clock() + expected_s > lease_deadline:",
           replacement="            if lease_deadline is not None and self._clock() > lease_deadline:",
           bug="rule 6: an import starts a read that cannot finish inside the lease"),
    Mutant(name="export-before-settled", file="transfers.py",
           original="                    if hs > w:",
           replacement="                    if hs > w + 1:",
           bug="rule 1: an export reads blocks a pending step of its request still writes"),
    Mutant(name="ready-after-first-component", file="transfers.py",
           original="            if not self._fenced or rec.arrived >= rec.expected:",
           replacement="            if not self._fenced or rec.arrived:",
           bug="rule 4 (SGLang #39846): a request is ready after its first component"),
    Mutant(name="late-grace", file="transfers.py",
           original="        if ok and self._fenced and tr.deadline is not None and self._clock() > tr.deadline:",
           replacement="        if ok and self._fenced and tr.deadline is not None and self._clock() > tr.deadline + 1.0:",
           bug="rule 6: bytes that landed after the lease are trusted (a grace period)"),
    Mutant(name="heartbeat-renews-abandoned", file="transfers.py",
           original="        if rec is None or rec.phase is not _EXPORTING or rec.abandoned:",
           replacement="        if rec is None or rec.phase is not _EXPORTING:",
           bug="rule 6: an aborted export's lease is renewed, so it is never released"),
    Mutant(name="lease-expires-late", file="lease.py",
           original="        while heap and heap[0][0] < now:",
           replacement="        while heap and heap[0][0] < now - self.duration_s:",
           bug="rule 6: a lapsed lease is expired a whole lease late"),
    Mutant(name="lease-renewed-after-lapse", file="lease.py",
           original="        if old is None or now > old:",
           replacement="        if old is None:",
           bug="rule 6: a heartbeat revives a lapsed lease, so a lease never expires while renewed late"),
    Mutant(name="export-fits-ignores-duration", file="lease.py",
           original="        return d is not None and self._clock() + duration_s <= d",
           replacement="        return d is not None and self._clock() <= d",
           bug="rule 6: an export starts a read that cannot finish inside the lease"),
    # Issue 49: the staging slots (transport/staging.py, their use in exports.py, delivery.py, fetch.py and
    # import_staging.py), a fenced resource with the rules of an exported block; the staging machine
    # (test_staging_machine.py) must catch each.
    Mutant(name="slot-back-at-export-sent", file="delivery.py", package=TRANSPORT,
           original="        if not pool.config.fence:",
           replacement="        if True:",
           bug="rule 5: a producer slot goes back once packed, while its reader has yet to read it"),
    Mutant(name="slot-back-at-first-reader", file="exports.py", package=TRANSPORT,
           original="        rec.ended.setdefault(agent, (ok, detail))",
           replacement="        rec.ended.setdefault(agent, (ok, detail)); self._staging.release(rec, now=True)",
           bug="rules 5, 7: every reader's slot goes back at the first reader's Done while another reads"),
    Mutant(name="slot-back-when-reader-lost", file="exports.py", package=TRANSPORT,
           original="        self._staging.release(rec, now=freed)",
           replacement="        self._staging.release(rec, now=True)",
           bug="rules 5, 6: a lost reader's slot goes back at once, though it may read until the lease lapses"),
    Mutant(name="slot-hold-frees-at-once", file="staging.py", package=TRANSPORT,
           original="        self._held.append((until, slot))",
           replacement="        self.give_back(slot)",
           bug="rule 6: a slot held for a reader that may still read goes back without waiting for the lease"),
    Mutant(name="slot-hold-ignores-deadline", file="staging.py", package=TRANSPORT,
           original="            if now >= until:",
           replacement="            if True:",
           bug="rule 6: a held slot goes back at the pump's next tick, before the lease lapses"),
    Mutant(name="slot-take-marks-one-unit", file="staging.py", package=TRANSPORT,
           original="        self._used[first:first + units] = True",
           replacement="        self._used[first] = True",
           bug="a slot of several units marks only its first: the next slot overlaps it"),
    Mutant(name="consumer-slot-back-at-post", file="import_staging.py", package=TRANSPORT,
           original="        return dataclasses.replace(w, plan=plan, slot=slot)",
           replacement="        pool.give_back(slot); return dataclasses.replace(w, plan=plan, slot=slot)",
           bug="rule 5: a consumer slot goes back when its READ is posted, while the READ writes it"),
    Mutant(name="consumer-slot-back-before-read-ends", file="fetch.py", package=TRANSPORT,
           original="            if id(x) in held:",
           replacement="            if False:",
           bug="rule 5: a READ NIXL would not abort loses its consumer slot (and its ledger entry) before it ends"),
)


class MutantNotFound(RuntimeError):
    pass


def apply(mutant: Mutant, root: Path) -> None:
    """Replace the mutant's line in the copy at ``root``; MutantNotFound unless it is there exactly once."""
    path = root / mutant.package / mutant.file
    lines = path.read_text().split("\n")
    hits = _find(mutant, lines)
    where = f"{mutant.package}/{mutant.file}" + (f", function {mutant.within}" if mutant.within else "")
    if len(hits) != 1:
        raise MutantNotFound(
            f"mutant {mutant.name}: the line {mutant.original!r} occurs {len(hits)} times in {where}; "
            "expected exactly once (the code changed: update the mutant in tests/property/mutate.py)")
    lines[hits[0]] = mutant.replacement
    path.write_text("\n".join(lines))


def _find(mutant: Mutant, lines: list[str]) -> list[int]:
    span = range(len(lines))
    if mutant.within is not None:
        defs = [i for i, line in enumerate(lines) if line.lstrip().startswith(f"def {mutant.within}(")]
        if len(defs) != 1:
            return []
        start = defs[0]
        indent = lines[start][: len(lines[start]) - len(lines[start].lstrip())]
        end = next((i for i in range(start + 1, len(lines))
                    if lines[i].startswith(indent) and lines[i][len(indent):].startswith(("def ", "class ", "@"))),
                   len(lines))
        span = range(start, end)
    return [i for i in span if lines[i] == mutant.original]


def _copy(dst: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", "*.pyc")
    shutil.copytree(ROOT / "hybridkv", dst / "hybridkv", ignore=ignore)
    (dst / "tests").mkdir()
    shutil.copy2(ROOT / "tests" / "__init__.py", dst / "tests" / "__init__.py")
    shutil.copytree(ROOT / "tests" / "property", dst / "tests" / "property", ignore=ignore)


def run_suite(root: Path, *, examples: int, seed: int, machine: bool, timeout_s: float,
              corpus: bool = True) -> tuple[int, str]:
    """The property tests on the copy at ``root``, in a fresh interpreter (see :func:`_child`);
    (exit status: 0 passed, 1 failed, else broken; its output)."""
    env = {**os.environ, "PYTHONPATH": str(root), "HYBRIDKV_PROPERTY_SEED": str(seed),
           "HYBRIDKV_PROPERTY_EXAMPLES": str(examples), "HYBRIDKV_PROPERTY_CORPUS": "1" if corpus else "0",
           "HYBRIDKV_PROPERTY_SHRINK": "0"}
    cmd = [sys.executable, "-m", "tests.property.mutate", "--child"] + (["--machine"] if machine else [])
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout_s)
    return proc.returncode, proc.stdout + proc.stderr


def _child(machine: bool) -> int:
    """Run the property tests here, stopping at the first failure. Not pytest: its start-up (and the
    suite's conftest, which imports torch to look for a GPU) cost more than the corpus itself."""
    from hypothesis import core, settings

    import hybridkv

    if not Path(hybridkv.__file__).resolve().is_relative_to(Path.cwd().resolve()):
        print(f"hybridkv imported from {hybridkv.__file__}, not the mutated copy {Path.cwd()}")
        return 3
    settings.register_profile("mutate", deadline=None, database=None, derandomize=False, print_blob=False)
    settings.load_profile("mutate")
    core.global_force_seed = int(os.environ["HYBRIDKV_PROPERTY_SEED"])
    from hybridkv.fencing.fence import FencePolicy
    from tests.property import test_rules

    from tests.property import test_fencing_corpus, test_fencing_machine

    def staging():  # imported only when reached (the transport's modules): a fencing mutant stops before
        from tests.property import test_staging_machine
        return test_staging_machine

    # The machine's fixed corpus first (a second or two in all), then the rule tests, the staging corpus and
    # machine (a few seconds), then the random two-sided machine.
    corpus = os.environ.get("HYBRIDKV_PROPERTY_CORPUS", "1") != "0"
    tests = []
    if corpus:
        tests += [(f"test_fencing_corpus[{n}]", lambda n=n: test_fencing_corpus.replay(n))
                  for n in sorted(test_fencing_corpus.CORPUS)]
    tests += [(n, lambda f=f: f(policy=FencePolicy.FENCED)) for n, f in sorted(vars(test_rules).items())
              if n.startswith("test_rule")]
    if corpus:
        tests.append(("test_staging_corpus", lambda: [staging().replay(n) for n in sorted(staging().CORPUS)]))
    if os.environ.get("HYBRIDKV_PROPERTY_EXAMPLES") != "0":
        tests.append(("test_staging_slots", lambda: staging().test_staging_slots("fenced")))
    if machine:
        tests.append(("test_fencing_two_sides", lambda: test_fencing_machine.test_fencing_two_sides("fenced")))
    for name, run in tests:
        try:
            run()
        except Exception as exc:  # the first failing test is enough
            while isinstance(exc, BaseExceptionGroup):  # several explicit examples failed: the first
                exc = exc.exceptions[0]
            print(f"{name} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return 1
    print(f"{len(tests)} property tests passed")
    return 0


def _first_failure(out: str) -> str:
    lines = [line for line in out.splitlines() if " failed: " in line]
    return (lines or out.strip().splitlines() or ["(no output)"])[-1][:220]


def check(mutants, *, examples: int, seed: int, machine: bool, corpus: bool = True, timeout_s: float = 600.0,
          log=print) -> dict:
    """Run the suite on the original and on each mutant; returns {name: 'caught'|'survived'}.
    Raises MutantNotFound before running anything if a mutant's line is missing, RuntimeError if the
    original fails or a run ends in something other than passed/failed."""
    results: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="hybridkv-mutate-") as tmp:
        base = Path(tmp) / "original"
        _copy(base)
        for m in mutants:  # every line found before minutes are spent
            if len(_find(m, (base / m.package / m.file).read_text().split("\n"))) != 1:
                apply(m, base)  # raises, naming the mutant
        t0 = time.perf_counter()
        rc, out = run_suite(base, examples=examples, seed=seed, machine=machine, timeout_s=timeout_s, corpus=corpus)
        if rc != 0:
            raise RuntimeError(f"the unmutated suite did not pass (exit {rc}): nothing to conclude\n{out[-3000:]}")
        log(f"original: passed in {time.perf_counter() - t0:.1f} s")
        for m in mutants:
            root = Path(tmp) / m.name
            _copy(root)
            apply(m, root)
            t0 = time.perf_counter()
            rc, out = run_suite(root, examples=examples, seed=seed, machine=machine, timeout_s=timeout_s, corpus=corpus)
            if rc not in (0, 1):
                raise RuntimeError(f"mutant {m.name}: pytest exited {rc} (neither passed nor failed)\n{out[-3000:]}")
            results[m.name] = "caught" if rc == 1 else "survived"
            why = _first_failure(out) if rc == 1 else "the suite passed"
            log(f"{m.name:30s} {results[m.name]:8s} {time.perf_counter() - t0:5.1f} s  {m.file}: {m.bug}\n"
                f"{'':30s} -> {why}")
            shutil.rmtree(root)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.property.mutate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000,
                    help="HYBRIDKV_PROPERTY_EXAMPLES for each run (the rule tests take a tenth each; default 2000)")
    ap.add_argument("--corpus-only", action="store_true", help="only the fixed @example corpus (no generated examples)")
    ap.add_argument("--generated-only", action="store_true",
                    help="leave the @example corpus out: does the random search alone find each bug?")
    ap.add_argument("--machine", action="store_true", help="also run the two-sided state machine")
    ap.add_argument("--seed", type=int, default=26, help="HYBRIDKV_PROPERTY_SEED (default 26: reproducible)")
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these mutants only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.machine)
    mutants = MUTANTS
    if args.only:
        known = {m.name: m for m in MUTANTS}
        bad = [n for n in args.only if n not in known]
        if bad:
            ap.error(f"unknown mutant {bad[0]!r}; expected one of {', '.join(known)}")
        mutants = tuple(known[n] for n in args.only)
    if args.corpus_only and args.generated_only:
        ap.error("--corpus-only and --generated-only leave nothing to run")
    examples = 0 if args.corpus_only else args.examples
    t0 = time.perf_counter()
    try:
        results = check(mutants, examples=examples, seed=args.seed, machine=args.machine,
                        corpus=not args.generated_only)
    except (MutantNotFound, RuntimeError) as exc:
        print(f"mutate: error: {exc}", file=sys.stderr)
        return 2
    survived = [n for n, r in results.items() if r == "survived"]
    print(f"{len(results) - len(survived)} of {len(results)} mutants caught in {time.perf_counter() - t0:.0f} s "
          f"({'corpus only' if args.corpus_only else f'{examples} examples'}"
          f"{', no corpus' if args.generated_only else ''}, seed {args.seed}"
          f"{', with the state machine' if args.machine else ''})"
          + (f"; SURVIVED: {', '.join(survived)}" if survived else ""))
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
