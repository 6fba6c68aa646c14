"""The training backend: model + optimizer behind ordered futures, checkpoints, model loading.

Layer: above `training.data`; knows nothing of RL or of the loops that drive it.
"""

from training.backend.pytorch import BackendError as BackendError
from training.backend.pytorch import PyTorchTrainingBackend as PyTorchTrainingBackend
from training.backend.pytorch import TrainFuture as TrainFuture
from training.backend.pytorch import load_model_and_tokenizer as load_model_and_tokenizer
