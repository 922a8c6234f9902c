"""Model implementations loading Hugging Face checkpoints from a local directory."""

from worker.models.base import CausalLM
from worker.models.registry import SUPPORTED_ARCHITECTURES, check_tensor_parallel, load_model

__all__ = ["CausalLM", "SUPPORTED_ARCHITECTURES", "check_tensor_parallel", "load_model"]
