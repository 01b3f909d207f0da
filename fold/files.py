"""One way to write a file that something reads back (``fold-demo``'s results, the tuning cache, a
vLLM checkpoint's config, the training scripts' shards, checkpoints, resume state and released
weights, the real target's converted weights, the GPU script's results): into a temporary file
beside it, then renamed over it, so a reader never sees half a file and a write that fails or is
interrupted leaves the old file in place."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomically(path: str | os.PathLike, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` with a new path in ``path``'s folder, then rename ``tmp`` over ``path``.

    The temporary name is unique (two writers of one path never share it) and hidden
    (``.NAME.<random>SUFFIX``; the suffix is kept for writers that pick a format by it, such as
    matplotlib). If ``write`` raises, the temporary file is removed and the error propagates; a
    process killed outright (``SIGKILL``, or ``SIGTERM`` with no handler) can leave it behind, never a
    half ``path``. The file gets the mode a plain ``open`` would give it under the current umask, not
    ``mkstemp``'s 0600."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    umask = os.umask(0)
    os.umask(umask)
    try:
        write(Path(tmp))
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """:func:`write_atomically` for a text file."""
    write_atomically(path, lambda tmp: tmp.write_text(text))


def write_safetensors_atomically(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> None:
    """:func:`write_atomically` for a safetensors file of ``tensors`` (name -> contiguous CPU tensor).

    Every weights file goes through here: safetensors 0.8's ``save_file`` writes through a hidden
    temporary file of its own and leaves the result at mode 0600 whatever the umask, so a drafter
    saved with it alone could not be read by another user (a vLLM server's, say)."""
    from safetensors.torch import save_file

    write_atomically(path, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
