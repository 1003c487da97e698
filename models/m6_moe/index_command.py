"""``python -m m6_moe.index_command [--prune] MANIFEST [MANIFEST ...]``: builds (or checks) the
cached index of each JSON-lines manifest (:func:`m6_moe.manifest_index.ensure_index`) and prints
one line per manifest: its record count, bad lines and index directory. ``--prune`` also removes
the indexes of the manifests' older versions (:func:`~m6_moe.manifest_index.remove_other_indexes`);
run it only when no job that started before a manifest changed is still running.

A module of its own, which ``m6_moe/__init__.py`` does not import, so that ``python -m`` runs it
without runpy's warning about a module found in ``sys.modules`` after its package was imported.
"""

from __future__ import annotations

import argparse
import sys

from m6_moe.manifest_index import ManifestIndex, ensure_index, remove_other_indexes
from moetrain.logs import configure_console


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m m6_moe.index_command",
        description="Builds (or checks) the cached index of each JSON-lines manifest.",
    )
    parser.add_argument("manifests", nargs="+", help="manifest files")
    parser.add_argument("--fallback-dir", help="where indexes go when a manifest's directory is read-only")
    parser.add_argument(
        "--prune",
        action="store_true",
        help="also remove the indexes of the manifests' older versions (only when no running job uses them)",
    )
    args = parser.parse_args(argv)
    configure_console("INFO")  # the build's log line and progress bar (redrawn on a terminal) on stderr
    try:
        for manifest in args.manifests:
            directory = ensure_index(manifest, args.fallback_dir)
            index = ManifestIndex(manifest, directory)
            print(
                f"{manifest}: {index.records} records ({index.image_records} with an image), "
                f"{index.bad_lines} bad lines; index {directory}"
            )
            if args.prune:
                removed = remove_other_indexes(manifest, args.fallback_dir)
                print(f"{manifest}: removed {len(removed)} older index(es)")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
