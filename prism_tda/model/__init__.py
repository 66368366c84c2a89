"""PRISM model: decoder backbone, prototype head, dense baseline, training and checkpoints."""

from .config import ModelConfig, TrainConfig
from .model import PRISM, Decomposition, HeadOutput, ModelOutput, PrototypeHead

__all__ = ["PRISM", "Decomposition", "HeadOutput", "ModelConfig", "ModelOutput", "PrototypeHead", "TrainConfig"]
