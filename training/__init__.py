"""Learning from data: configs, DataBuffer, tokenization and packing, the training backend,
checkpoints, loggers and the training loops.

Layering: pure data/tensor functions (sft_data, tokenize, packing) ← stateful components
(DataBuffer, PyTorchTrainingBackend) ← loops (run_sft_training) ← recipes (config → wiring).
"""

import rollouts.threads  # noqa: F401  (first: sets OpenMP's wait policy before torch loads)
from training.backend import BackendError as BackendError
from training.backend import PyTorchTrainingBackend as PyTorchTrainingBackend
from training.backend import TrainFuture as TrainFuture
from training.backend import load_model_and_tokenizer as load_model_and_tokenizer
from training.config import SFTRunConfig as SFTRunConfig
from training.config import load_config as load_config
from training.data_buffer import DataBuffer as DataBuffer
from training.packing import SFTBatch as SFTBatch
from training.packing import prepare_sft_batch as prepare_sft_batch
from training.sft import SFTData as SFTData
from training.sft import run_sft_training as run_sft_training
from training.sft_data import SFTRecord as SFTRecord
from training.sft_data import load_sft_jsonl as load_sft_jsonl
from training.tokenize import TokenizedSample as TokenizedSample
from training.tokenize import tokenize_conversation as tokenize_conversation
from training.tokenize import tokenize_records as tokenize_records
