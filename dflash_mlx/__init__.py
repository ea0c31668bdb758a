"""dflash_mlx: DFlash block-diffusion speculative decoding for mlx-lm models."""

from .config import DFlashConfig
from .draft import DFlashDraft
from .errors import (
    DFlashError,
    DraftConfigError,
    DraftWeightsError,
    GenerationArgumentError,
    IncompatibleDraftError,
    ModelLoadError,
    ModelNotFoundError,
    UnsupportedModelError,
)
from .decoding import DraftCache, GenerationResponse, generate, stream_generate
from .batch import Batch, batch_generate
from .loading import check_compatible, load, load_draft, save_draft

__version__ = "0.1.0"
