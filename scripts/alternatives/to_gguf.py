"""Convert a transformers `save_pretrained` checkpoint folder to one GGUF file for llama.cpp, offline,
with the converter shipped inside llama-cpp-python's source package (set up by setup_llamacpp.sh).

    /work/alt/llamacpp/bin/python scripts/alternatives/to_gguf.py CHECKPOINT_DIR --out model.gguf [--outtype f32]

Run it with the llama.cpp venv's Python (it needs torch, transformers, sentencepiece and gguf-py), never
the project's .venv. The converter names a BPE tokenizer's pre-tokenizer by hashing how it splits a test
string, and refuses hashes it does not know ("BPE pre-tokenizer was not recognized"). A home-made
byte-level BPE (scripts/make_checkpoint.py trains one with `tokenizers`) splits as GPT-2 does, so an
unrecognised hash is declared "gpt-2" here, and the line saying so is printed.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ALT_DIR = Path(os.environ.get("ALT_DIR", "/work/alt"))


def find_converter(given: str | None) -> Path:
    """convert_hf_to_gguf.py: --converter, else the path setup_llamacpp.sh recorded, else under ALT_DIR."""
    candidates = [Path(given)] if given else []
    recorded = ALT_DIR / "llamacpp.converter"
    if recorded.exists():
        candidates.append(Path(recorded.read_text().strip()))
    candidates += sorted(ALT_DIR.glob("llamacpp-src/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    for path in candidates:
        if path.is_file():
            return path
    sys.exit(f"error: convert_hf_to_gguf.py not found (looked at {[str(c) for c in candidates] or str(ALT_DIR)}); "
             "run scripts/alternatives/setup_llamacpp.sh or pass --converter PATH")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a save_pretrained folder with config.json, *.safetensors, tokenizer.json")
    parser.add_argument("--out", required=True, help="the GGUF file to write")
    parser.add_argument("--outtype", default="f32", choices=("f32", "f16", "bf16", "q8_0"), help="weight type")
    parser.add_argument("--converter", default=None, help="path of convert_hf_to_gguf.py (default: found under ALT_DIR)")
    args = parser.parse_args(argv)
    converter = find_converter(args.converter)
    sys.path.insert(0, str(converter.parent))
    import conversion.base as base  # the converter's own package, beside the script

    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:  # a hash the converter does not list: a home-made byte-level BPE
            print("to_gguf: BPE pre-tokenizer not recognised; declaring it 'gpt-2' (byte-level BPE)", flush=True)
            return "gpt-2"

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    import convert_hf_to_gguf

    sys.argv = [str(converter), args.checkpoint, "--outfile", args.out, "--outtype", args.outtype]
    convert_hf_to_gguf.main()
    print(f"to_gguf: wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
