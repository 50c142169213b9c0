"""Data pipeline: document sources, tokenizer, packed token caches and resumable batch loaders."""

from axtorch.data.config import DataConfig
from axtorch.data.loader import BatchIterator, DataModule, build_data
from axtorch.data.packing import PackedSequences
from axtorch.data.sources import (
    DocumentSource,
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    PythonStdlibSourceConfig,
    SourceConfig,
    TextFilesSourceConfig,
)
from axtorch.data.tokenizer import Tokenizer, TokenizerConfig, load_or_train_tokenizer

__all__ = [
    "BatchIterator",
    "DataConfig",
    "DataModule",
    "DocumentSource",
    "HFDatasetSourceConfig",
    "JsonlSourceConfig",
    "PackedSequences",
    "PythonStdlibSourceConfig",
    "SourceConfig",
    "TextFilesSourceConfig",
    "Tokenizer",
    "TokenizerConfig",
    "build_data",
    "load_or_train_tokenizer",
]
