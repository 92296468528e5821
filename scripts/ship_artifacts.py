"""Copy trained artifacts into the package (``core/artifacts/NAME``) the way they ship.

    python scripts/ship_artifacts.py NAME --prepared DIR            # a `dynaspec prepare` folder
    python scripts/ship_artifacts.py NAME --drafter D --router R ... # or artifact folders one by one

Each artifact keeps its tensors bit for bit (the drafter is already bfloat16); in its provenance
(``drafter.json`` and the ``info`` metadata of the .safetensors files) every absolute path is cut to
its last component, so that no machine's folders ship: ``--work /work/runs/gen-train`` becomes
``--work gen-train``. With no artifact named, the artifacts already in the package are cleaned in place.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = {"drafter": ["drafter.json", "drafter.safetensors"], "frequency": ["frequency.safetensors"],
         "clusters": ["clusters.safetensors"], "router": ["router.safetensors"], "corpus": ["corpus.safetensors"]}
#: an absolute path (two components or more) not glued to a word before it, e.g. not "tokens/s"
ABSOLUTE = re.compile(r"(?<![\w.~-])/(?:[\w.+-]+/)+([\w.+-]+)")


def strip_paths(text: str) -> str:
    return ABSOLUTE.sub(r"\1", text)


def clean(path: Path) -> None:
    """Rewrite one shipped file's provenance without absolute paths (atomically); a file without
    any is left byte for byte as it is."""
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".json":
        text = path.read_text()
        if strip_paths(text) == text:
            return
        tmp.write_text(strip_paths(text))
    else:
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), framework="pt") as fh:
            original = fh.metadata() or {}
            metadata = {k: strip_paths(v) for k, v in original.items()}
            if metadata == original:
                return
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
        save_file(tensors, str(tmp), metadata=metadata or None)
    tmp.chmod(0o644)  # readable by everyone, as a package's data files are
    tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", help="the artifact name (a folder under core/artifacts)")
    parser.add_argument("--prepared", type=Path, help="a `dynaspec prepare` output folder")
    for kind in FILES:
        parser.add_argument(f"--{kind}", type=Path, help=f"a {kind} artifact folder")
    args = parser.parse_args(argv)
    dest = ROOT / "core" / "artifacts" / args.name
    sources = {kind: getattr(args, kind) or (args.prepared / kind if args.prepared else None) for kind in FILES}
    dest.mkdir(parents=True, exist_ok=True)
    for kind, folder in sources.items():
        if folder is None or (getattr(args, kind) is None and not folder.exists()):
            continue  # nothing named, or a prepared folder without this artifact (made before it existed)
        for name in FILES[kind]:
            if not (folder / name).is_file():
                raise SystemExit(f"no {name} in {folder}")
            shutil.copyfile(folder / name, dest / name)
    for path in sorted(dest.iterdir()):
        if path.suffix in (".json", ".safetensors"):
            clean(path)
            print(f"{path.relative_to(ROOT)}  {path.stat().st_size:,} bytes", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
