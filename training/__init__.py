"""Learning from data: configs, DataBuffer, tokenization and packing, the training backend,
checkpoints, loggers and the training loops.

Layering: pure data/tensor functions (sft_data, tokenize, packing) ← stateful components
(DataBuffer, PyTorchTrainingBackend) ← loops (run_sft_training) ← recipes (config → wiring).
"""

import rollouts.threads  # noqa: F401  (first: sets OpenMP's wait policy before torch loads)
from training.backend import BackendError as BackendError
from training.backend.pytorch import PyTorchTrainingBackend as PyTorchTrainingBackend
from training.backend.pytorch import TrainFuture as TrainFuture
from training.backend.pytorch import load_model_and_tokenizer as load_model_and_tokenizer
from training.config import SFTRunConfig as SFTRunConfig
from training.config import load_config as load_config
from training.data.buffer import DataBuffer as DataBuffer
from training.data.packing import SFTBatch as SFTBatch
from training.data.packing import prepare_sft_batch as prepare_sft_batch
from training.data.sft_data import SFTRecord as SFTRecord
from training.data.sft_data import load_sft_jsonl as load_sft_jsonl
from training.data.tokenize import TokenizedSample as TokenizedSample
from training.data.tokenize import tokenize_conversation as tokenize_conversation
from training.data.tokenize import tokenize_records as tokenize_records
from training.loops.sft import SFTData as SFTData
from training.loops.sft import run_sft_training as run_sft_training
