"""``statekv reown``: record who owns a saved stream or a disk-tier file set anew, under this installation's secret
(`statekv.api.reown`)."""

from __future__ import annotations

import argparse

from ..errors import ConfigurationError
from ..settings.values import PATH, printable


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "reown", help="record who owns a saved stream or disk-tier folder, under this installation's secret",
        description="A stream's files record its owner as a digest keyed by the secret of the installation that "
                    "wrote them (installation.secret in statekv's cache folder, or $STATEKV_SECRET_FILE). A file brought from another "
                    "installation, kept after the secret was removed, or written by an earlier statekv is refused "
                    "for its owner here; if you trust it, re-own it. PATH is verified first: a saved file as loading "
                    "would (a damaged file is refused); a disk-tier folder's manifest, journal and carried state "
                    "(a damaged one, or one holding another stream's files, is refused; its cache's rows are "
                    "checked against their checksums when it is loaded). A disk-tier folder of format 2 is "
                    "verified as that format, then upgraded to format 4 (a damaged one is refused unchanged).",
    )
    parser.add_argument("path", metavar="PATH", type=PATH, help="a saved stream file, or a disk-tier stream's folder")
    parser.add_argument("--owner", default=None, metavar="NAME",
                        help="who owns it (a service's stream: the owner its record, streams/ID.json, names); "
                             "default: no owner")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from ..api.reown import reown

    if args.owner is not None and not args.owner.strip():
        raise ConfigurationError("--owner is empty: name who owns it, or leave --owner out for no owner")
    where = reown(args.path, args.owner)
    owner = repr(args.owner) if args.owner is not None else "no one"
    print(f"{printable(where)}: owned by {owner} on this installation")
    return 0
