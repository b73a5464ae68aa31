"""``polyengine pull NAME`` and ``polyengine models``: the Hugging Face cache from the
command line.

``pull`` fetches what ``--model NAME`` would load (the same resolution,
:func:`polyengine.models.hub.resolve`) and prints its local path on stdout, so that
``$(polyengine pull ORG/NAME:Q8_0)`` is a file any tool can read. ``models`` lists the
cached model revisions (huggingface_hub's cache scan, no network) with the names that
load them. Both register through the ``polyengine.commands`` entry-point group, like the
commands outside the core, and need the ``hub`` extra only when they run.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from polyengine.errors import InvalidRequest

__all__ = ["add_pull", "add_models"]


def add_pull(sub: Any) -> None:
    p = sub.add_parser(
        "pull", help="download a model from the Hugging Face Hub into its cache and print its local path",
        description="Download ORG/NAME[@REVISION][:QUANT|:FILE.gguf] into the Hugging Face cache (HF_HOME, "
                    "HF_HUB_CACHE) and print the local path. HF_TOKEN authenticates, HF_ENDPOINT picks the hub, "
                    "HF_HUB_OFFLINE=1 only checks the cache. Needs polyengine[hub]; docs/models.md.")
    p.add_argument("name", help="ORG/NAME (safetensors), ORG/NAME:Q4_K_M or ORG/NAME:FILE.gguf (GGUF), "
                                "with @REVISION after NAME to pin a branch, tag or commit")
    p.add_argument("-q", "--quiet", action="store_true", help="no download progress bars")
    p.set_defaults(func=_cmd_pull)


def add_models(sub: Any) -> None:
    p = sub.add_parser("models", help="list the models in the Hugging Face cache (what `pull` and --model fetched)")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=_cmd_models, clean_json=True)


def _cmd_pull(args: argparse.Namespace) -> int:
    from polyengine.models.hub import parse_hub_name, resolve

    name = parse_hub_name(args.name)
    if name is None:
        raise InvalidRequest(f"{args.name!r} is not a Hugging Face name: expected ORG/NAME, ORG/NAME:QUANT, "
                             f"ORG/NAME:FILE.gguf or ORG/NAME@REVISION (local files need no pull)")
    print(resolve(name, progress=not args.quiet))
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from polyengine.memory import gib
    from polyengine.models.hub import cached_models

    rows = list(cached_models())
    if args.json:
        json.dump(rows, args.out, indent=2)
        args.out.write("\n")
        return 0
    if not rows:
        print("no models in the Hugging Face cache yet (`polyengine pull ORG/NAME` fetches one)", file=sys.stderr)
        return 0
    table = [(r["repo"], ",".join(r["refs"]) or r["commit"][:12], r["format"],
              gib(r["size_bytes"]), " ".join(r["names"]) or "(no loadable files)") for r in rows]
    headers = ("repo", "revision", "format", "size", "load with --model")
    widths = [max(len(h), *(len(row[i]) for row in table)) for i, h in enumerate(headers[:-1])]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)) + "  " + headers[-1])
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return 0
