"""Data pipeline: document sources, tokenizer, packed token caches, streaming, and resumable batch loaders."""

from axtorch.data.batches import DataModule, TrainBatches
from axtorch.data.chat import ChatSourceConfig
from axtorch.data.chat_template import ChatTemplate
from axtorch.data.config import DataConfig
from axtorch.data.corpus_tokenizer import load_or_train_tokenizer
from axtorch.data.loader import BatchIterator, PackedDataModule, build_data
from axtorch.data.mixture import MixtureEntryConfig
from axtorch.data.packing import PackedSequences
from axtorch.data.parquet import ParquetSourceConfig
from axtorch.data.sources import (
    DocumentSource,
    HFDatasetSourceConfig,
    JsonlSourceConfig,
    PartitionedSource,
    PythonStdlibSourceConfig,
    SourceConfig,
    TextFilesSourceConfig,
)
from axtorch.data.streaming import StreamingDataModule
from axtorch.data.tokenizer import Tokenizer, TokenizerConfig, train_byte_level_bpe

__all__ = [
    "BatchIterator",
    "ChatSourceConfig",
    "ChatTemplate",
    "DataConfig",
    "DataModule",
    "DocumentSource",
    "HFDatasetSourceConfig",
    "JsonlSourceConfig",
    "MixtureEntryConfig",
    "PackedDataModule",
    "PackedSequences",
    "ParquetSourceConfig",
    "PartitionedSource",
    "PythonStdlibSourceConfig",
    "SourceConfig",
    "StreamingDataModule",
    "TextFilesSourceConfig",
    "Tokenizer",
    "TokenizerConfig",
    "TrainBatches",
    "build_data",
    "load_or_train_tokenizer",
    "train_byte_level_bpe",
]
