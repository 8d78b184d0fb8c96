"""Write a run's (or a sweep's) ``explorer.html``: one self-contained page with one step slider
(:mod:`reports.explorer_page`), every head's attention pattern on one probe sequence computed from the
trajectory's weights (with the run's interventions on where they were, as it trained). The command;
the writers are :mod:`analysis.explorer_pages`, imported once the path is known to hold a run.

    python -m analysis.explorer RUN_DIR                 # RUN_DIR/explorer.html
    python -m analysis.explorer SWEEP_DIR               # each member's page, then SWEEP_DIR/explorer.html
    python -m analysis.explorer RUN_DIR --out page.html

A run writes its page at its end too (``explorer=false`` turns that off). A run without a trajectory or
a tensor store still gets a page: each view it cannot draw says why.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from records.layout import DamagedFile, holds_a_run, job_dirs
from records.outputs import WRITTEN_BY, foreign_out
from records.status import read_status

PAGE_MARK = f'<meta name="generator" content="{WRITTEN_BY} explorer">'
"""What every page has in its head (reports/explorer_assets/page.html): an --out holding it is a page."""


def runs_under(path: Path) -> tuple[list[Path], bool]:
    """The run directories ``path`` holds and whether it is a sweep: ``([path], False)`` for a run,
    ``(its numbered jobs, True)`` for a sweep (whose own directory holds W&B's sweep report run, so
    run files alone do not make a run), ``([], False)`` for neither."""
    if not path.is_dir():
        return [], False
    found = job_dirs([path])
    if found and found != [path]:
        return found, True
    return ([path], False) if found or holds_a_run(path) else ([], False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a run directory, or a sweep directory (its members' pages too)")
    parser.add_argument("--out", type=Path, default=None, help="the page's path (default: PATH/explorer.html)")
    args = parser.parse_args(argv)
    path = args.path
    runs, sweep = runs_under(path)
    if not runs:
        print(
            f"error: {path} is not a train.py run directory nor a sweep of them (no .hydra/, csv/, tensors/,"
            " trajectory/ or numbered job directories)",
            file=sys.stderr,
        )
        return 2
    if args.out is not None and (why := foreign_out(args.out, PAGE_MARK)):
        print(f"error: {why}", file=sys.stderr)
        return 2
    # torch and the report's modules (3.6 s of a refusal before) only once the request is good
    from analysis.explorer_pages import write_run_page, write_sweep_page
    from reports.explorer_page import ExplorerError

    try:
        if not sweep:
            page, size, seconds = write_run_page(path, args.out)
            print(f"explorer: wrote {page} ({size / 1e6:.1f} MB, {seconds:.1f} s)")
            return 0
        for n, member in enumerate(runs, start=1):
            status = (read_status(member) or {}).get("status", "unknown")
            page, size, seconds = write_run_page(member)
            print(f"explorer: [{n}/{len(runs)}] wrote {page} ({size / 1e6:.1f} MB, {seconds:.1f} s; run {status})")
        page, size, seconds = write_sweep_page(path, runs, args.out)
        print(f"explorer: wrote {page} ({size / 1e6:.1f} MB, {seconds:.1f} s): the sweep's {len(runs)} runs")
    except (ExplorerError, DamagedFile) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
