"""Write each decoder fuzz target's seed inputs under tests/fuzz/corpus/<target>/.

Run after changing a wire format or `bench/decoder_targets.py`'s seeds, and commit the
result: `swarmpipe bench fuzz-decoders` and tests/fuzz start from these files. Inputs a
fuzz found that once crashed a decoder are kept beside them (named `regression-*`) and are
not touched here.
"""

from __future__ import annotations

from pathlib import Path

from swarmpipe.bench.decoder_seeds import seed_inputs
from swarmpipe.bench.decoder_targets import TARGETS, input_hash

ROOT = Path(__file__).resolve().parent.parent / "tests" / "fuzz" / "corpus"


def main() -> None:
    for name in TARGETS:
        folder = ROOT / name
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("seed-*"):
            old.unlink()
        seeds = seed_inputs(name)
        for data in seeds:
            (folder / f"seed-{input_hash(data)[:16]}").write_bytes(data)
        print(f"{name}: {len(seeds)} seeds")


if __name__ == "__main__":
    main()
