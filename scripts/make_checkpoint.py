"""Write a llama_serve preset's model (its exact random seeded weights) as a Hugging Face checkpoint folder
with a tokenizer and a chat template, for transformers, vLLM or llama.cpp to serve as text
(`evo.workloads.llama_serve.checkpoint`), and print the `hf:` preset that reads it back.

    .venv/bin/python scripts/make_checkpoint.py --preset cpu --out runs/checkpoints/cpu

Engines read the folder as user nobody with a private /tmp: keep it outside /tmp and /var/tmp.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from evo.workloads.llama_serve.presets import PRESETS  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", required=True, help=f"a llama_serve preset: {', '.join(PRESETS)}")
    parser.add_argument("--out", required=True, type=Path, help="the folder to write (created if missing)")
    parser.add_argument("--no-tokenizer", action="store_true", help="the model only (token ids in, token ids out)")
    args = parser.parse_args(argv)
    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset!r} is not a llama_serve preset; available: {', '.join(PRESETS)} "
                     f"(an hf: preset is already a checkpoint)")
    out = args.out.expanduser().resolve()
    if out.exists() and not out.is_dir():
        parser.error(f"--out {str(out)!r} exists and is not a folder")
    if out.is_dir() and any(p.name not in _OURS for p in out.iterdir()):
        parser.error(f"--out {str(out)!r} holds files other than a checkpoint's {sorted(_OURS)}: pick an empty folder")
    from evo.workloads.llama_serve.checkpoint import write_checkpoint

    preset = PRESETS[args.preset]
    folder = write_checkpoint(preset, out, tokenizer=not args.no_tokenizer)
    R, P, N = (preset.shape[k] for k in ("R", "P", "N"))
    print(f"wrote {folder}")
    print(f"preset: hf:{folder},R={R},P={P},N={N},count={preset.trace.count},dtype={preset.dtype},"
          f"device={preset.device}")
    if any(str(folder).startswith(p) for p in ("/tmp/", "/var/tmp/")):
        print("note: engines in the strict sandbox cannot read a folder under /tmp or /var/tmp", file=sys.stderr)
    return 0


_OURS = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}

if __name__ == "__main__":
    sys.exit(main())
