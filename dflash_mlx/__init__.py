"""dflash_mlx: DFlash block-diffusion speculative decoding for mlx-lm models."""

from .models.config import DFlashConfig
from .engine.draft import DFlashDraft
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
from .engine.decoding import DraftCache, GenerationResponse, generate, stream_generate
from .engine.batch import Batch, batch_generate
from .models.loading import check_compatible, load, load_draft, save_draft

__version__ = "0.1.0"
