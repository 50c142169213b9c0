"""``axtorch-tokenize``: tokenize a corpus once into memory-mappable token shards, for any number of runs.

    axtorch-tokenize data=text_files 'data.source.paths=["~/corpus/**/*.txt"]' out=~/corpus-tokens
    axtorch-train data=tokenized data.source.path=~/corpus-tokens

The data overrides are ``axtorch-train``'s (source, tokenizer, ``val_fraction``, ``seed``); a
tokenizer is trained as training would train it unless ``data.tokenizer.path`` names one. Options:
``out=`` (required, a new or empty directory), ``workers=`` (processes that encode, default the
CPU count) and ``shard_tokens=`` (tokens per shard, default 2**28). Memory stays that of a few
batches of documents, whatever the corpus size (``axtorch.data.shards``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from axtorch.compose.experiment import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.data.packing import validate_data_config
from axtorch.data.shards import MANIFEST_FILE, write_shards
from axtorch.data.tokenizer import load_or_train_tokenizer

_OPTIONS = ("out", "workers", "shard_tokens")


def _positive(key: str, value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(key, value, "a positive integer")
    return int(value)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        return 0
    options = {arg.partition("=")[0]: arg.partition("=")[2] for arg in argv if arg.partition("=")[0] in _OPTIONS}
    overrides = [arg for arg in argv if arg.partition("=")[0] not in _OPTIONS]
    try:
        if not options.get("out"):
            raise ConfigError("out", None, "the directory to write the token shards to")
        out = Path(options["out"]).expanduser()
        if out.exists() and any(out.iterdir()):
            raise ConfigError("out", str(out), "a new or empty directory", reason="it holds files already")
        workers = _positive("workers", options.get("workers", str(os.cpu_count() or 1)))
        shard_tokens = _positive("shard_tokens", options.get("shard_tokens", str(1 << 28)))
        data = load_experiment_config(overrides).data
        validate_data_config(data)
        if data.source is None:
            raise ConfigError("data.mixture", "(set)", "one data.source: axtorch-tokenize writes one corpus")
        source = data.source.build()
        out.mkdir(parents=True, exist_ok=True)
        tokenizer = load_or_train_tokenizer(data.tokenizer, source, out)
        manifest = write_shards(
            source,
            tokenizer,
            out,
            val_fraction=data.val_fraction,
            seed=data.seed,
            workers=workers,
            shard_tokens=shard_tokens,
        )
    except ConfigError as error:
        print(f"axtorch-tokenize: {error}", file=sys.stderr)
        return 2
    counts = {split: sum(shard["tokens"] for shard in shards) for split, shards in manifest["splits"].items()}
    print(
        f"tokenized {manifest['documents']:,} documents: {counts['train']:,} training and {counts['val']:,} "
        f"held-out tokens ({manifest['dtype']}) in {out} ({MANIFEST_FILE}); "
        f"train with: axtorch-train data=tokenized data.source.path={out}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
