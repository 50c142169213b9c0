"""``axtorch-tokenize``: tokenize a corpus once into memory-mappable token shards, for any number of runs.

    axtorch-tokenize data=text_files 'data.source.paths=["~/corpus/**/*.txt"]' out=~/corpus-tokens
    axtorch-train data=tokenized data.source.path=~/corpus-tokens

The data overrides are ``axtorch-train``'s (source, tokenizer, ``val_fraction``, ``seed``); a
tokenizer is trained as training would train it unless ``data.tokenizer.path`` names one; ``out=``
is required. Memory stays that of a few batches of documents, whatever the corpus size
(``axtorch.data.shards``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from axtorch.cli.key_values import asks_for_help, format_help, parse_key_values, split_own_keys
from axtorch.cli.train import split_arguments
from axtorch.compose.experiment_loader import load_experiment_config
from axtorch.config.errors import ConfigError
from axtorch.data.corpus_tokenizer import load_or_train_tokenizer
from axtorch.data.packing import validate_data_config
from axtorch.data.shards import MANIFEST_FILE, write_shards


@dataclass
class TokenizeOptions:
    """The options of the tokenizing itself; the data settings are training's ``data.*`` overrides."""

    #: The directory to write the token shards to: new or empty.
    out: Optional[str] = None
    #: Processes that encode (default: the CPU count).
    workers: Optional[int] = None
    #: Tokens per shard.
    shard_tokens: int = 1 << 28

    def validate(self) -> None:
        if not self.out:
            raise ConfigError("out", None, "the directory to write the token shards to")
        out = Path(self.out).expanduser()
        if out.exists() and any(out.iterdir()):
            raise ConfigError("out", str(out), "a new or empty directory", reason="it holds files already")
        for key in ("workers", "shard_tokens"):
            if (value := getattr(self, key)) is not None and value < 1:
                raise ConfigError(key, value, "a positive integer")


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if asks_for_help(argv):
        print(
            format_help(
                "axtorch-tokenize", __doc__ or "", TokenizeOptions, "[--config-dir DIR] DATA_OVERRIDE... key=value ..."
            )
        )
        return 0
    try:
        arguments, config_dirs = split_arguments(argv)
        own, overrides = split_own_keys(arguments, TokenizeOptions)
        options = parse_key_values(own, TokenizeOptions)
        options.validate()
        out = Path(str(options.out)).expanduser()
        workers = options.workers or os.cpu_count() or 1
        data = load_experiment_config(overrides, config_dirs).data
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
            shard_tokens=options.shard_tokens,
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
