"""CLI: convert weights into a flexgen_h2o store.

    python -m flexgen_h2o.convert SRC [--model NAME] [--out DIR] [--dummy] [--quiet]

SRC is a local HF folder (safetensors or pytorch_model*.bin), a .gguf/.safetensors/.bin file, an HF id or
preset name (downloaded from the Hub), or `smollm2-135m` (the embedded model). With --dummy, SRC names a model
and a deterministic dummy store of its shapes is written. Errors print one `error: ...` line and exit 2.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from flexgen_h2o.models import ModelConfig, ModelNameError, resolve_model
from flexgen_h2o.weights import (EMBEDDED_MODEL, WeightStoreError, convert_checkpoint, download_and_convert,
                                 ensure_embedded_store, write_dummy_store)

_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".pt", ".pth")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # one line, like every other error of this command (argparse would print the usage first)
        self.exit(2, f"error: {message}\n")


def _fail(msg: str) -> NoReturn:
    print("error: " + " ".join(str(msg).split()), file=sys.stderr)
    sys.exit(2)


def _convert(src: str, model: str | None, out: Path | None, dummy: bool, progress: bool) -> Path:
    cfg: ModelConfig | None = resolve_model(model) if model else None
    if dummy:
        return write_dummy_store(cfg or resolve_model(src), out, progress=progress)
    if src == EMBEDDED_MODEL and (model is None or model == EMBEDDED_MODEL):
        return ensure_embedded_store(out, progress=progress)
    path = Path(src).expanduser()
    if path.exists():
        return convert_checkpoint(path, cfg, out, progress=progress)
    if src.startswith((".", "/", "~")) or src.lower().endswith(_FILE_SUFFIXES):
        raise WeightStoreError(f"checkpoint not found: {src}")
    if "/" not in src:   # a bare name must be a preset; its HF id says where to download it from
        preset = resolve_model(src)
        cfg = cfg or preset
        src = preset.hf_id or src
    return download_and_convert(src, out, cfg=cfg, progress=progress)


def main(argv: Sequence[str] | None = None) -> int:
    parser = _Parser(prog="python -m flexgen_h2o.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", metavar="SRC", help="HF folder, .gguf file, HF id, preset, or smollm2-135m")
    parser.add_argument("--model", metavar="NAME", help="preset or HF id whose shapes to use and store name "
                        "(default: read from the checkpoint)")
    parser.add_argument("--out", metavar="DIR", type=Path, help="store folder (default: "
                        "$FLEXGEN_H2O_HOME or ~/.cache/flexgen_h2o, then the model name)")
    parser.add_argument("--dummy", action="store_true", help="write deterministic dummy weights for SRC's shapes")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    try:
        store = _convert(args.src, args.model, args.out, args.dummy, not args.quiet)
    except (WeightStoreError, ModelNameError, OSError, ValueError) as e:
        _fail(str(e) or type(e).__name__)
    except KeyboardInterrupt:
        _fail("interrupted; no store was written")
    print(store)
    return 0


if __name__ == "__main__":
    sys.exit(main())
