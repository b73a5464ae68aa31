"""Throughput of polyengine backends and their peers: the script form of ``polyengine bench``.

    python bench/throughput.py [--backend B ...] [--model M] [--dtype D ...] [--options JSON ...]
                               [--peers transformers,llamacpp|none] [--repeats N] [--quick] [--json PATH]

Same arguments, same table, same JSON as ``polyengine bench`` (the workload, the
runners and the report live in ``polyengine.benchmarks``; docs/benchmarks.md says what
every column means). Run it on an idle machine: with two shared cores, anything else
running skews the numbers, and only ratios measured in one run compare.
"""

from __future__ import annotations

import sys

from polyengine.benchmarks.cli import main

if __name__ == "__main__":
    sys.exit(main())
